"""``horovod.common.elastic``: ``State``, ``ObjectState``, ``run_fn`` (matex.horovod.elastic)."""

from matex.horovod.elastic import ObjectState, State, run, run_fn

__all__ = ["State", "ObjectState", "run", "run_fn"]
