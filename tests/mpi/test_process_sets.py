"""Horovod's process sets (``matex.horovod`` on ``matex._process_sets``) against NumPy.

Runs on any rank count >= 2: on 2 and 3 ranks with the collectives suite, on 4
with the 4-rank pipeline suite (sets of 2 and 3 ranks there). Every rank runs
every test; each asserts values on every rank.
"""

import numpy as np
import pytest
import tensorflow as tf

import matex
import matex.horovod.tensorflow as hvd
from matex import _process_sets

R, N = matex.rank(), matex.size()
EVENS, ODDS = list(range(0, N, 2)), list(range(1, N, 2))
MODES = ["eager", "function"]


def rows_of(r, dtype, rows=3):
    """Rank ``r``'s test data: ``rows`` x 4 integers in [-50, 50) as ``dtype``."""
    rng = np.random.default_rng(100 + r)
    return rng.integers(-50, 50, size=(rows, 4)).astype(dtype)


def run(mode, fn, *args):
    return tf.function(fn)(*args) if mode == "function" else fn(*args)


@pytest.fixture
def halves():
    """Even and odd ranks as two disjoint process sets (removed after the test)."""
    evens, odds = hvd.add_process_set(EVENS), hvd.add_process_set(ODDS)
    yield (evens, EVENS) if R % 2 == 0 else (odds, ODDS)
    assert hvd.remove_process_set(evens) and hvd.remove_process_set(odds)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_disjoint_sets_reduce_at_the_same_time(halves, mode, dtype):
    ps, members = halves
    x = rows_of(R, dtype)
    total = sum(rows_of(m, dtype) for m in members)

    def reduce(t):
        return (hvd.allreduce(t, op=hvd.Sum, process_set=ps),
                hvd.allreduce(t, op=hvd.Max, process_set=ps),
                hvd.grouped_allreduce([t, t[:1] * 2], op=hvd.Sum, process_set=ps))

    summed, biggest, grouped = run(mode, reduce, tf.constant(x))
    np.testing.assert_array_equal(summed.numpy(), total)
    np.testing.assert_array_equal(biggest.numpy(),
                                  np.max([rows_of(m, dtype) for m in members], axis=0))
    np.testing.assert_array_equal(grouped[0].numpy(), total)
    np.testing.assert_array_equal(grouped[1].numpy(), total[:1] * 2)
    if dtype.startswith("float"):
        average = hvd.allreduce(tf.constant(x), process_set=ps)   # Horovod's default: Average
        np.testing.assert_allclose(average.numpy(), total / len(members), rtol=1e-12)
    assert ps.size() == len(members) and ps.rank() == members.index(R) and ps.included()
    assert int(hvd.size_op(process_set_id=ps.process_set_id)) == len(members)
    assert int(hvd.process_set_included_op(ps.process_set_id)) == 1


@pytest.mark.parametrize("mode", MODES)
def test_gather_broadcast_alltoall_reducescatter_within_sets(halves, mode):
    ps, members = halves
    mine = rows_of(R, "float32", rows=R + 1)   # first dimensions differ between ranks

    def gather(t):
        return (hvd.allgather(t, process_set=ps),
                hvd.grouped_allgather([t, t[:, :2]], process_set=ps),
                hvd.barrier(process_set=ps))

    gathered, grouped, barrier = run(mode, gather, tf.constant(mine))
    expected = np.concatenate([rows_of(m, "float32", rows=m + 1) for m in members])
    np.testing.assert_array_equal(gathered.numpy(), expected)
    np.testing.assert_array_equal(grouped[0].numpy(), expected)
    np.testing.assert_array_equal(grouped[1].numpy(), expected[:, :2])
    assert int(barrier) == len(members)
    for root in members:   # Horovod's root_rank is a global rank
        got = run(mode, lambda t: hvd.broadcast(t, root, process_set=ps),
                  tf.constant(rows_of(R, "float64")))
        np.testing.assert_array_equal(got.numpy(), rows_of(root, "float64"))
    # alltoall: member i sends row block j (j + 1 rows of value 10*i + j) to member j
    size, me = len(members), members.index(R)
    blocks = np.concatenate([np.full((j + 1, 2), 10 * me + j, np.int32) for j in range(size)])
    out, received = hvd.alltoall(tf.constant(blocks), splits=[j + 1 for j in range(size)],
                                 process_set=ps)
    np.testing.assert_array_equal(
        out.numpy(), np.concatenate([np.full((me + 1, 2), 10 * i + me, np.int32)
                                     for i in range(size)]))
    assert received.numpy().tolist() == [me + 1] * size
    # reducescatter: the sum over members, this member's rows (Horovod's split)
    x = rows_of(R, "float64", rows=5)
    part = hvd.reducescatter(tf.constant(x), op=hvd.Sum, process_set=ps)
    q, m = divmod(5, size)
    start = me * q + min(me, m)
    total = sum(rows_of(r, "float64", rows=5) for r in members)
    np.testing.assert_array_equal(part.numpy(), total[start:start + q + (me < m)])


def test_objects_and_variables_within_sets(halves):
    ps, members = halves
    assert hvd.allgather_object({"rank": R}, process_set=ps) == [{"rank": m} for m in members]
    root = members[-1]
    assert hvd.broadcast_object(("from", R), root_rank=root, process_set=ps) == ("from", root)
    v = tf.Variable(float(R))
    hvd.broadcast_variables([v], root_rank=root, process_set=ps)
    assert float(v.numpy()) == float(root)
    # IndexedSlices: gathered over the set, averaged by its size (Horovod)
    rows = tf.IndexedSlices(tf.constant([[float(R)]]), tf.constant([R]), tf.constant([N, 1]))
    got = hvd.allreduce(rows, op=hvd.Average, process_set=ps)
    assert got.indices.numpy().tolist() == members
    np.testing.assert_allclose(got.values.numpy().ravel(), [m / len(members) for m in members])


def test_gradients_stay_within_the_set(halves):
    ps, members = halves
    x = tf.constant(float(R + 1))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        summed = hvd.allreduce(x * x, op=hvd.Sum, process_set=ps)
        spread = hvd.broadcast(x * 3.0, members[0], process_set=ps)
    # d(sum over members of x_i^2)/dx_me summed over the members' losses: 2 x * set size
    assert float(tape.gradient(summed, x)) == 2.0 * (R + 1) * len(members)
    # Horovod's broadcast gradient: averaged over the set on the root, 0 elsewhere
    assert float(tape.gradient(spread, x)) == (3.0 if R == members[0] else 0.0)


def test_a_rank_outside_the_set_gets_an_error_the_members_go_on():
    ps = hvd.add_process_set(range(N - 1))   # every rank but the last (2 or 3 on 3/4 ranks)
    try:
        if R < N - 1:
            got = hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum, process_set=ps)
            assert got.numpy().tolist() == [float(sum(range(N - 1)))]
            assert ps.rank() == R and ps.included()
        else:
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="rank %d is not a member of process set %d"
                               % (R, ps.process_set_id)):
                hvd.allreduce(tf.constant([1.0]), process_set=ps)
            with pytest.raises(ValueError, match="not part of provided process set"):
                ps.rank()
            assert ps.included() is False
            assert int(hvd.process_set_included_op(ps.process_set_id)) == 0
            assert int(hvd.size_op(process_set_id=ps.process_set_id)) == N - 1
        # the global set still works for everyone afterwards
        assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == N
    finally:
        assert hvd.remove_process_set(ps)


def test_add_remove_readd_and_ids():
    first = hvd.add_process_set([0])
    second = hvd.add_process_set(range(1, N))
    assert _process_sets.table() == {0: list(range(N)), first.process_set_id: [0],
                                     second.process_set_id: list(range(1, N))}
    assert {first.process_set_id, second.process_set_id} == {1, 2}
    assert str(second) == "ProcessSet(process_set_id=%d, ranks=%s, mpi_comm=None)" % (
        second.process_set_id, list(range(1, N)))
    with pytest.raises(ValueError, match="duplicate process set"):
        hvd.add_process_set(range(N - 1, 0, -1))      # the same ranks as `second`
    with pytest.raises(ValueError, match="duplicate process set"):
        hvd.add_process_set(range(N))                  # the global set's ranks
    with pytest.raises(ValueError, match="ranks disagree on process set"):
        hvd.add_process_set([R])                       # every rank names another set
    with pytest.raises(ValueError, match="outside"):
        hvd.add_process_set([0, N])
    old = first.process_set_id
    assert hvd.remove_process_set(first) and first.process_set_id is None
    assert not hvd.remove_process_set(first)           # already removed
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="not a registered process set"):
        hvd.allreduce(tf.constant(1.0), process_set=first)
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 10   # Horovod's test does this: an unknown id is a ValueError
    with pytest.raises(ValueError):
        hvd.allreduce(tf.constant(1.0), process_set=fake)
    again = hvd.add_process_set(first)                 # re-added: the lowest free id again
    assert again is first and first.process_set_id == old
    if R == 0:
        assert float(hvd.allreduce(tf.constant(5.0), op=hvd.Sum, process_set=first)) == 5.0
    else:
        got = hvd.allreduce(tf.constant(float(R)), op=hvd.Sum, process_set=second)
        assert float(got) == float(sum(range(1, N)))
    assert hvd.remove_process_set(first) and hvd.remove_process_set(second)
    assert _process_sets.table() == {0: list(range(N))}


def test_init_with_process_sets_from_ranks_and_communicators():
    evens, odds = hvd.ProcessSet(EVENS), hvd.ProcessSet(ODDS)
    with pytest.raises(ValueError, match="entry number 2 is a duplicate"):
        hvd.init(process_sets=[evens, odds, hvd.ProcessSet(EVENS)])
    assert {evens.process_set_id, odds.process_set_id} == {1, 2}
    # a later init naming a registered set stands for it (Horovod): same id, it works
    again = hvd.ProcessSet(EVENS)
    hvd.init(process_sets=[again])
    assert again.process_set_id == evens.process_set_id
    assert sorted(_process_sets.table()) == [0, 1, 2]
    if R % 2 == 0:
        assert hvd.allgather_object(R, process_set=again) == EVENS
    for ps in (evens, odds):
        assert hvd.remove_process_set(ps)
    half = matex.comm().Split(R % 2, R)   # each rank passes its own half, as Horovod allows
    try:
        ps = hvd.ProcessSet(half)
        hvd.init(process_sets=[ps])
        assert ps.ranks == (EVENS if R % 2 == 0 else ODDS)
        assert sorted(_process_sets.table()) == [0, 1, 2]
        assert hvd.allgather_object(R, process_set=ps) == ps.ranks
        other = _process_sets.get(1 if ps.process_set_id == 2 else 2)   # the other half's set
        assert hvd.remove_process_set(ps)
        assert other.ranks == (ODDS if R % 2 == 0 else EVENS) and not other.included()
        assert hvd.remove_process_set(other)
    finally:
        half.Free()
    assert _process_sets.table() == {0: list(range(N))}


def test_tape_and_optimizer_average_within_the_set():
    ps = hvd.add_process_set(range(N - 1))   # the last rank stays out
    members = list(range(N - 1))
    try:
        x = tf.Variable(float(R + 1))
        with tf.GradientTape() as tape:
            y = x * x
        tape = hvd.DistributedGradientTape(tape, process_set=ps)
        (grad,) = tape.gradient(y, [x])
        # members: 2 x averaged over the set; the rank outside keeps its own (Horovod)
        want = (2.0 * sum(m + 1 for m in members) / len(members) if R in members
                else 2.0 * (R + 1))
        assert float(grad) == pytest.approx(want, rel=1e-6)
        import keras

        w = tf.Variable([0.0])
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum, process_set=ps)
        opt.apply([tf.constant([float(R + 1)])], [w])
        want = (-float(sum(m + 1 for m in members)) if R in members else -float(R + 1))
        assert w.numpy().tolist() == [want]
    finally:
        assert hvd.remove_process_set(ps)


def test_two_sets_train_two_models_each_within_itself(halves):
    """Horovod's pattern: each set trains its own model inside ``if ps.included():``, with
    ``DistributedOptimizer(process_set=ps)``. Its first apply broadcast rank 0's weights
    over every rank (an implicit first-step sync): the odd set's model was overwritten by
    the even set's (or, with one set training alone, the job hung). Now each optimizer
    reduces over its set and broadcasts nothing: each model is its own set's."""
    import keras

    ps, members = halves
    assert ps.included()
    start = 10.0 * (R % 2) + 1.0           # the even set's model, the odd set's model
    w = tf.Variable([start, -start])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), process_set=ps)
    for step in range(2):
        opt.apply([tf.constant([float(R + 1), float(step)])], [w])
    mean = sum(m + 1 for m in members) / len(members)
    np.testing.assert_allclose(w.numpy(), [start - 0.5 * 2 * mean, -start - 0.5 * 1.0],
                               rtol=1e-6)


def test_registered_local_variables_keep_their_own_values():
    """register_local_var: a per-rank variable is updated by its own gradient only. The
    optimizer's first apply used to broadcast rank 0's value of it (and of every
    variable) first, which undid the per-rank state."""
    import keras

    shared, local = tf.Variable([1.0, 2.0]), tf.Variable([10.0 * (R + 1)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0))
    opt.register_local_var(local)
    opt.apply([tf.constant([float(R), 1.0]), tf.constant([float(R + 1)])], [shared, local])
    np.testing.assert_allclose(shared.numpy(), [1.0 - (N - 1) / 2, 1.0], rtol=1e-6)
    # its own gradient, scaled by 1 / size as Horovod scales local gradients
    np.testing.assert_allclose(local.numpy(), [10.0 * (R + 1) - (R + 1) / N], rtol=1e-6)


def test_remove_called_on_some_ranks_only_is_an_error_on_every_rank():
    """remove_process_set is collective. Called on the set's members only, it removed the
    set there and nowhere else; the others' next add of the same ranks blocked in Split
    while the members' raised. Now both calls meet: a ValueError on every rank, and the
    set is still registered everywhere."""
    members = list(range(max(1, N - 1)))
    ps = hvd.add_process_set(members)
    if R in members:
        with pytest.raises(ValueError, match="remove_process_set is collective"):
            hvd.remove_process_set(ps)
    else:
        with pytest.raises(ValueError, match="remove_process_set"):
            hvd.add_process_set(members)
    assert hvd.remove_process_set(ps)                     # every rank: removed at once
    assert not hvd.remove_process_set(ps)                 # and only once
