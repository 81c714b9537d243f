"""``matex._workgroups`` in one process: the layering its users rely on.

``matex.science`` shares the rank-group machinery with ``matex.hpo`` through
``matex._workgroups`` and imports nothing of ``matex.hpo`` (issue #24): a
loss surface must not depend on Keras Tuner glue, nor the search on science.
"""

import ast
import pathlib

import matex

PACKAGE = pathlib.Path(matex.__file__).parent


def _imported_modules(path):
    """Every module ``path`` imports, absolute (relative imports resolved), at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names |= {"%s.%s" % (base, alias.name) for alias in node.names}
    return names


def _offenders(folder, forbidden):
    return {str(path.relative_to(PACKAGE)): sorted(
        n for n in _imported_modules(path) if n == forbidden or n.startswith(forbidden + "."))
        for path in sorted((PACKAGE / folder).rglob("*.py"))}


def test_science_imports_nothing_from_hpo():
    found = {path: names for path, names in _offenders("science", "matex.hpo").items() if names}
    assert found == {}


def test_workgroups_import_neither_hpo_nor_science():
    for user in ("matex.hpo", "matex.science"):
        found = {p: n for p, n in _offenders("_workgroups", user).items() if n}
        assert found == {}, user


def test_the_import_check_sees_a_relative_and_a_nested_import(tmp_path, monkeypatch):
    """The check itself can fail: a function-level ``from ..hpo import x`` is found."""
    folder = PACKAGE / "science"
    probe = folder / "_probe_for_test_workgroups.py"
    monkeypatch.setattr(pathlib.Path, "rglob", lambda self, pattern: [probe])
    source = "def f():\n    from ..hpo._groups import Groups\n    import matex.hpo\n"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: source)
    assert _offenders("science", "matex.hpo") == {
        "science/_probe_for_test_workgroups.py": ["matex.hpo", "matex.hpo._groups",
                                                  "matex.hpo._groups.Groups"]}


# ---- the state machines, alone ---------------------------------------------------------

import itertools  # noqa: E402 - the second half of the module

import pytest  # noqa: E402

from matex._workgroups import machine  # noqa: E402
from matex._workgroups.machine import GroupWork, IllegalTransition, Ownership  # noqa: E402
from matex._workgroups.queue import WorkQueue  # noqa: E402


def _walk(m, *steps):
    """Fire ``(event, expected state)`` pairs; returns the states visited."""
    seen = [m.state]
    for event, expected in steps:
        assert m.can(event), (m, event)
        assert m.fire(event) == expected == m.state
        seen.append(m.state)
    return seen


def test_a_group_runs_items_then_finishes_and_is_released():
    assert _walk(GroupWork(), ("assign", "running"), ("complete", "waiting"),
                 ("assign", "running"), ("complete", "waiting"), ("finish", "finishing"),
                 ("finish", "finishing"), ("release", "done"), ("lose", "done")) == [
        "waiting", "running", "waiting", "running", "waiting", "finishing", "finishing",
        "done", "done"]


def test_a_failed_item_stops_its_group():
    _walk(GroupWork(), ("assign", "running"), ("fail", "finishing"), ("release", "done"))


def test_a_group_re_formed_after_losing_its_leader_keeps_its_state():
    _walk(GroupWork(), ("reform", "waiting"), ("assign", "running"), ("reform", "running"),
          ("complete", "waiting"))


@pytest.mark.parametrize("start", ["waiting", "running", "finishing"])
def test_a_group_with_no_rank_left_is_lost_from_any_live_state(start):
    m = GroupWork(start)
    _walk(m, ("lose", "lost"))
    assert m.settled and m.allowed() == []   # lost is final


def test_takeover_by_the_next_owner():
    follower = Ownership()
    _walk(follower, ("owner_lost", "following"), ("owner_lost", "following"),
          ("take_over", "owning"))
    assert follower.owning and not Ownership().owning
    with pytest.raises(IllegalTransition, match="'take_over' is not allowed in state owning "
                                                r"\(allowed: none\)"):
        follower.fire("take_over")   # an owner never takes over again (it never sees itself die)


@pytest.mark.parametrize("cls", [GroupWork, Ownership])
def test_every_transition_not_in_the_table_raises_and_keeps_the_state(cls):
    events = sorted({e for _, e in cls.TRANSITIONS})
    legal = illegal = 0
    for state, event in itertools.product(sorted(cls.states()), events):
        m = cls(state, name="g")
        if (state, event) in cls.TRANSITIONS:
            assert m.fire(event) == cls.TRANSITIONS[(state, event)]
            legal += 1
            continue
        with pytest.raises(IllegalTransition) as info:
            m.fire(event)
        assert str(info.value) == "%s g: %r is not allowed in state %s (allowed: %s)" % (
            cls.__name__, event, state, ", ".join(m.allowed()) or "none")
        assert m.state == state
        illegal += 1
    assert legal == len(cls.TRANSITIONS) and illegal > 0


def test_an_unknown_state_is_refused():
    with pytest.raises(ValueError, match="no state 'sleeping'"):
        GroupWork("sleeping")
    assert machine.GroupWork.states() == {"waiting", "running", "finishing", "done", "lost"}


# ---- the work queue, in one process ----------------------------------------------------

class _Recording(WorkQueue):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.results, self.last = [], []

    def record(self, result):
        self.results.append(result)

    def finishing(self, last):
        self.last.append(last)


def test_the_queue_hands_out_every_item_once_then_tells_each_group_to_finish():
    q = _Recording(range(3), groups=2)
    assert q("next", (0, None)) == 0 and q("next", (1, None)) == 1
    assert q("next", (0, "r0")) == 2
    assert q("next", (1, "r1")) == "wait"      # item 2 is in flight: it may come back
    assert q("next", (1, None)) == "wait"
    assert q("next", (0, "r2")) is None        # no more work: group 0 finishes
    assert q("next", (1, None)) is None
    assert q.results == ["r0", "r1", "r2"] and q.last == [False, True]
    assert [w.state for w in q.work] == ["finishing", "finishing"] and q.settled() == 2


def test_a_lost_group_gives_its_item_back_first():
    q = _Recording(range(4), groups=2, budget=2)
    assert q("next", (0, None)) == 0 and q("next", (1, None)) == 1
    assert q.lose([1, 1]) == [1] and q.lose([1]) == []   # lost once
    assert q.work[1].state == "lost" and q.settled() == 1
    assert q("next", (0, "r0")) == 1   # the lost group's item, within the budget
    assert q("next", (0, "r1")) is None
    assert q.results == ["r0", "r1"] and q.settled() == 2


def test_a_failed_item_stops_every_group_with_its_message():
    q = _Recording(range(9), groups=3)
    for g in range(3):
        q("next", (g, None))
    q("fail", (0, "ValueError: boom"))
    assert q("next", (1, "r1")) == ("error", "ValueError: boom")
    q.stop(2, "rank 0 failed: X")   # the owner's own group, running: the first message stays
    assert q.error == "ValueError: boom" and q.settled() == 3
    assert q.results == ["r1"]


def test_a_result_from_a_group_that_holds_no_item_is_an_error():
    q = _Recording(range(2), groups=1)
    with pytest.raises(IllegalTransition, match="GroupWork group 0: 'complete' is not allowed "
                                                "in state waiting"):
        q("next", (0, "a result nobody asked for"))
    assert q.results == [] and q("next", (0, None)) == 0


# ---- the client's takeover, in one process ---------------------------------------------

class _Service:
    """A service communicator of 3 ranks seen from ``rank``: rank 0 (the owner) is dead."""

    def __init__(self, rank, answers):
        self.rank, self.answers, self.sent = rank, answers, []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return 3

    def Ack_failed(self):
        pass

    def send(self, obj, dest, tag):
        from mpi4py import MPI

        if dest == 0:
            raise MPI.Exception(MPI.ERR_PROC_FAILED)
        self.sent.append((dest, obj))

    def recv(self, source, tag):
        return self.answers[source]


class _Groups:
    def __init__(self, service):
        self.service, self.owner_rank = service, 0


@pytest.fixture
def ulfm(monkeypatch):
    from matex import _runtime
    from matex._workgroups import service

    monkeypatch.setattr(_runtime, "ft_mode", lambda: "ulfm")
    monkeypatch.setattr(service, "failed_ranks", lambda comm: [0])


def test_the_lowest_rank_alive_takes_over_and_the_others_resend_to_it(ulfm):
    from matex._workgroups.service import Client

    taken = []

    def take_over(dead):
        taken.append(dead)
        return lambda op, args: ("answered here", op, args)

    # rank 1, the lowest alive: owns the work from now on, answers itself
    one = Client(_Groups(_Service(1, {})), None, take_over, what="the work")
    assert one("next", 7) == ("answered here", "next", (7,))
    assert taken == [{0}] and one.ownership.owning and one.groups.owner_rank == 1
    assert one("next", 8) == ("answered here", "next", (8,))   # no MPI any more
    assert one.groups.service.sent == []
    # rank 2: the owner is lost, rank 1 owns the work: the request goes there again
    two = Client(_Groups(_Service(2, {1: (True, "from rank 1")})), None, take_over)
    assert two("next", 9) == "from rank 1"
    assert two.ownership.state == "following" and two.groups.owner_rank == 1
    assert two.groups.service.sent == [(1, ("next", (9,)))] and taken == [{0}]


def test_without_a_takeover_the_owners_loss_is_raised(ulfm):
    from mpi4py import MPI

    from matex._workgroups.service import Client

    client = Client(_Groups(_Service(1, {})), None)
    with pytest.raises(MPI.Exception):
        client("next")
    assert client.ownership.state == "following" and client.groups.owner_rank == 0
