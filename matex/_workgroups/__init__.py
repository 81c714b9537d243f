"""Rank groups that take work items from one owner, and who owns the work when ranks die.

Generic machinery shared by ``matex.hpo`` (a work item is a trial) and
``matex.science`` (a grid point of a loss surface); nothing here knows either:

* ``groups``: the ranks split into groups of ``k``, the owner, each group's
  leader, the service communicator, regrouping after a shrink (ULFM);
* ``service``: the owner's background thread answering the leaders
  (``Server``) and a rank's way to it (``Client``), with the takeover by the
  lowest rank alive when the owner dies (ULFM).
"""

from matex._workgroups.groups import Groups, check_group_size
from matex._workgroups.service import Client, RemoteError, Server, failed_ranks

__all__ = ["Client", "Groups", "RemoteError", "Server", "check_group_size", "failed_ranks"]
