"""TF1 graph code (``tf.compat.v1`` Sessions) and Keras 2 (tf-keras) on MaTEx.

The modules here are private; the public entry points are
``matex.horovod.tensorflow`` (Horovod's TF1 API) and the unmodified-script
path (``python -m matex`` / ``matexrun``). See docs/legacy.md.
"""

__all__: list[str] = []
