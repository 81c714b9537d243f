"""Cast compression: float gradients travel as float16 or bfloat16 (half the bytes of
float32), summed in float32 per pair inside MPI's reduction, cast back after."""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from matex import _fusion
from matex.compression._base import Compressor, Item, check_float


class Cast(Compressor):
    """Every float gradient cast to ``wire_dtype`` for the allreduce (fused as usual)."""

    def __init__(self, wire_dtype: tf.dtypes.DType | str, name: str) -> None:
        super().__init__(min_size=0)
        self.wire_dtype = tf.as_dtype(wire_dtype)
        self.name = name

    def selects(self, item: Item) -> bool:
        check_float(item, self.name)
        return item.size is not None

    def reduce(self, items: Sequence[Item], op: str,
               threshold: int) -> tuple[list[tf.Tensor], list[int]]:
        wire = [tf.cast(it.grad, self.wire_dtype) for it in items]
        reduced = _fusion.allreduce_gradients(wire, op, threshold, [it.name for it in items])
        out = [tf.cast(r, it.grad.dtype) for r, it in zip(reduced, items)]
        return out, [it.size * self.wire_dtype.size for it in items]

    def __repr__(self):
        return self.name


FP16 = Cast(tf.float16, "FP16")   # like Horovod's Compression.fp16
BF16 = Cast(tf.bfloat16, "BF16")  # float32's exponent range: no overflow, coarser mantissa
