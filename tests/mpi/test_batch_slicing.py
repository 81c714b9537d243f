"""matex._batch_slicing under mpiexec: the "already sharded" mark, rank/size read at run time,
and what fit/evaluate/predict hand Keras on each rank.

The mark must survive any tf.data transformation (else ``fit`` slices a
second time and trains on 1/N of the data per rank), and slicing must follow
the communicator in use when a batch is produced (else a pipeline built
before a shrink keeps slicing for the old number of ranks). A rank with an
empty slice must leave BatchNormalization's statistics alone; a model's own
``train_step`` gets the structure Keras gives it (``x`` alone without
targets, lists as tuples); a fit resumed from a backup shuffles each epoch
as an uninterrupted run did.
"""

import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import matex
from matex import _batch_slicing
from helpers import all_equal_bytes, gather
from subcomm import SubCommunicator

R, N = matex.rank(), matex.size()
ROWS, BATCH = 30, 6              # 5 global batches of 6 rows: ids 0..29


def global_batches():
    """Global batches of (x, y): x[:, 0] is the row id."""
    ids = np.arange(ROWS, dtype=np.float32)
    x = np.stack([ids, 2 * ids], axis=1)
    return tf.data.Dataset.from_tensor_slices((x, ids.astype(np.int64))).batch(BATCH)


def expected_slices(rank, size):
    """Ids of the rows ``rank`` of ``size`` takes from each global batch."""
    out = []
    for start in range(0, ROWS, BATCH):
        batch = list(range(start, min(start + BATCH, ROWS)))
        lo, hi = _batch_slicing.slice_bounds(len(batch), rank, size)
        out.append(batch[lo:hi])
    return out


def ids_of(dataset):
    return [[int(v) for v in x[:, 0].numpy()] for x, _ in dataset]


def plain_map(x, y):
    return x * 1.0, y


CHAINS = {
    "map": lambda d: d.map(plain_map),
    "prefetch": lambda d: d.prefetch(2),
    "cache": lambda d: d.cache(),
    "repeat": lambda d: d.repeat(2),
    "take": lambda d: d.take(3),
    "filter": lambda d: d.filter(lambda x, y: tf.size(y) >= 0),
    "map.cache.take.repeat.prefetch": lambda d: d.map(plain_map).cache().take(3).repeat(
        2).prefetch(1),
    "unbatch.batch": lambda d: d.unbatch().batch(4),
    "shuffle.skip": lambda d: d.shuffle(4, seed=1).skip(1),
    "with_options (DATA policy)": lambda d: d.with_options(data_policy()),
}


def data_policy():
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return options


# ---- the mark ---------------------------------------------------------------------

@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_mark_survives_transformations(chain):
    sharded = matex.shard(global_batches())
    transformed = CHAINS[chain](sharded)
    assert _batch_slicing.is_sharded(sharded) and _batch_slicing.is_sharded(transformed)
    assert matex.shard(transformed) is transformed       # fit's entry point: unchanged
    assert not _batch_slicing.is_sharded(CHAINS[chain](global_batches()))


def test_chain_after_shard_is_not_sliced_again():
    # .map after matex.shard: each rank still gets its whole slice of every global batch
    pipeline = matex.shard(global_batches()).map(plain_map).prefetch(1)
    assert ids_of(matex.shard(pipeline)) == expected_slices(R, N)
    everyone = gather(ids_of(matex.shard(pipeline)))
    seen = sorted(i for rank in everyone for batch in rank for i in batch)
    assert seen == list(range(ROWS))                     # every row once, over all ranks


def test_user_options_do_not_count_as_sharded():
    # A script that turns tf.distribute's auto-sharding OFF has not sharded for MaTEx
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.framework_type = ["keras"]
    plain = global_batches().with_options(options)
    assert not _batch_slicing.is_sharded(plain)
    assert ids_of(matex.shard(plain)) == expected_slices(R, N)


def test_zip_with_a_sharded_input_counts_as_sharded():
    sharded = matex.shard(global_batches())
    assert _batch_slicing.is_sharded(tf.data.Dataset.zip((sharded, global_batches())))


def test_array_shards_and_pydataset_are_marked():
    shards = _batch_slicing.ArrayShards((np.zeros((10, 2)), np.zeros(10)), 4, False, 0)
    assert _batch_slicing.is_sharded(shards.dataset().map(lambda x, y: (x, y)))

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.zeros((4, 2)), np.zeros(4)

    assert not _batch_slicing.is_sharded(Batches())
    assert _batch_slicing.is_sharded(_batch_slicing.shard_pydataset(Batches()))
    assert not _batch_slicing.is_sharded(np.zeros(3)) and not _batch_slicing.is_sharded(None)


def test_is_sharded_inside_tf_function():
    sharded = matex.shard(global_batches())

    @tf.function
    def build():
        assert _batch_slicing.is_sharded(sharded.map(plain_map))
        assert not _batch_slicing.is_sharded(global_batches())
        return tf.constant(0)

    build()


# ---- rank and size at run time ----------------------------------------------------

def last_rank_alone():
    """Ranks 0..N-2 in one communicator, the last rank in its own (as after a shrink)."""
    return SubCommunicator(lambda rank: 1 if rank == N - 1 else 0)


needs_two = pytest.mark.skipif(N < 2, reason="needs 2 ranks or more")


@needs_two
def test_shard_reads_rank_and_size_when_the_pipeline_runs():
    sharded = matex.shard(global_batches())
    mapped = sharded.map(plain_map).prefetch(2)
    before = (ids_of(sharded), ids_of(mapped))
    with last_rank_alone() as sub:
        rank, size = sub.comm.Get_rank(), sub.comm.Get_size()
        after = (ids_of(sharded), ids_of(mapped))        # the same objects, iterated again
    again = (ids_of(sharded), ids_of(mapped))
    assert before == (expected_slices(R, N),) * 2
    assert after == (expected_slices(rank, size),) * 2, (rank, size, after)
    assert again == before                               # the old communicator is back


@needs_two
def test_generator_reads_rank_and_size_per_batch():
    def batches():
        for start in range(0, ROWS, BATCH):
            yield np.arange(start, start + BATCH)

    sliced = _batch_slicing.shard_generator(batches())
    first = next(sliced).tolist()
    with last_rank_alone() as sub:
        rank, size = sub.comm.Get_rank(), sub.comm.Get_size()
        second = next(sliced).tolist()
    third = next(sliced).tolist()
    assert first == expected_slices(R, N)[0]
    assert second == expected_slices(rank, size)[1]
    assert third == expected_slices(R, N)[2]


@needs_two
def test_array_shards_follow_the_communicator_on_the_next_pass():
    # (already so before run-time slicing: kept as a regression test)
    ids = np.arange(ROWS)
    shards = _batch_slicing.ArrayShards((ids,), BATCH, False, 0)
    dataset = shards.dataset()
    before = [b[0].numpy().tolist() for b in dataset]
    with last_rank_alone() as sub:
        rank, size = sub.comm.Get_rank(), sub.comm.Get_size()
        after = [b[0].numpy().tolist() for b in dataset]
    assert before == expected_slices(R, N)
    assert after == expected_slices(rank, size)


@needs_two
def test_pydataset_reads_rank_and_size_per_batch():
    # (already so before run-time slicing: kept as a regression test)
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return ROWS // BATCH

        def __getitem__(self, i):
            return np.arange(i * BATCH, (i + 1) * BATCH)

    sharded = _batch_slicing.shard_pydataset(Batches())
    before = sharded[1].tolist()
    with last_rank_alone() as sub:
        rank, size = sub.comm.Get_rank(), sub.comm.Get_size()
        after = sharded[1].tolist()
    assert before == expected_slices(R, N)[1]
    assert after == expected_slices(rank, size)[1]


# ---- fit/evaluate/predict on arrays: what Keras gets on each rank ------------------

def test_batchnorm_rank_with_empty_slice_keeps_its_statistics():
    # 17 rows in global batches of 8: the last batch has 1 row, so on 2 or 3 ranks
    # some rank's slice of it is empty; its moments would be 0/0 = NaN
    import matex.keras  # noqa: F401 - installs the Keras patches

    rows, batch, momentum, epochs = 17, 8, 0.5, 2
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(rows, 3)) * 2.0 + 1.0).astype("float32")
    y = rng.normal(size=(rows, 1)).astype("float32")
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(momentum=momentum),
                              keras.layers.Dense(4),
                              keras.layers.BatchNormalization(momentum=momentum),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    first = model.layers[0]
    # the first layer's statistics are those of the data: each rank updates from its
    # non-empty slices only, and fit averages the ranks' statistics after each epoch
    mean, var = np.zeros(3), np.ones(3)
    for _ in range(epochs):
        ranks = []
        for r in range(N):
            m, v = mean.copy(), var.copy()
            for start in range(0, rows, batch):
                whole = x[start:start + batch].astype(np.float64)
                lo, hi = _batch_slicing.slice_bounds(len(whole), r, N)
                if hi > lo:
                    m = momentum * m + (1 - momentum) * whole[lo:hi].mean(0)
                    v = momentum * v + (1 - momentum) * whole[lo:hi].var(0)
            ranks.append((m, v))
        mean, var = np.mean([m for m, _ in ranks], 0), np.mean([v for _, v in ranks], 0)
    np.testing.assert_allclose(first.moving_mean.numpy(), mean, rtol=1e-5)
    np.testing.assert_allclose(first.moving_variance.numpy(), var, rtol=1e-5)
    state = [v.numpy() for v in model.variables]
    assert all(np.isfinite(s).all() for s in state) and np.isfinite(history.history["loss"]).all()
    assert all_equal_bytes(state)
    loss = model.evaluate(x, y, batch_size=batch, verbose=0)
    predicted = model.predict(x, batch_size=batch, verbose=0)
    np.testing.assert_allclose(predicted, model(x, training=False).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, np.mean((predicted - y) ** 2), rtol=1e-4)
    assert len(set(gather(float(loss)))) == 1


class Recorder(keras.Model):
    """A model with its own train_step/test_step that use ``data`` as given (like keras-io's VAE).

    Records the structure of ``data`` (per element: shape without the batch) at trace time.
    """

    def __init__(self, unpack):
        super().__init__()
        self.dense = keras.layers.Dense(4)
        self.unpack = unpack
        self.seen = []

    def call(self, inputs):
        if isinstance(inputs, (tuple, list)):
            inputs = keras.ops.concatenate(list(inputs), axis=-1)
        return self.dense(inputs)

    def _record(self, data):
        self.seen.append(tf.nest.map_structure(lambda t: tuple(t.shape[1:]), data))

    def train_step(self, data):
        self._record(data)
        images = data if not self.unpack else keras.utils.unpack_x_y_sample_weight(data)[0]
        target = images if not isinstance(images, tuple) else images[0]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(images, training=True) - target))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}

    def test_step(self, data):
        self._record(data)
        images = data if not self.unpack else keras.utils.unpack_x_y_sample_weight(data)[0]
        target = images if not isinstance(images, tuple) else images[0]
        return {"loss": tf.reduce_mean(tf.square(self(images) - target))}


def test_own_train_step_gets_the_structure_keras_gives():
    # fit(x) without targets: data is x itself, not (x,); (x, y) and (x, y, sw) as in Keras
    import matex.keras  # noqa: F401

    rng = np.random.default_rng(6)
    x = rng.normal(size=(20, 4)).astype("float32")
    other = rng.normal(size=(20, 2)).astype("float32")
    y = rng.normal(size=(20, 1)).astype("float32")
    sw = rng.uniform(size=20).astype("float32")
    cases = [
        ((x,), {}, False, (4,)),
        ((x, y), {}, True, ((4,), (1,))),
        ((x, y), {"sample_weight": sw}, True, ((4,), (1,), ())),
        (([x, other],), {}, True, (((4,), (2,)),)),
        (((x, other), y), {}, True, (((4,), (2,)), (1,))),
    ]
    for args, kwargs, unpack, want in cases:
        keras.utils.set_random_seed(7)
        model = Recorder(unpack)
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        model.fit(*args, **kwargs, batch_size=8, epochs=1, verbose=0)
        model.evaluate(*args, **kwargs, batch_size=8, verbose=0)
        assert model.seen and all(s == want for s in model.seen), (args, model.seen)
        weights = [w.numpy() for w in model.weights]
        assert all(np.isfinite(w).all() for w in weights) and all_equal_bytes(weights)


def test_list_of_input_arrays():
    # a two-input functional model given [a, b] (a list, as Keras accepts it)
    import matex.keras  # noqa: F401

    rng = np.random.default_rng(8)
    a = rng.normal(size=(21, 4)).astype("float32")
    b = rng.normal(size=(21, 2)).astype("float32")
    y = rng.normal(size=(21, 1)).astype("float32")
    keras.utils.set_random_seed(9)
    ia, ib = keras.Input((4,)), keras.Input((2,))
    model = keras.Model([ia, ib], keras.layers.Dense(1)(keras.layers.Concatenate()([ia, ib])))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit([a, b], y, batch_size=8, epochs=2, validation_data=([a, b], y),
                        verbose=0)
    weights = [w.numpy() for w in model.weights]
    assert np.isfinite(history.history["val_loss"]).all() and all_equal_bytes(weights)
    loss = model.evaluate([a, b], y, batch_size=8, verbose=0)
    predicted = model.predict([a, b], batch_size=8, verbose=0)
    np.testing.assert_allclose(predicted, model([a, b]).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, np.mean((predicted - y) ** 2), rtol=1e-4)
    assert len(set(gather(float(loss)))) == 1


class _Stop(Exception):
    pass


@pytest.mark.parametrize("source", ["arrays", "pydataset"])
def test_resumed_fit_sees_the_batches_of_an_uninterrupted_run(source):
    # matexrun --restart: the relaunched script's fit restores epoch and weights from the
    # backup; each resumed epoch must shuffle as that epoch did in an uninterrupted run
    import matex.keras  # noqa: F401

    rows, batch, epochs, stop_at = 40, 8, 4, 2
    rng = np.random.default_rng(12)
    x = np.concatenate([np.arange(rows)[:, None], rng.normal(size=(rows, 2))], 1).astype("f4")
    y = rng.normal(size=(rows, 1)).astype("float32")
    backup = gather(tempfile.mkdtemp() if R == 0 else None)[0]   # rank 0's decides

    class Seen(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.epoch_now, self.seen = None, {}

        def call(self, inputs):
            return self.dense(inputs[:, 1:])

        def train_step(self, data):
            self.seen.setdefault(self.epoch_now, []).append(data[0][:, 0].numpy().tolist())
            return super().train_step(data)

    class Rows(keras.utils.PyDataset):
        def __len__(self):
            return rows // batch

        def __getitem__(self, i):
            return x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]

    class Epoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == stop >= 0:
                raise _Stop()
            self.model.epoch_now = epoch

    def run(stop_at=-1, restore=False):
        nonlocal stop
        stop = stop_at
        keras.utils.set_random_seed(13)   # a launch: the same seeds, a fresh model
        model = Seen()
        model(x[:1])                                 # built: a backup loads into it
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", run_eagerly=True)
        callbacks = [Epoch()] + ([keras.callbacks.BackupAndRestore(backup)] if restore else [])
        try:
            if source == "arrays":
                model.fit(x, y, batch_size=batch, epochs=epochs, callbacks=callbacks, verbose=0)
            else:
                model.fit(Rows(), epochs=epochs, callbacks=callbacks, verbose=0)
        except _Stop:
            pass
        return model

    stop = -1
    whole = run()
    run(stop_at=stop_at, restore=True)              # ends after epoch stop_at - 1's backup
    resumed = run(restore=True)
    assert sorted(resumed.seen) == list(range(stop_at, epochs))
    for epoch in range(stop_at, epochs):
        assert resumed.seen[epoch] == whole.seen[epoch], epoch
    assert whole.seen[0] != whole.seen[1]           # shuffled, differently per epoch
    everyone = gather({e: [list(b) for b in v] for e, v in whole.seen.items()})
    for epoch in range(epochs):                     # every row once per epoch, over all ranks
        ids = sorted(i for seen in everyone for b in seen[epoch] for i in b)
        assert ids == list(range(rows)), (epoch, ids)
    for a, b in zip(resumed.weights, whole.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


def _traced_input_specs(model):
    """The element specs of the iterator ``fit``'s traced step was called with."""
    specs = []
    for cell in model.train_function.__closure__ or ():
        function = cell.cell_contents
        if hasattr(function, "_list_all_concrete_functions"):
            for concrete in function._list_all_concrete_functions():
                iterator = concrete.structured_input_signature[0][0]
                specs.append(tf.nest.map_structure(lambda s: (tuple(s.shape), s.dtype),
                                                   iterator._element_spec))
    return specs


@pytest.mark.parametrize("rows", [24, 25])
def test_fit_on_arrays_traces_known_batch_rows_and_floatx(rows):
    # As Keras's adapter: float64 arrays reach the step as floatx, and when every global
    # batch is full (24 rows, batch 8) the rank's rows are static (a smaller step graph:
    # an LSTM's backward loop lost 40 % of its ops); a partial batch (25 rows) keeps None
    import matex.keras  # noqa: F401

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(rows, 3)), rng.normal(size=(rows, 1))   # float64
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    lo, hi = _batch_slicing.slice_bounds(8, R, N)
    known = hi - lo if rows % 8 == 0 else None
    assert _traced_input_specs(model) == [((((known, 3), tf.float32), ((known, 1), tf.float32)))]
    weights = [w.numpy() for w in model.weights]
    assert all(np.isfinite(w).all() for w in weights) and all_equal_bytes(weights)
