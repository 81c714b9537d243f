"""Rank groups that take work items from one owner, and who owns the work when ranks die.

Generic machinery shared by ``matex.hpo`` (a work item is a trial) and
``matex.science`` (a grid point of a loss surface); nothing here knows either:

* ``groups``: the ranks split into groups of ``k``, the owner, each group's
  leader, the service communicator, regrouping after a shrink (ULFM);
* ``service``: the owner's background thread answering the leaders
  (``Server``) and a rank's way to it (``Client``), with the takeover by the
  lowest rank alive when the owner dies (ULFM);
* ``machine``: the states as explicit transition tables, whose illegal
  transitions raise: a group's work (``GroupWork``: waiting, running,
  finishing, done, lost; re-formed when its leader is lost) and a rank's
  ownership (``Ownership``: following, owning after a takeover);
* ``queue``: work items handed out to the groups one at a time
  (``WorkQueue``, the ``Server``'s handler for a plain list of items).
"""

from matex._workgroups.groups import Groups, check_group_size
from matex._workgroups.machine import GroupWork, IllegalTransition, Ownership
from matex._workgroups.queue import WorkQueue
from matex._workgroups.service import Client, RemoteError, Server, failed_ranks

__all__ = ["Client", "GroupWork", "Groups", "IllegalTransition", "Ownership", "RemoteError",
           "Server", "WorkQueue", "check_group_size", "failed_ranks"]
