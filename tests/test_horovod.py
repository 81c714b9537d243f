"""matex.horovod: unmodified Horovod scripts under --horovod, -m MODULE, horovodrun's flags."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mpitools

ROOT = mpitools.ROOT
SCRIPTS = ROOT / "tests" / "scripts"
SCRIPT = str(SCRIPTS / "horovod_script.py")


def _env(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MATEX_FLIGHT_DIR=str(tmp_path / "flight"))
    env.pop("MATEX_FUSION_THRESHOLD", None)
    return mpitools.launch.launch_env(env)


def _run(cmd, tmp_path, cwd):
    proc = subprocess.run(cmd, env=_env(tmp_path), cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return proc


def _report(prefix, rank):
    with open("%s.rank%d.json" % (prefix, rank)) as f:
        return json.load(f)


def _warmup_rates(size, steps, epochs, initial=0.1, warmup=2):
    """Horovod's LearningRateWarmupCallback: per batch, epoch counted at the batch's end."""
    rates, rate = [], initial
    for epoch in range(epochs):
        for batch in range(steps):
            if epoch < warmup:
                e = epoch + batch / steps + 1 / steps
                rate = initial / size * (e * (size - 1) / warmup + 1)
            rates.append(rate)
    return rates


def test_horovod_script_runs_unmodified_on_two_ranks_as_on_one(tmp_path):
    """One launch of 2 ranks (as ``-m horovod_script``, with horovodrun's flags), one process.

    fit with hvd.DistributedOptimizer and the callbacks, and a
    DistributedGradientTape loop: weights bitwise equal across ranks and
    equal (to float rounding) to one process on the global batch; the
    warmup's rates are Horovod's formula; broadcast/allgather gradients are
    Horovod's averages; a shape mismatch is FailedPreconditionError.
    """
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    timeline = tmp_path / "timeline.json"
    _run([sys.executable, "-m", "matex", "--horovod", SCRIPT, one], tmp_path, tmp_path)
    proc = _run([sys.executable, "-m", "matex.launcher", "--horovod", "-np", "2",
                 "--fusion-threshold-mb", "1", "--timeline-filename", str(timeline),
                 "--cycle-time-ms", "1", "-m", "horovod_script", two], tmp_path, SCRIPTS)
    # a flag with no meaning here is named once, by the launcher
    assert proc.stderr.count("horovodrun's --cycle-time-ms has no meaning") == 1, proc.stderr
    alone, ranks = _report(one, 0), [_report(two, r) for r in range(2)]
    for report in [alone] + ranks:
        assert report["names"] == ["matex.horovod.tensorflow.keras", "matex.horovod.tensorflow",
                                   "matex.horovod.tensorflow.keras.callbacks"]
    assert [r["size"] for r in ranks] == [2, 2] and alone["size"] == 1
    assert [r["argv0"] for r in ranks] == ["horovod_script.py"] * 2   # -m: the module's file
    for key in ("fit_weights", "tape_weights"):
        for a, b, ref in zip(ranks[0][key], ranks[1][key], alone[key]):
            assert np.array_equal(a, b), key           # replicas identical
            np.testing.assert_allclose(a, ref, rtol=0, atol=2e-6, err_msg=key)
    # MetricAverageCallback: the averaged loss is the global batch's, as alone
    assert ranks[0]["fit_loss"] == ranks[1]["fit_loss"]
    np.testing.assert_allclose(ranks[0]["fit_loss"], alone["fit_loss"], rtol=1e-5)
    # 64 rows, global batch 16: 4 steps per epoch, 3 epochs, warmup over 2
    for report, size in [(alone, 1)] + [(r, 2) for r in ranks]:
        expected = _warmup_rates(size, 4, 3)
        np.testing.assert_allclose(report["warmup_rates"], expected, rtol=1e-6)
        np.testing.assert_allclose(report["warmup_logged_lr"], [expected[3], 0.1, 0.1],
                                   rtol=1e-6)
    assert ranks[0]["warmup_rates"][0] == pytest.approx(0.05625)
    # epoch 0 untouched, epoch 1 0.1 * 0.5, epoch 2 0.1 * (2 + batch / 4)
    for report in [alone] + ranks:
        np.testing.assert_allclose(report["schedule_rates"],
                                   [0.1] * 4 + [0.05] * 4 + [0.2, 0.225, 0.25, 0.275], rtol=1e-6)
    # root is rank 1: it gets the average of d(loss_r)/d(broadcast) = r + 1; rank 0 gets 0
    assert ranks[1]["broadcast_grad"] == [1.5, 1.5] and ranks[0]["broadcast_grad"] == [0, 0]
    # output gradient [1, 2, 3, 4] on both ranks: averaged (not summed), rank r's rows
    assert ranks[0]["allgather_grad"] == [1, 2] and ranks[1]["allgather_grad"] == [3, 4]
    assert [r["mismatch"] for r in ranks] == ["FailedPreconditionError"] * 2
    assert [r["sum_after"] for r in ranks] == [[2.0], [2.0]]
    # reducescatter of ones, Sum: each rank's 2 rows hold 2; Horovod's gradient is 2 (MaTEx's 1)
    assert [r["reducescatter_part"] for r in ranks] == [[2.0, 2.0]] * 2
    assert [r["reducescatter_grad"] for r in ranks] == [[2.0] * 4] * 2
    assert alone["reducescatter_grad"] == [1.0, 1.0]
    # grouped, float64 rows [4, 3] with a float32 output gradient: each input gradient is 2
    assert [r["grouped_reducescatter_grad"] for r in ranks] == [[24.0, 24.0]] * 2
    assert alone["grouped_reducescatter_grad"] == [6.0, 6.0]
    # alltoall without splits: the rows alone; with splits: (rows, received splits)
    assert [r["alltoall"] for r in ranks] == [[0, 1]] * 2
    assert [r["alltoall_splits"] for r in ranks] == [[[0, 1], [1, 1]]] * 2
    # a graph's broadcast_ assigns the root's value (rank 1's: 1.0) when run
    assert [r["graph_broadcast_"] for r in ranks] == [[[1.0, 1.0], [1.0, 1.0]]] * 2
    assert [r["graph_unchained"] for r in [alone] + ranks] == [True] * 3
    assert [r["graph_together"] for r in ranks] == [[[0, 1, 1], [3.0] * 3]] * 2
    # mismatches in graphs: Horovod's error from the compat layer's ops, MaTEx's from its own
    fp, ia = "FailedPreconditionError", "InvalidArgumentError"
    assert [r["graph_mismatch"] for r in ranks] == [[[fp, True], [fp, True], [ia, True]]] * 2
    assert [r["function_mismatch"] for r in ranks] == [fp] * 2
    # horovodrun's flags: 1 MiB fusion buckets; one merged timeline of both ranks
    assert [r["fusion_threshold"] for r in ranks] == [str(1 << 20)] * 2
    events = json.loads(timeline.read_text())
    assert {e["pid"] for e in events} == {0, 1}
    assert any(e.get("cat") != "__metadata" and e.get("ph") == "X" for e in events)


def _dry_run(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "matex.launcher", "--dry-run", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_horovodrun_flags_and_module_in_the_command(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=3\n")   # horovodrun's format
    err = _dry_run("--horovod", "--hostfile", str(hostfile), "--autotune", "--autotune",
                   "--cache-capacity", "1024", "-m", "pytest", "-q", "x.py", "-k", "y")
    command = err.strip().splitlines()[-1]
    assert " -n 3 " in command, command
    assert command.endswith("-m matex --horovod -m pytest -q x.py -k y"), command
    assert err.count("--autotune has no meaning") == 1, err
    assert err.count("--cache-capacity has no meaning") == 1, err
    err = _dry_run("-np", "2", "-H", "localhost:2", "--network-interface", "lo", SCRIPT, "-m",
                   "x")
    command = err.strip().splitlines()[-1]
    assert " -n 2 " in command and "--host localhost:2" in command and " lo " in command
    assert command.endswith("-m matex %s -m x" % SCRIPT), command   # the script's own -m
    assert "no meaning" not in err


def test_python_m_matex_module_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "matex", "-m", "no_such_module_here"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "matex: no module named no_such_module_here" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "matex.launcher", "-m"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "-m needs a module name" in proc.stderr


def test_cross_figures_are_computed_with_the_communicator():
    """hvd.cross_rank/cross_size/is_homogeneous describe the communicator in use: they are
    computed when it is set (init, a ULFM shrink; ``_runtime._cross_figures_of``), so a
    shrink's new communicator gets its own, and reading them is local (the 2- and 3-rank
    check that one rank alone may ask: tests/mpi/test_horovod_training.py)."""
    import matex.horovod.tensorflow as hvd
    from matex import _runtime

    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)

    class Cross:                       # a shrunk job's view: node 1 of 2
        def Get_rank(self):
            return 1

        def Get_size(self):
            return 2

        def Free(self):
            self.freed = True

    class Shrunk:
        def Get_rank(self):
            return 0

        def Split(self, color, key):
            assert (color, key) == (0, 0)
            self.cross = Cross()
            return self.cross

        def allgather(self, value):
            return [value, value + 1]

    class Local:
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 2

    shrunk = Shrunk()
    assert _runtime._cross_figures_of(shrunk, Local()) == (1, 2, False)
    assert shrunk.cross.freed


def test_horovod_version_is_the_horovod_release_it_mirrors():
    """Scripts compare ``horovod.__version__`` with Horovod's releases; it was MaTEx's own
    (0.1.0, below every Horovod with the API)."""
    import matex
    import matex.horovod

    assert matex.horovod.__version__ == "0.28.1"
    assert matex.horovod.matex_version == matex.__version__


def test_sync_batch_normalization_patches_nothing_else():
    """Explicit: hvd.SyncBatchNormalization computes its own global moments; making one
    leaves Keras's BatchNormalization and its backend's moments as they were (before,
    it installed matex.keras's patches, which every other BatchNormalization met)."""
    code = (
        "import keras\n"
        "import matex.horovod.tensorflow as hvd\n"
        "from matex import _compat\n"
        "call, nn = keras.layers.BatchNormalization.call, _compat.keras_tf_nn()\n"
        "moments, sync = nn._compute_moments, nn._compute_moments_sync\n"
        "layer = hvd.SyncBatchNormalization()\n"
        "layer(keras.ops.ones((4, 3)), training=True)\n"
        "assert keras.layers.BatchNormalization.call is call\n"
        "assert (nn._compute_moments, nn._compute_moments_sync) == (moments, sync)\n"
        "assert not hasattr(nn._compute_moments, '_matex_original')\n"
        "print('untouched')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0 and proc.stdout.strip() == "untouched", proc.stderr[-3000:]


def test_shutdown_ends_horovod_until_init():
    """hvd.shutdown() was a no-op: is_initialized() stayed True. As Horovod's: False after
    it, the process figures raise Horovod's ValueError, and hvd.init() starts it again."""
    import matex.horovod.tensorflow as hvd

    hvd.init()
    assert hvd.is_initialized() and hvd.rank() == 0
    hvd.shutdown()
    try:
        assert not hvd.is_initialized()
        for figure in (hvd.rank, hvd.size, hvd.local_rank, hvd.local_size):
            with pytest.raises(ValueError, match="Horovod has not been initialized"):
                figure()
    finally:
        hvd.init()
    assert hvd.is_initialized() and (hvd.rank(), hvd.size()) == (0, 1)


def test_elastic_keras_epoch_advice_counts_each_epoch_once():
    """The module's advice for resuming ``fit`` after a recovery (it said
    ``initial_epoch=state.epoch``, which UpdateEpochStateCallback counts twice: 2 epochs
    done then 3 more ended at state.epoch 7, not 5)."""
    import keras
    import numpy as np

    import matex.horovod.tensorflow.keras.elastic as elastic

    assert "fit(epochs=epochs - state.epoch)" in " ".join(elastic.__doc__.split())
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    state = elastic.KerasState(model, model.optimizer, epoch=2, batch=0)   # as recovered
    epochs = 5
    model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=epochs - state.epoch, verbose=0,
              callbacks=[elastic.UpdateEpochStateCallback(state)])
    assert state.epoch == epochs


def test_elastic_commits_of_two_scripts_never_meet(tmp_path, monkeypatch):
    """Two scripts' ``__main__.train`` shared one commit file under the same checkpoint
    directory, so one could silently resume the other's state. The file now names the
    defining script's digest too: the same script finds its own file again."""
    from matex.horovod import elastic

    monkeypatch.setenv("MATEX_CHECKPOINT_DIR", str(tmp_path))

    def train_in(script):
        scope = {"__name__": "__main__"}
        exec(compile("def train(state):\n    pass\n", script, "exec"), scope)
        return scope["train"]

    one, other = str(tmp_path / "one.py"), str(tmp_path / "other.py")
    assert elastic.state_file(train_in(one)) != elastic.state_file(train_in(other))
    assert elastic.state_file(train_in(one)) == elastic.state_file(train_in(one))
    assert os.path.dirname(elastic.state_file(train_in(one))) == str(tmp_path)
    assert "__main__.train" in os.path.basename(elastic.state_file(train_in(one)))


def test_an_explicit_horovod_loop_under_python_m_matex_is_reduced_once(tmp_path):
    """``python -m matex`` without --horovod (the path docs/horovod.md offers for
    ``import matex.horovod...``): the transparent patch made the plain optimizer
    distributed too, so the tape's output was averaged again and the local layer's
    per-rank gradients became everyone's. The transparent patches stand down once the
    Horovod layer is used: the local layer stays each rank's own, as in Horovod."""
    out = str(tmp_path / "w")
    _run([sys.executable, "-m", "matex.launcher", "-np", "2",
          str(SCRIPTS / "horovod_explicit_loop.py"), out], tmp_path, tmp_path)
    ranks = [_report(out, r) for r in range(2)]
    assert [r["size"] for r in ranks] == [2, 2]
    assert ranks[0]["shared"] == ranks[1]["shared"]
    assert ranks[0]["local"] != ranks[1]["local"]      # each rank's own gradient
    # one process with rank r's batch alone, local gradients scaled by 1/size (Horovod's
    # scale_local_gradients), the shared layer's by the average: weights recomputed below
    import keras
    import numpy as np
    import tensorflow as tf

    start = {}
    for r in range(2):
        shared = keras.layers.Dense(1, kernel_initializer="ones")
        local = keras.layers.Dense(2, kernel_initializer="ones")
        model = keras.Sequential([keras.Input((3,)), local, shared])
        start[r] = model
    opts = {r: keras.optimizers.SGD(0.1) for r in range(2)}
    for _ in range(2):
        grads = {}
        for r, model in start.items():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(tf.fill((4, 3), r + 1.0))))
            grads[r] = tape.gradient(loss, model.trainable_variables)
        for r, model in start.items():
            mine = [g / 2 for g in grads[r][:2]]                     # local kernel, bias
            avg = [(grads[0][i] + grads[1][i]) / 2 for i in (2, 3)]   # shared kernel, bias
            opts[r].apply_gradients(zip(mine + avg, model.trainable_variables))
    for r in range(2):
        np.testing.assert_allclose(ranks[r]["local"], start[r].layers[0].kernel.numpy(),
                                   rtol=1e-5)
        np.testing.assert_allclose(ranks[r]["shared"], start[r].layers[1].kernel.numpy(),
                                   rtol=1e-5)


def test_accumulation_fires_past_n_and_is_recovery_state():
    """backward_passes_per_step: a counter a failed reducing call left past N fires at the
    next call (it never did: due() was an equality, and updates stopped with no error);
    the counter and accumulators are one of the optimizer's recovery states, put back
    when a call's work was not committed (the optimizer's iterations did not move)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import matex.horovod.tensorflow as hvd
    from matex import _recovery
    from matex.horovod._training import AccumulationState

    w = tf.Variable([0.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    opt.apply([tf.constant([1.0])], [w])                  # counted, not applied
    reduction = opt._matex.strategy
    assert int(reduction.counter) == 1 and w.numpy().tolist() == [0.0]
    states = [s for s in _recovery.step_states(opt, lambda: []) if
              isinstance(s, AccumulationState)]
    assert len(states) == 1
    state = states[0]
    state.begin_step()
    reduction.counter.assign(5)                           # as an interrupted call left it
    next(iter(reduction.accumulators.values())).assign([7.0])
    state.restore()                                       # iterations did not move
    assert int(reduction.counter) == 1
    np.testing.assert_array_equal(next(iter(reduction.accumulators.values())).numpy(), [1.0])
    reduction.counter.assign(5)                           # no recovery ran: past N
    opt.apply([tf.constant([2.0])], [w])
    np.testing.assert_allclose(w.numpy(), [-3.0])         # 1 + 2 accumulated, applied
    assert int(reduction.counter) == 0


def test_wrapping_again_replaces_the_accumulation_state():
    """The step-state registry is keyed: an optimizer wrapped by hvd.DistributedOptimizer
    again holds one accumulation state, the new reduction's, and none once wrapped without
    accumulation (before, each wrap appended one, the earlier reductions' kept alive)."""
    import keras

    import matex.horovod.tensorflow as hvd
    from matex import _recovery
    from matex.horovod._training import AccumulationState

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
    opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=3)
    assert _recovery.joined(opt) == ["accumulation"]
    (state,) = _recovery.step_states(opt, lambda: [])
    assert isinstance(state, AccumulationState) and state.reduction is opt._matex.strategy
    assert state.reduction.passes == 3
    opt = hvd.DistributedOptimizer(opt)
    assert _recovery.joined(opt) == [] and _recovery.step_states(opt, lambda: []) == []
    # Horovod's own message, word for word (a rename once wrote "_api.Average" into it)
    with pytest.raises(ValueError, match=r"^gradient_predivide_factor not supported with "
                                         r"op != Average$"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)


@pytest.mark.parametrize("source, expected", [
    ("import horovod.tensorflow as hvd\nhvd.init()\nprint(os.path.join('a', 'b'))", False),
    ("import horovod.tensorflow as hvd\nhvd.join()", True),
    ("import horovod.tensorflow.keras as hvd\nif hvd.rank() == 0:\n    hvd.join()", True),
    ("import horovod.tensorflow\nhorovod.tensorflow.join()", True),
    ("from horovod.tensorflow import join\njoin()", True),
    ("from horovod import tensorflow as h\nh.join()", True),
    ("from matex import horovod as hvd\nhvd.tensorflow.join()", True),
    ("import matex.horovod.tensorflow as hvd\n', '.join(['a'])", False),
    ("import tensorflow as tf\nimport os\nos.path.join('a')", None),
])
def test_which_scripts_may_call_horovods_join(source, expected):
    """MATEX_HOROVOD_JOIN=auto announces reductions unless the main script imports Horovod
    and never refers to its join; a join on anything else does not count."""
    from matex.horovod._join import script_may_join

    assert script_may_join(source) is expected
