"""Model parallelism (issue #13): point-to-point ops, the communicator grid,
tensor-parallel layers (and pipeline parallelism).

    import matex.parallel as mp
    g = mp.grid(data=2, tensor=2)          # 4 ranks: 2 replicas x 2-way tensor parallel
    layer = mp.ColumnParallelDense(1024, grid=g, gather_output=False)
    t = mp.send(y, dest=1, comm=g.pipeline_slot)

Names resolve lazily so that importing this package does not import
TensorFlow before it is needed.
"""

__all__ = [
    "send", "recv", "sendrecv",
    "grid", "Grid",
    "PipelineModel", "StageBoundary",
    "ColumnParallelDense", "RowParallelDense", "ParallelConv2D", "shard_layer",
    "parameter_bytes", "gather_model", "save_model",
]

from matex import _lazy  # noqa: E402

_LAZY = {
    "send": "matex.parallel._p2p",
    "recv": "matex.parallel._p2p",
    "sendrecv": "matex.parallel._p2p",
    "grid": "matex.parallel._grid",
    "Grid": "matex.parallel._grid",
    "PipelineModel": "matex.parallel._pipeline",
    "StageBoundary": "matex.parallel._stages",
    "ColumnParallelDense": "matex.parallel._tensor",
    "RowParallelDense": "matex.parallel._tensor",
    "ParallelConv2D": "matex.parallel._tensor",
    "shard_layer": "matex.parallel._tensor",
    "parameter_bytes": "matex.parallel._tensor",
    "gather_model": "matex.parallel._tensor",
    "save_model": "matex.parallel._tensor",
}


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:   # type checkers and IDEs see the lazy names' own signatures
    from matex.parallel._grid import Grid, grid
    from matex.parallel._p2p import recv, send, sendrecv
    from matex.parallel._pipeline import PipelineModel
    from matex.parallel._stages import StageBoundary
    from matex.parallel._tensor import (ColumnParallelDense, ParallelConv2D, RowParallelDense,
                                        gather_model, parameter_bytes, save_model, shard_layer)

__getattr__, __dir__ = _lazy.attach(__name__, _LAZY, __all__)
