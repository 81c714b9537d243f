"""``horovod.common.util``: version comparison and GPU presence."""

from __future__ import annotations

from packaging import version


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Whether version ``ver`` is at least ``target`` (PEP 440 comparison)."""
    return version.parse(ver) >= version.parse(target)


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether Horovod's ``ext_base_name`` extension runs with a GPU.

    "tensorflow": whether TensorFlow sees a GPU (MaTEx's collectives still
    run on host memory). Any other framework ("torch", "mxnet"): False, as
    Horovod answers for an extension that is not there.
    """
    if ext_base_name != "tensorflow":
        return False
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))
