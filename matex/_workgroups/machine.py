"""The states a rank group and a rank's ownership go through, as explicit transition tables.

A run with work items handed out to rank groups has two kinds of state, kept
by the owner for each group and by each rank for the ownership:

``GroupWork`` (the owner's view of one group)::

    WAITING --assign--> RUNNING --complete--> WAITING      one item after another
    WAITING --finish--> FINISHING --release--> DONE         no more work; its ranks leave
    RUNNING --fail----> FINISHING                          the item failed: the group stops
    FINISHING --finish--> FINISHING                        asked again while others finish
    WAITING/RUNNING --reform--> same state                 leader lost: survivors go on
    WAITING/RUNNING/FINISHING --lose--> LOST                no rank left: its item is requeued
    DONE --lose--> DONE                                    ranks lost after they left: nothing

``Ownership`` (a rank's view of who owns the work)::

    FOLLOWING --owner_lost--> FOLLOWING   the owner died; the lowest rank alive takes over
    FOLLOWING --take_over--> OWNING       the owner died; this rank is the lowest alive
                                          (an owner never sees itself die: owning is final)

Any other (state, event) raises ``IllegalTransition``: a protocol step out of
order (a result from a group that holds no item, a lost group asking for
work) is an error, not a silent reset. The machines are not thread-safe: the
owner's queue fires them under its own lock.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple


class IllegalTransition(RuntimeError):
    """An event that the machine's current state does not allow."""


class Machine:
    """A state machine driven by a transition table ``{(state, event): next_state}``.

    Subclasses set ``TRANSITIONS`` and ``INITIAL``; ``fire(event)`` moves to the
    next state or raises ``IllegalTransition`` naming the state, the event and
    the events that state allows.
    """

    TRANSITIONS: Dict[Tuple[str, str], str] = {}
    INITIAL = ""

    def __init__(self, state: Optional[str] = None, name: str = ""):
        state = self.INITIAL if state is None else state
        if state not in self.states():
            raise ValueError("%s: no state %r (one of %s)" % (
                type(self).__name__, state, ", ".join(sorted(self.states()))))
        self.state, self.name = state, name

    @classmethod
    def states(cls) -> set:
        """Every state of the table."""
        return {s for s, _ in cls.TRANSITIONS} | set(cls.TRANSITIONS.values())

    def allowed(self) -> list:
        """The events the current state allows, sorted."""
        return sorted(e for s, e in self.TRANSITIONS if s == self.state)

    def can(self, event: str) -> bool:
        """Whether ``event`` is legal now."""
        return (self.state, event) in self.TRANSITIONS

    def fire(self, event: str) -> str:
        """Take the transition for ``event``; returns the new state."""
        try:
            self.state = self.TRANSITIONS[(self.state, event)]
        except KeyError:
            raise IllegalTransition("%s%s: %r is not allowed in state %s (allowed: %s)" % (
                type(self).__name__, " %s" % self.name if self.name else "", event, self.state,
                ", ".join(self.allowed()) or "none")) from None
        return self.state

    def in_(self, states: Iterable[str]) -> bool:
        """Whether the current state is one of ``states``."""
        return self.state in set(states)

    def __repr__(self) -> str:
        return "%s(%r%s)" % (type(self).__name__, self.state,
                             ", name=%r" % self.name if self.name else "")


WAITING, RUNNING, FINISHING, DONE, LOST = "waiting", "running", "finishing", "done", "lost"


class GroupWork(Machine):
    """One group's work, as the owner sees it (see the module's table)."""

    INITIAL = WAITING
    TRANSITIONS = {
        (WAITING, "assign"): RUNNING,
        (WAITING, "finish"): FINISHING,
        (WAITING, "reform"): WAITING,
        (WAITING, "lose"): LOST,
        (RUNNING, "complete"): WAITING,
        (RUNNING, "fail"): FINISHING,
        (RUNNING, "reform"): RUNNING,
        (RUNNING, "lose"): LOST,
        (FINISHING, "finish"): FINISHING,
        (FINISHING, "release"): DONE,
        (FINISHING, "lose"): LOST,
        (DONE, "lose"): DONE,
    }
    #: states in which the group asks for no more work
    SETTLED = frozenset((FINISHING, DONE, LOST))

    @property
    def settled(self) -> bool:
        """Whether the group will take no more work (finishing, done or lost)."""
        return self.state in self.SETTLED


FOLLOWING, OWNING = "following", "owning"


class Ownership(Machine):
    """Whether this rank owns the work, and how that changes when the owner dies."""

    INITIAL = FOLLOWING
    TRANSITIONS = {
        (FOLLOWING, "owner_lost"): FOLLOWING,
        (FOLLOWING, "take_over"): OWNING,
    }

    @property
    def owning(self) -> bool:
        """Whether this rank owns the work (its requests go to its own handler)."""
        return self.state == OWNING
