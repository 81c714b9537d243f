"""Compressors from text (``compression="topk:0.01"``, ``MATEX_COMPRESSION``).

Apart from ``_base`` so that the interface module imports none of its
subclasses: this module sits above them all.
"""

from __future__ import annotations

from matex import _config, _state
from matex.compression import _cast, _powersgd, _randomk, _topk
from matex.compression._base import Compressor

def from_spec(spec: Compressor | str | None) -> Compressor | None:
    """A compressor from text such as "fp16", "bf16", "topk:0.01", "randomk:0.01",
    "powersgd:4", "none"; a Compressor is returned as is; None/"none" give None."""
    if spec is None or isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str):
        raise TypeError("compression must be a matex.compression compressor, a string such "
                        "as 'topk:0.01', or None, not %r" % (spec,))
    parsed = _config.parse_compression(spec, "compression")
    return None if parsed is None else build(*parsed)


# (kind, value) -> compressor: one per text, so its residuals outlive a tape (a tape made
# each step); its per-variable state is dropped with the variables (_base.PerVariable)
_built = _state.table("compression.spec.built", lifetime="session")


def build(kind, value):
    """The compressor ``_config.parse_compression`` described (the same object per text)."""
    if (kind, value) not in _built:
        _built[kind, value] = _make(kind, value)
    return _built[kind, value]


def _make(kind, value):
    if kind == "fp16":
        return _cast.FP16
    if kind == "bf16":
        return _cast.BF16
    if kind == "topk":
        return _topk.TopK(value)
    if kind == "randomk":
        return _randomk.RandomK(value)
    return _powersgd.PowerSGD(int(value))


def from_environment():
    """The compressor ``MATEX_COMPRESSION`` asks for, or None."""
    parsed = _config.compression()
    return None if parsed is None else build(*parsed)
