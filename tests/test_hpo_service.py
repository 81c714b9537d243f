"""The oracle owner's request handler in one process (no MPI): the hand-off between trials.

A group's hand-off from one trial to the next is one request (``end_trial``
carrying the trial's reports and asking for the next trial), and each file of
the tuner directory is written once per request, all of them before the
request is answered: what a takeover reloads already holds the result and the
trial handed out.
"""

import json
import os

import keras_tuner as kt
import pytest

from matex._workgroups.service import Server
from matex.hpo import _service, _tuner


def _make_handler(tmp_path, max_trials=3, groups=1):
    _tuner.install()   # Keras Tuner's JSON writer goes through write_atomically
    space = kt.HyperParameters()
    space.Float("x", 0.0, 1.0)
    oracle = kt.oracles.RandomSearchOracle(objective=kt.Objective("value", "min"),
                                           max_trials=max_trials, seed=0, hyperparameters=space)
    oracle._set_project_dir(str(tmp_path), "p")
    oracle._display.verbose = 0
    return _service.Handler(oracle, lambda i: os.path.join(str(tmp_path), "p", "trial_" + i),
                            groups)


@pytest.fixture
def handler(tmp_path):
    return _make_handler(tmp_path)


@pytest.fixture
def writes(monkeypatch):
    done = []
    real = _service._write_now

    def write_now(path, data):
        done.append(os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path))
        real(path, data)

    monkeypatch.setattr(_service, "_write_now", write_now)
    return done


def _on_disk(handler):
    with open(os.path.join(handler.oracle._project_dir, "oracle.json")) as f:
        return json.load(f)


def test_ending_a_trial_hands_out_the_next_in_the_same_request(handler, writes):
    group = "matex-group-0"
    first = handler("create_trial", (group,))
    first["status"] = "COMPLETED"
    del writes[:]
    nxt = handler("end_trial", (first, {"ckpt": b"weights"},
                                [(first["trial_id"], {"value": 0.25}, 0)], group))
    assert nxt["status"] == "RUNNING" and nxt["trial_id"] != first["trial_id"]
    # on disk before the answer: the result, the checkpoint, the trial now running
    state = _on_disk(handler)
    assert state["end_order"] == [first["trial_id"]]
    assert state["ongoing_trials"] == {group: nxt["trial_id"]}
    assert handler.oracle.get_trial(first["trial_id"]).score == 0.25
    # Keras Tuner rewrote oracle.json 3 times and the ended trial's file twice: once each now
    assert sorted(writes) == sorted(["trial_%s/ckpt" % first["trial_id"],
                                     "trial_%s/trial.json" % first["trial_id"],
                                     "p/oracle.json",
                                     "trial_%s/trial.json" % nxt["trial_id"]]), writes
    # asked again (a new leader), the group gets the same trial back
    assert handler("create_trial", (group,))["trial_id"] == nxt["trial_id"]


def test_a_resent_result_is_recorded_once_and_still_gets_the_next_trial(handler):
    group = "matex-group-0"
    first = handler("create_trial", (group,))
    first["status"] = "COMPLETED"
    report = [(first["trial_id"], {"value": 0.5}, 0)]
    nxt = handler("end_trial", (first, {}, report, group))
    again = handler("end_trial", (first, {}, report, group))   # resent after a takeover
    assert again["trial_id"] == nxt["trial_id"]
    assert _on_disk(handler)["end_order"] == [first["trial_id"]]


def test_the_last_result_gets_stopped_and_plain_end_trial_answers_none(handler):
    group = "matex-group-0"
    state = handler("create_trial", (group,))
    for _ in range(2):
        state["status"] = "COMPLETED"
        state = handler("end_trial", (state, {}, [(state["trial_id"], {"value": 1.0}, 0)], group))
    state["status"] = "COMPLETED"
    assert handler("end_trial", (state, {}, [(state["trial_id"], {"value": 1.0}, 0)],
                                 group))["status"] == "STOPPED"
    assert group in handler.stopped
    assert handler("end_trial", (state, {})) is None


def test_batched_writes_write_each_file_once_at_the_end(tmp_path, writes):
    path = str(tmp_path / "d" / "f.json")
    with _service.batched_writes():
        _service.write_atomically(path, b"1")
        with _service.batched_writes():   # nested: joins the outer block
            _service.write_atomically(path, b"2")
        assert not os.path.exists(path) and writes == []
    assert writes == ["d/f.json"] and open(path, "rb").read() == b"2"
    _service.write_atomically(path, b"3")   # outside a block: at once
    assert open(path, "rb").read() == b"3" and len(writes) == 2


def test_an_oracle_error_leaves_no_lock_held_for_the_other_thread(tmp_path):
    """Keras Tuner's @synchronized keeps the oracle's lock after the oracle raised (here: 1
    failed trial is the limit); the owner's other thread must still get answers."""
    import threading

    _tuner.install()
    space = kt.HyperParameters()
    space.Float("x", 0.0, 1.0)
    oracle = kt.oracles.RandomSearchOracle(objective=kt.Objective("value", "min"), max_trials=9,
                                           seed=0, hyperparameters=space,
                                           max_consecutive_failed_trials=1)
    oracle._set_project_dir(str(tmp_path), "p")
    oracle._display.verbose = 0
    handler = _service.Handler(oracle, lambda i: os.path.join(str(tmp_path), "p", "trial_" + i), 2)
    first = handler("create_trial", ("matex-group-0",))
    second = handler("create_trial", ("matex-group-1",))
    first["status"], first["message"] = "FAILED", "it broke"

    def in_thread(*request):   # as the service thread would
        answers = []
        t = threading.Thread(target=lambda: answers.append(handler(*request)), daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "the handler waits for ever for the oracle's lock"
        return answers[0]

    in_thread("end_trial", (first, {}, [], "matex-group-0"))
    assert handler.fatal.startswith("RuntimeError: Number of consecutive failures exceeded")
    second["status"] = "COMPLETED"
    # from another thread: the oracle is free, the result is recorded, the group is stopped
    assert in_thread("end_trial", (second, {}, [(second["trial_id"], {"value": 0.5}, 0)],
                                   "matex-group-1"))["status"] == "STOPPED"
    assert oracle.get_trial(second["trial_id"]).status == "COMPLETED"
    assert in_thread("create_trial", ("matex-group-0",))["status"] == "STOPPED"


class _FakeComm:
    """The service communicator in one process: requests queued, replies collected."""

    def __init__(self, requests, fail_recv=()):
        self.requests, self.replies, self.fail_recv = list(requests), [], set(fail_recv)

    def Iprobe(self, source, tag, status):
        if not self.requests:
            return False
        status.Set_source(self.requests[0][0])
        return True

    def recv(self, source, tag):
        _, request = self.requests.pop(0)
        if source in self.fail_recv:
            raise RuntimeError("request from %d cannot be read" % source)
        return request

    def send(self, obj, dest, tag):
        import pickle

        pickle.dumps(obj)   # as mpi4py does, before anything is sent
        self.replies.append((dest, obj))


class _Answers:
    fatal = None

    def __call__(self, op, args):
        return (lambda: None) if op == "unpicklable" else 42


def _serve(comm, handler, replies):
    import time

    server = Server(comm, handler, what="the oracle").start()
    deadline = time.time() + 20
    while len(comm.replies) < replies and time.time() < deadline:
        time.sleep(0.01)
    alive = server._thread.is_alive()
    server.stop()
    return alive


def test_the_service_answers_every_request_even_one_it_cannot_answer():
    """A reply that cannot be pickled (the thread died silently, and every later request
    waited for ever) and a request that cannot be read: error replies, service goes on."""
    comm = _FakeComm([(1, ("unpicklable", ())), (2, ("get", ())), (3, ("get", ())),
                      (1, ("get", ()))], fail_recv={3})
    handler = _Answers()
    assert _serve(comm, handler, 4), "the service thread died"
    assert [d for d, _ in comm.replies] == [1, 2, 3, 1]
    (_, bad), (_, good), (_, unread), (_, after) = comm.replies
    assert bad[0] is False and bad[1].startswith("the answer cannot be sent: ")
    assert good == (True, 42) and after == (True, 42)
    assert unread == (False, "the oracle's service failed on this request: RuntimeError: "
                             "request from 3 cannot be read")
    # an error of the service itself ends the search on every rank (kept, raised at the end)
    assert handler.fatal == "the oracle's service failed: RuntimeError: request from 3 " \
                            "cannot be read"


def test_a_request_that_fails_on_the_owner_ends_the_search_for_every_group(handler, tmp_path):
    """A trial's files cannot be written: the asking group gets the error, and every other
    group is told STOPPED (the search then ends with that error on every rank)."""
    state = handler("create_trial", ("matex-group-0",))
    state["status"] = "COMPLETED"
    (tmp_path / "p" / ("trial_" + state["trial_id"])).mkdir(parents=True, exist_ok=True)
    blocker = tmp_path / "p" / ("trial_" + state["trial_id"]) / "ckpt"
    blocker.mkdir()   # a directory where the file must go
    with pytest.raises(OSError):
        handler("end_trial", (state, {"ckpt": b"weights"}, [(state["trial_id"], {"value": 0.5},
                                                               0)], "matex-group-0"))
    assert handler.fatal.startswith("IsADirectoryError: ")
    assert handler("create_trial", ("matex-group-1",))["status"] == "STOPPED"


def test_a_request_from_a_group_already_lost_gets_no_trial(tmp_path):
    """ULFM race: a rank sends ``create_trial`` and dies before the owner reads it; the owner
    has meanwhile seen its group lose every rank. No trial is created for it (one would stay
    RUNNING for ever, with no group to run it), and the group stays lost."""
    handler = _make_handler(tmp_path, max_trials=9, groups=2)
    running = handler("create_trial", ("matex-group-0",))
    handler.requeue(["matex-group-1"])   # the server saw every rank of group 1 fail
    late = handler("create_trial", ("matex-group-1",))
    assert late["status"] == "STOPPED" and handler.fatal is None
    assert list(handler.oracle.ongoing_trials) == ["matex-group-0"]
    assert handler.stopped == {"matex-group-1"} and handler.work["matex-group-1"].state == "lost"
    assert handler("finish", ("matex-group-1", 3)) is False   # group 0 still runs a trial
    running["status"] = "COMPLETED"
    handler("end_trial", (running, {}, [(running["trial_id"], {"value": 0.5}, 0)]))
    assert handler("finish", ("matex-group-0", 0)) is True and handler.released == {0}
    assert handler.stopped == {"matex-group-0", "matex-group-1"}
