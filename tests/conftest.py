"""Test tiers as pytest markers, so one tier can run alone (``pytest -m ulfm``).

* ``mpi``: launches real ``mpiexec`` jobs (modules that use ``mpitools``);
* ``ulfm``: fault tolerance under ``mpiexec --with-ft ulfm``;
* ``netns``: several "hosts" made of network namespaces (root, ``ip netns``);
* ``sysmpi``: builds and runs against the system's own MPI;
* ``unit``: everything else (one process, seconds).

A test gets one tier, the most specific that applies.
"""

import pytest

TIERS = ("unit", "mpi", "ulfm", "netns", "sysmpi")
_ULFM_MODULES = {"test_fault_tolerance", "test_hpo_fault_tolerance"}


def pytest_configure(config):
    for tier, what in (("unit", "one process, no mpiexec"),
                       ("mpi", "real mpiexec jobs"),
                       ("ulfm", "fault tolerance under mpiexec --with-ft ulfm"),
                       ("netns", "hosts made of network namespaces"),
                       ("sysmpi", "the system's own MPI")):
        config.addinivalue_line("markers", "%s: %s" % (tier, what))


def _tier(item):
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & {"system_mpi", "sysmpi_python"}:
        return "sysmpi"
    if fixtures & {"two_hosts", "netns"}:
        return "netns"
    module = getattr(item, "module", None)
    name = getattr(module, "__name__", "").rsplit(".", 1)[-1]
    if name in _ULFM_MODULES or getattr(module, "TIER", None) == "ulfm":
        return "ulfm"
    if module is not None and "mpitools" in vars(module):
        return "mpi"
    return "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, _tier(item)))
