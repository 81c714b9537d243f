"""``horovod.common.util``: version comparison and GPU presence."""

from __future__ import annotations

from packaging import version


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Whether version ``ver`` is at least ``target`` (PEP 440 comparison)."""
    return version.parse(ver) >= version.parse(target)


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether TensorFlow sees a GPU (``ext_base_name`` must be "tensorflow")."""
    if ext_base_name != "tensorflow":
        raise ValueError("MaTEx supports only tensorflow, not %r" % ext_base_name)
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))
