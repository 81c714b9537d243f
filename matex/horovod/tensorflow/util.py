"""``horovod.tensorflow.util``: the helper Horovod-style tests import."""

from matex.horovod._api import _executing_eagerly

__all__ = ["_executing_eagerly"]
