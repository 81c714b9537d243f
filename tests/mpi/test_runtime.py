"""The communicator state: control traffic apart from data, replaced communicators freed."""

from mpi4py import MPI

import matex
from matex import _runtime


def test_control_communicator_is_a_separate_duplicate_of_the_data_one():
    data, control = matex.comm(), _runtime.control()
    assert MPI.Comm.Compare(data, control) == MPI.CONGRUENT   # same ranks, own context
    assert control.allgather(matex.rank()) == list(range(matex.size()))


def test_replacing_the_communicator_frees_the_ones_it_replaces():
    before = (_runtime._comm, _runtime._control, _runtime._local)
    try:
        _runtime._set_comm(MPI.COMM_WORLD.Dup())        # MaTEx's own: freed when replaced
        mine = (_runtime._comm, _runtime._control, _runtime._local)
        assert all(c == MPI.COMM_NULL for c in before)
        script_comm = MPI.COMM_WORLD.Dup()
        _runtime._set_comm(script_comm, owned=False)   # the script's: never freed by MaTEx
        assert all(c == MPI.COMM_NULL for c in mine)
        _runtime._set_comm(MPI.COMM_WORLD.Dup())
        assert script_comm != MPI.COMM_NULL and script_comm.allreduce(1) == matex.size()
        script_comm.Free()
        assert float(matex.allreduce(1.0, "sum")) == matex.size()   # ops follow the swap
    finally:
        if _runtime._comm is None or _runtime._comm == MPI.COMM_NULL:
            _runtime._set_comm(MPI.COMM_WORLD.Dup())


def test_on_every_rank_raises_the_lowest_failing_ranks_error_on_every_rank():
    import pytest

    from matex._everywhere import RemoteError, on_every_rank

    control, rank, size = _runtime.control(), matex.rank(), matex.size()
    assert on_every_rank(control, lambda: rank * 2) == rank * 2   # no failure: own result
    closed = []

    def fails_on_last():
        if rank == size - 1:
            raise KeyError("only on the last rank")
        return "opened"

    with pytest.raises(RemoteError) as info:
        on_every_rank(control, fails_on_last, what="test", discard=closed.append)
    assert str(info.value).startswith("test: rank %d: KeyError:" % (size - 1))
    assert closed == ([] if rank == size - 1 else ["opened"])   # the others close theirs
    if rank == size - 1:
        assert isinstance(info.value.__cause__, KeyError)

    def fails_everywhere_but_0():
        if rank:
            raise OSError("rank %d cannot" % rank)

    if size > 1:
        with pytest.raises(ValueError, match="rank 1: OSError: rank 1 cannot") as info:
            on_every_rank(control, fails_everywhere_but_0, error_type=ValueError)
        if size > 2:
            assert "(and 1 more rank)" in str(info.value)
    assert control.allreduce(1) == size   # the communicator is still in step


def test_monitor_restarts_its_exchanges_alike_after_a_recovery():
    """The live monitor's allgathers stay paired after a rank loss.

    A failure can end one survivor's exchange and not another's (ULFM errors
    are not uniform), so they leave with different next exchange steps; the
    recovery loop then re-runs ``fit`` (``on_train_begin``) on every survivor
    at the same point. Before, the counts stayed apart and the exchanges met
    the epoch's allgather: an IndexError on one rank, a hang on another.
    """
    import io

    from matex.callbacks import MonitorCallback

    rank, size = matex.rank(), matex.size()
    cb = MonitorCallback(global_batch=8, interval=1e-6, stream=io.StringIO())
    cb.on_train_begin()
    cb.step, cb.every = 13, 4
    cb.next_exchange = 20 if rank == 0 else 16   # rank 0's exchange at 16 went through
    cb.on_train_begin()   # the recovery loop re-runs fit
    logs = {}
    cb.on_epoch_begin(0)
    for b in range(8):
        cb.on_train_batch_begin(b)
        cb.on_train_batch_end(b)
    cb.on_epoch_end(0, logs)
    assert logs["matex_slowest_rank"] in range(size)
    assert logs["matex_samples_per_s"] > 0
    assert len(set(_runtime.control().allgather(cb.next_exchange))) == 1
