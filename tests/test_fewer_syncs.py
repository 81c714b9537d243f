"""Fewer synchronisations under real mpiexec: delay=1, LocalSGD, DiLoCo (issue #14).

One 2-rank job (tests/scripts/fewer_syncs.py) runs every check, custom loops
and ``fit`` alike; this module asserts on what each rank wrote.
"""

import json
import sys

import pytest

import mpitools

SCRIPT = str(mpitools.ROOT / "tests" / "scripts" / "fewer_syncs.py")
ROUNDING = 1e-6   # float32 weights of order 1: averaging updated weights vs averaged updates


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fewer") / "r")
    proc = mpitools.run_mpi(2, [sys.executable, SCRIPT, out], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.load(open("%s.%d" % (out, r))) for r in range(2)]


def test_bad_input_is_a_clear_error_on_every_rank(ranks):
    for r in ranks:
        assert r["errors"] == ranks[0]["errors"]
        first, second, diloco, delay2, delay_bool = r["errors"]
        assert "sync_every must be an integer >= 1" in first and "not 0" in first
        assert "not 1.5" in second and "not -2" in diloco
        assert "delay must be 0" in delay2 and "not 2" in delay2
        assert "not True" in delay_bool


def test_options_that_would_be_ignored_are_errors(ranks):
    for r in ranks:
        assert r["option_errors"] == ranks[0]["option_errors"]
        op, delay, threshold, comp, env_delay, env_local, env_diloco, local_comp = \
            r["option_errors"]
        assert "already distributed" in op and "op='average' (it has 'sum')" in op
        assert "delay=1 (it has 0)" in delay
        assert "fusion_threshold=123" in threshold
        assert "compression=FP16 (it has None)" in comp, comp
        assert "MATEX_COMPRESSION" in env_delay and "delay=1" in env_delay
        assert env_local.startswith("LocalSGD sends the weights uncompressed")
        assert env_diloco.startswith("DiLoCo sends the weights uncompressed")
        assert local_comp.startswith("LocalSGD sends the weights uncompressed")
        assert r["option_kept"]


def test_local_sgd_every_step_is_data_parallel(ranks):
    for r in ranks:
        assert r["localsgd1_loop"] <= ROUNDING
        assert r["localsgd1_momentum_loop"] <= ROUNDING   # slots local, but momentum is linear
        assert r["localsgd1_fit"] <= ROUNDING


def test_local_sgd_and_diloco_weight_uneven_slices_by_their_rows(ranks):
    # 8 and 4 rows per step; the plain mean of the weights (rows unknown) is off
    for r in ranks:
        assert r["uneven_localsgd1"] <= ROUNDING, r["uneven_localsgd1"]
        assert r["uneven_diloco1"] <= ROUNDING, r["uneven_diloco1"]
        assert r["uneven_localsgd1_plain_mean"] > 1e-4, r["uneven_localsgd1_plain_mean"]


def test_local_sgd_ranks_apart_between_syncs_equal_at_them(ranks):
    # sync_every=3 over 6 steps: bitwise equal after steps 3 and 6 only
    assert ranks[0]["localsgd3_equal_after_step"] == [False, False, True, False, False, True]
    for r in ranks:
        assert r["localsgd3_fit_vs_loop"] <= ROUNDING


def test_diloco_with_plain_outer_sgd_at_rate_one_is_local_sgd(ranks):
    for r in ranks:
        assert r["diloco_vs_localsgd_loop"] <= ROUNDING
        assert r["diloco_vs_localsgd_fit"] <= ROUNDING
        # a Nesterov outer step goes elsewhere, identically on every rank
        assert r["diloco_nesterov_vs_localsgd"] > 1e-3
        assert r["diloco_nesterov_equal"]


@pytest.mark.parametrize("momentum", ["0.0", "0.9"])
def test_delay_one_is_the_delayed_trajectory_bitwise_equal_every_step(ranks, momentum):
    for r in ranks:
        gaps = r["delay_loop_gaps_" + momentum]
        assert len(gaps) == 7 and max(gaps) <= ROUNDING   # 6 steps, then the flush
        assert gaps[0] == 0.0                             # step 0 applies nothing
        assert all(r["delay_loop_equal_" + momentum])
        assert r["delay_pending_before_flush_" + momentum]
        assert r["delay_flushed_" + momentum] and not r["delay_flush_again_" + momentum]
        # blocking allreduces ran on the data communicator while requests were outstanding
        assert r["delay_blocking_losses_" + momentum] == ranks[0]["delay_blocking_losses_"
                                                                   + momentum] > 0
        # the reference is not the undelayed run
        assert r["delay_vs_undelayed_" + momentum] > 1e-3


def test_delay_one_in_fit(ranks):
    for r in ranks:
        assert len(r["delay_fit_gaps"]) == 6 and max(r["delay_fit_gaps"]) <= ROUNDING
        assert all(r["delay_fit_equal"])
        assert r["pending_requests"] == 1   # fit's last gradient, not flushed: dropped at exit


PARAMS_BYTES = (6 * 16 + 16 + 16 * 2 + 2) * 4   # the model's float32 weights (= gradients)


def test_stats_count_what_delay_localsgd_and_diloco_send(ranks):
    # 6 steps each; matex.stats() said 0 bytes for all three before
    for r in ranks:
        for momentum in ("0.0", "0.9"):
            s = r["stats_delay_" + momentum]   # every step posts the whole gradient
            assert (s["steps"], s["bytes_sent"], s["dense_bytes"]) == (
                6, 6 * PARAMS_BYTES, 6 * PARAMS_BYTES), s
            assert s["bytes_sent_per_step"] == PARAMS_BYTES and s["ratio"] == 1.0
            assert sorted(s["by_variable"].values()) == [8.0, 64.0, 128.0, 384.0], s
        for name in ("stats_localsgd3", "stats_diloco3"):
            s = r[name]   # sync_every=3: the weights (pseudo-gradient) twice in 6 steps
            assert (s["steps"], s["bytes_sent"], s["dense_bytes"]) == (
                6, 2 * PARAMS_BYTES, 6 * PARAMS_BYTES), (name, s)
            assert s["ratio"] == 3.0 and s["dense_bytes_per_step"] == PARAMS_BYTES
