"""Gradient compression for ``DistributedOptimizer``: fewer bytes on the wire per step.

    from matex.compression import FP16, BF16, TopK, RandomK, PowerSGD
    opt = matex.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=TopK(0.01))

or ``MATEX_COMPRESSION=topk:0.01`` for ``matex.keras`` / ``python -m matex``.

``FP16``/``BF16`` cast every float gradient on the wire; ``TopK``, ``RandomK``
and ``PowerSGD`` compress the large matrices (``min_size`` elements or more,
rank >= 2) and keep the rest (biases, norms, small tensors) on the dense
fused allreduce. Every rank applies the same averaged gradient, bitwise;
error-feedback residuals are per rank. See README "Communicating less".
"""

from matex.compression._base import Compressor
from matex.compression._spec import from_spec
from matex.compression._cast import BF16, FP16, Cast
from matex.compression._powersgd import PowerSGD
from matex.compression._randomk import RandomK
from matex.compression._topk import TopK

__all__ = ["Compressor", "FP16", "BF16", "Cast", "TopK", "RandomK", "PowerSGD", "from_spec"]
