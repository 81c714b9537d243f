"""``horovod.tensorflow.compression``: ``Compression`` and the ``Compressor`` interface a
script subclasses for its own compressor (``compression=`` of the tape and optimizer)."""

from matex.horovod._compression import (Compression, Compressor, FP16Compressor,
                                        NoneCompressor)

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
