"""The communicator state: control traffic apart from data, replaced communicators freed;
the CPU defaults per rank (compute threads, MPI's wait policy)."""

import os

import pytest
from mpi4py import MPI

import matex
from matex import _cpu, _runtime


def test_tensorflow_threads_are_this_ranks_share_of_the_nodes_cores():
    matex.init()
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    cores = local.allgather(sorted(os.sched_getaffinity(0)))
    local.Free()
    if len({tuple(c) for c in cores}) != 1:
        pytest.skip("the node's ranks are bound to different cores: %s" % cores)
    # unbound ranks (every rank may run on every core): the cores shared out, at least one
    assert os.environ["TF_NUM_INTRAOP_THREADS"] == str(max(1, len(cores[0]) // len(cores)))


def test_a_rank_bound_to_its_own_cores_gets_them_and_shared_cores_are_split():
    own = [frozenset({0, 1}), frozenset({2, 3})]
    assert _cpu.share_of(own[0], own) == 2                     # bound: its own cores
    every = [frozenset(range(8))] * 3
    assert _cpu.share_of(every[0], every) == 2                 # 8 cores, 3 ranks: 2
    assert _cpu.share_of(frozenset({0}), [frozenset({0})] * 4) == 1   # never 0
    mixed = [frozenset({0, 1, 2, 3}), frozenset({2, 3})]           # 0, 1 alone; 2, 3 halved
    assert _cpu.share_of(mixed[0], mixed) == 3


class _Local:
    def __init__(self, everyones):
        self.everyones = everyones

    def allgather(self, mine):
        return self.everyones

    def Get_size(self):
        return len(self.everyones)


def test_the_users_thread_choice_stands(monkeypatch):
    node = _Local([list(range(4))] * 2)
    monkeypatch.setattr(_cpu, "_affinity", lambda: frozenset(range(4)))
    for name in ("TF_NUM_INTRAOP_THREADS", "MATEX_INTRA_OP_THREADS", "MATEX_INTRA_OP_THREADS_SET"):
        monkeypatch.setenv(name, "")   # recorded, so that the test's values are undone
        monkeypatch.delenv(name)
    assert _cpu.size_pools(node) == 2 and os.environ["TF_NUM_INTRAOP_THREADS"] == "2"
    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "3")               # TensorFlow's own setting
    assert _cpu.size_pools(node) is None and os.environ["TF_NUM_INTRAOP_THREADS"] == "3"
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS")
    monkeypatch.setenv("MATEX_INTRA_OP_THREADS", "tf")             # TensorFlow's default
    assert _cpu.size_pools(node) is None and "TF_NUM_INTRAOP_THREADS" not in os.environ
    monkeypatch.setenv("MATEX_INTRA_OP_THREADS", "5")
    assert _cpu.size_pools(node) == 5 and os.environ["TF_NUM_INTRAOP_THREADS"] == "5"
    monkeypatch.setenv("TF_NUM_INTRAOP_THREADS", "5")               # inherited from a rank:
    monkeypatch.setenv("MATEX_INTRA_OP_THREADS", "auto")           # sized again
    assert _cpu.size_pools(node) == 2 and os.environ["TF_NUM_INTRAOP_THREADS"] == "2"
    monkeypatch.setenv("MATEX_INTRA_OP_THREADS", "0")
    with pytest.raises(ValueError, match="MATEX_INTRA_OP_THREADS"):
        _cpu.size_pools(node)


def test_control_communicator_is_a_separate_duplicate_of_the_data_one():
    data, control = matex.comm(), _runtime.control()
    assert MPI.Comm.Compare(data, control) == MPI.CONGRUENT   # same ranks, own context
    assert control.allgather(matex.rank()) == list(range(matex.size()))


def test_replacing_the_communicator_frees_the_ones_it_replaces():
    before = (_runtime._now.comm, _runtime._now.control, _runtime._now.local)
    try:
        _runtime._set_comm(MPI.COMM_WORLD.Dup())        # MaTEx's own: freed when replaced
        mine = (_runtime._now.comm, _runtime._now.control, _runtime._now.local)
        assert all(c == MPI.COMM_NULL for c in before)
        script_comm = MPI.COMM_WORLD.Dup()
        _runtime._set_comm(script_comm, owned=False)   # the script's: never freed by MaTEx
        assert all(c == MPI.COMM_NULL for c in mine)
        _runtime._set_comm(MPI.COMM_WORLD.Dup())
        assert script_comm != MPI.COMM_NULL and script_comm.allreduce(1) == matex.size()
        script_comm.Free()
        assert float(matex.allreduce(1.0, "sum")) == matex.size()   # ops follow the swap
    finally:
        if _runtime._now.comm is None or _runtime._now.comm == MPI.COMM_NULL:
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


def test_on_one_node_mpi_starts_without_the_libfabric_transport(monkeypatch):
    # this rank's job is on one node: ``import matex`` left Open MPI's ofi BTL out
    assert os.environ.get("OMPI_MCA_btl") == "^ofi"
    names = ("OMPI_MCA_btl", "MATEX_MPI_BTL_SET", "OMPI_COMM_WORLD_SIZE",
             "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
             "MV2_COMM_WORLD_RANK", "SLURM_PROCID")
    for name in names:
        monkeypatch.setenv(name, "")   # recorded, so that the test's values are undone
        monkeypatch.delenv(name)
    assert _cpu.set_mpi_transports() == "^ofi"             # no launcher: a singleton
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert _cpu.set_mpi_transports() == "^ofi"             # 4 ranks, all of them here
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")  # two nodes: MaTEx's value taken back
    assert _cpu.set_mpi_transports() is None
    assert "OMPI_MCA_btl" not in os.environ and "MATEX_MPI_BTL_SET" not in os.environ
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("PMIX_RANK", "0")                   # a launcher that does not say
    assert _cpu.set_mpi_transports() is None and "OMPI_MCA_btl" not in os.environ
    monkeypatch.delenv("PMIX_RANK")
    monkeypatch.setenv("OMPI_MCA_btl", "self,sm,ofi")      # the user's: stands
    assert _cpu.set_mpi_transports() is None
    assert os.environ["OMPI_MCA_btl"] == "self,sm,ofi"


def test_a_waiting_rank_yields_its_core_unless_told_otherwise(monkeypatch):
    # this rank started MPI yielding (``import matex`` set it, or the harness's did)
    assert os.environ.get("OMPI_MCA_mpi_yield_when_idle") == "1"
    for name in ("OMPI_MCA_mpi_yield_when_idle", "MATEX_MPI_WAIT", "MATEX_MPI_WAIT_SET"):
        monkeypatch.setenv(name, "")   # recorded, so that the test's values are undone
        monkeypatch.delenv(name)
    assert _cpu.set_mpi_wait_policy() == "1"
    assert os.environ["OMPI_MCA_mpi_yield_when_idle"] == "1"
    monkeypatch.setenv("MATEX_MPI_WAIT", "poll")       # inherited from MaTEx: taken back
    assert _cpu.set_mpi_wait_policy() is None
    assert "OMPI_MCA_mpi_yield_when_idle" not in os.environ
    monkeypatch.setenv("OMPI_MCA_mpi_yield_when_idle", "0")   # the user's: stands
    monkeypatch.setenv("MATEX_MPI_WAIT", "yield")
    assert _cpu.set_mpi_wait_policy() is None
    assert os.environ["OMPI_MCA_mpi_yield_when_idle"] == "0"
    monkeypatch.setenv("MATEX_MPI_WAIT", "spin")
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle")
    with pytest.raises(ValueError, match="MATEX_MPI_WAIT"):
        _cpu.set_mpi_wait_policy()
