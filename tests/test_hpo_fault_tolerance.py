"""Distributed hyperparameter search surviving rank failures (mpiexec --with-ft ulfm).

The unmodified Keras Tuner script of tests/test_hpo_distributed.py (6 trials,
10 optimizer steps each), with a rank killed inside a trial:

* 2 ranks per trial, a group member killed: its group shrinks to one rank and
  the trial goes on there (fit's own recovery), the search ends with 6 results;
* 1 rank per trial, the killed rank's group is left empty: its trial goes back
  to the queue and another group runs it;
* world rank 0, the oracle's owner, killed inside a trial (2 and 1 ranks per
  trial): the lowest survivor takes the oracle over from the tuner directory,
  the other groups resend to it; with 2 per trial the owner's group goes on
  with rank 1 and its trial is re-attached (trained once), with 1 per trial the
  lost trial is run again by another group.

Every trial is recorded exactly once (the oracle's end order on disk has no
repeat) and the survivors agree on the best hyperparameters.
"""

import json
import os
import sys

import mpitools
from matex import launcher as launch

SCRIPT = str(mpitools.ROOT / "tests" / "scripts" / "hpo_keras_tuner.py")


def _run(tmp_path, k, fault, again=None, owner_dies_in_drain=False, kill_in_build=""):
    out, directory = str(tmp_path / "r"), str(tmp_path / "tuner")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", MATEX_RANKS_PER_TRIAL=str(k),
               MATEX_INJECT_FAULT=fault, MATEX_TEST_SEARCH_AGAIN=str(again or ""),
               MATEX_TEST_OWNER_DIES_IN_DRAIN="1" if owner_dies_in_drain else "",
               MATEX_TEST_KILL_IN_BUILD=str(kill_in_build))
    proc = mpitools.run_mpi(
        4, [sys.executable, "-m", "matex", SCRIPT, out, directory, "6"],
        mpi_args=["-x", "MATEX_RANKS_PER_TRIAL", "-x", "MATEX_INJECT_FAULT",
                  "-x", "MATEX_TEST_SEARCH_AGAIN", "-x", "MATEX_TEST_OWNER_DIES_IN_DRAIN",
                  "-x", "MATEX_TEST_KILL_IN_BUILD"]
        + launch.ft_mpi_args(), env=env, timeout=600)
    return proc, out, directory


def _check_disk(directory, trials):
    state = json.load(open(os.path.join(directory, "p", "oracle.json")))
    assert sorted(state["end_order"]) == sorted(trials), state["end_order"]   # once each
    assert state["ongoing_trials"] == {} and state["retry_queue"] == []


def _check(proc, out, directory, victim, searches=1, victims=None):
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stderr.count("matex: injecting fault") == 1
    victims = victims or [victim]
    survivors = [r for r in range(4) if r not in victims]
    for r in victims:
        assert not os.path.exists("%s.%d.json" % (out, r))
    records = {r: json.load(open("%s.%d.json" % (out, r))) for r in survivors}
    trials = records[survivors[0]]["trials"]
    assert len(trials) == 6 and all(t["status"] == "COMPLETED" for t in trials.values()), trials
    if searches == 1:   # else the directory holds the later searches' trials too
        _check_disk(directory, trials)
    for r in records.values():
        assert r["best"] == records[survivors[0]]["best"]
        assert r["best_digest"] == records[survivors[0]]["best_digest"]
        assert r["trials"] == trials and r["size"] == 4 - len(victims)   # the world after
    for r in survivors[1:]:
        assert records[r]["writes"] == []
    return records


def test_member_of_a_group_killed_inside_a_trial_group_shrinks_and_goes_on(tmp_path):
    proc, out, directory = _run(tmp_path, 2, "rank=3,step=2,kind=kill")
    records = _check(proc, out, directory, victim=3)
    # rank 2 finished the interrupted trial alone, and trained its later trials alone
    sizes = [f["size"] for f in records[2]["fits"]]
    assert sizes and all(s == 1 for s in sizes), sizes
    assert all(f["size"] == 2 for r in (0, 1) for f in records[r]["fits"])
    # fit's recovery redoes the interrupted fit on rank 2 (the Keras callbacks see both
    # attempts): one trial per (rank, hyperparameters)
    fitted = [h for r in (0, 2) for h in dict.fromkeys(
        json.dumps(f["hp"], sort_keys=True) for f in records[r]["fits"])]
    assert len(fitted) == len(set(fitted)) == 6   # 6 trials, each trained by one group


def test_group_left_empty_gives_its_trial_back_to_the_queue(tmp_path):
    """Then the same tuner searches again (2 more trials) on the 3 groups left."""
    proc, out, directory = _run(tmp_path, 1, "rank=2,step=2,kind=kill,at=begin", again=8)
    records = _check(proc, out, directory, victim=2, searches=2)
    fitted = [json.dumps(f["hp"], sort_keys=True) for r in records.values() for f in r["fits"]]
    assert len(fitted) == len(set(fitted)) == 6, fitted   # the lost trial ran again, elsewhere
    assert "goes back to the queue" in proc.stderr
    # the second search knows the groups of the survivors (it hung, waiting for the lost
    # rank's group to finish, when it kept the first search's groups)
    again = {r: json.load(open("%s.again.%d.json" % (out, r))) for r in (0, 1, 3)}
    trials = again[0]["trials"]
    assert len(trials) == 8 and all(t["status"] == "COMPLETED" for t in trials.values())
    _check_disk(directory, trials)
    more = [json.dumps(f["hp"], sort_keys=True) for r in again.values() for f in r["fits"]]
    assert len(more) == 2 and not set(more) & set(fitted), more
    assert all(f["size"] == 1 for r in again.values() for f in r["fits"])
    for r in again.values():
        assert r["trials"] == trials and r["best"] == again[0]["best"] and r["size"] == 3


def test_member_killed_as_a_trial_starts_then_the_owner_in_the_drain(tmp_path):
    """Rank 2 dies as its first trial starts (in the hypermodel's build): rank 3 meets the
    loss in fit's set-up, before fit's recovery loop; the trial is run again by rank 3
    alone, not recorded FAILED. Then world rank 0, the oracle's owner, dies
    at the end of the search, when its group is done and the other may not be: rank 1
    (not a group leader) takes the oracle over and answers rank 3 (both waited for ever
    before: rank 1 in a collective, rank 3 for rank 1's answer)."""
    proc, out, directory = _run(tmp_path, 2, "", owner_dies_in_drain=True, kill_in_build=2)
    records = _check(proc, out, directory, victim=2, victims=[0, 2])
    assert proc.stderr.count("the oracle's owner dies in the drain") == 1
    assert proc.stderr.count("took the oracle over") == 1, proc.stderr[-5000:]
    assert records[3]["fits"] and all(f["size"] == 1 for f in records[3]["fits"])
    assert all(f["size"] == 2 for f in records[1]["fits"])
    fitted = [h for r in (1, 3) for h in dict.fromkeys(
        json.dumps(f["hp"], sort_keys=True) for f in records[r]["fits"])]
    assert len(fitted) == len(set(fitted)) == 6, fitted   # 6 trials, each trained by one group


def test_oracle_owner_killed_inside_a_trial_survivor_takes_over_2_per_trial(tmp_path):
    proc, out, directory = _run(tmp_path, 2, "rank=0,step=2,kind=kill")
    records = _check(proc, out, directory, victim=0)
    assert proc.stderr.count("took the oracle over") == 1, proc.stderr[-5000:]
    assert records[1]["writes"], "the new owner (rank 1) wrote nothing"
    # rank 1 finished the owner's interrupted trial alone (re-attached, not redone) and
    # trained its later trials alone; group 1 kept both ranks
    assert records[1]["fits"] and all(f["size"] == 1 for f in records[1]["fits"])
    assert all(f["size"] == 2 for r in (2, 3) for f in records[r]["fits"])
    fitted = [h for r in (1, 2) for h in dict.fromkeys(
        json.dumps(f["hp"], sort_keys=True) for f in records[r]["fits"])]
    assert len(fitted) == len(set(fitted)) == 6, fitted   # 6 trials, each trained by one group


def test_oracle_owner_killed_inside_a_trial_survivor_takes_over_1_per_trial(tmp_path):
    proc, out, directory = _run(tmp_path, 1, "rank=0,step=2,kind=kill,at=begin")
    records = _check(proc, out, directory, victim=0)
    assert proc.stderr.count("took the oracle over") == 1, proc.stderr[-5000:]
    assert records[1]["writes"], "the new owner (rank 1) wrote nothing"
    fitted = [json.dumps(f["hp"], sort_keys=True) for r in records.values() for f in r["fits"]]
    assert len(fitted) == len(set(fitted)) == 6, fitted   # the lost trial ran again, once
