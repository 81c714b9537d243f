"""Horovod's ``hvd.Compression``: how a tensor is cast before a collective and after it."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from matex import _fusion, _state
from matex.compression._base import Compressor as _MatexCompressor


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, context)``, ``decompress(tensor, context)``."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """The tensor to send, and what ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """The received tensor restored."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """``tensor`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """``tensor`` unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 and casts them back."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """A float tensor as float16 (others unchanged); the context is the dtype."""
        if tensor.dtype.is_floating:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Back to the original dtype."""
        return tf.cast(tensor, ctx) if ctx is not None and ctx.is_floating else tensor


class Compression:
    """The compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def as_matex_compressor(compression: type[Compressor] | Compressor) -> Any:
    """What MaTEx's reductions take for Horovod's ``compression=``: "none", "fp16", or, for
    a user's own ``Compressor``, one object that applies its ``compress`` before the fused
    allreduce and its ``decompress`` after (one per compressor, so a traced step keeps it)."""
    if compression is Compression.fp16:
        return "fp16"
    if compression in (None, Compression.none):
        return "none"
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError("compression must be an hvd.Compression member or a Compressor "
                        "(compress/decompress), not %r" % (compression,))
    if compression not in _adapters:
        _adapters[compression] = _UsersCompressor(compression)
    return _adapters[compression]


# compressor -> its adapter; a session cache: an adapter holds only its compressor, a
# reduction keeps the one it was given, and a missing one is made again on demand
_adapters: dict = _state.table("horovod.compression.adapters")


class _UsersCompressor(_MatexCompressor):
    """A Horovod ``Compressor`` of the user's: every dense gradient is compressed, the
    compressed tensors reduced (fused, as usual), and each decompressed."""

    def __init__(self, horovod_compressor: Any) -> None:
        super().__init__(min_size=0)
        self.horovod_compressor = horovod_compressor
        self.name = getattr(horovod_compressor, "__name__", type(horovod_compressor).__name__)

    def selects(self, item: Any) -> bool:
        return item.size is not None

    def reduce(self, items, op, threshold):
        pairs = [self.horovod_compressor.compress(it.grad) for it in items]
        wire = [tf.convert_to_tensor(t) for t, _ in pairs]
        reduced = _fusion.allreduce_gradients(wire, op, threshold, [it.name for it in items])
        out = [tf.cast(self.horovod_compressor.decompress(r, ctx), it.grad.dtype)
               for r, (_, ctx), it in zip(reduced, pairs, items)]
        return out, [(w.shape.num_elements() or 0) * w.dtype.size for w in wire]

    def __repr__(self):
        return "hvd compressor %s" % self.name
