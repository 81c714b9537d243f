"""Test tiers as pytest markers, so one tier can run alone (``pytest -m ulfm``).

* ``mpi``: launches real ``mpiexec`` jobs (modules that use ``mpitools``);
* ``ulfm``: fault tolerance under ``mpiexec --with-ft ulfm``;
* ``chaos``: random kills under ULFM (``test_chaos``; ``MATEX_CHAOS_RUNS`` sets how many);
* ``netns``: several "hosts" made of network namespaces (root, ``ip netns``);
* ``sysmpi``: builds and runs against the system's own MPI;
* ``unit``: everything else (one process, seconds).

``MATEX_TEST_WORKERS=N make test`` shares the modules among N pytest-xdist workers, a
module on one worker. Jobs of two workers may run side by side: a test looks only at its
own job's processes, files and namespaces.

A test gets one tier, the most specific that applies.

A test that failed only because Open MPI's launcher failed to start, before any rank
ran (``matex.launcher.TRANSIENT_STARTUP_FAILURES``: seen once in several hundred
launches in CI), is run again, twice at most (pytest-rerunfailures, ``--only-rerun``
those messages). Any other failure fails at once; ``--reruns`` given by hand wins.

Every process the suite starts imports ``tests/site/sitecustomize.py``: less garbage
collection while TensorFlow is imported, and none of the whole heap at exit (together
about 1.8 s of each TensorFlow process).
"""

import os
import re

import pytest

# every process the suite starts collects less during TensorFlow's import and not at
# exit: tests/site/sitecustomize.py
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_SITE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _SITE])

TIERS = ("unit", "mpi", "ulfm", "chaos", "netns", "sysmpi")
_ULFM_MODULES = {"test_fault_tolerance", "test_hpo_fault_tolerance"}


def _rerun_startup_flakes(config):
    if not config.pluginmanager.hasplugin("rerunfailures") or config.getoption("reruns"):
        return
    from matex.launcher import mpiexec

    config.option.only_rerun = [re.escape(m) for m in mpiexec.TRANSIENT_STARTUP_FAILURES]
    config.option.reruns = mpiexec.STARTUP_RETRIES


def pytest_configure(config):
    _rerun_startup_flakes(config)
    for tier, what in (("unit", "one process, no mpiexec"),
                       ("mpi", "real mpiexec jobs"),
                       ("ulfm", "fault tolerance under mpiexec --with-ft ulfm"),
                       ("chaos", "random kills under ULFM (MATEX_CHAOS_RUNS runs)"),
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
    name = _module_name(item)
    if getattr(module, "TIER", None) in ("ulfm", "chaos"):
        return module.TIER
    if name in _ULFM_MODULES:
        return "ulfm"
    if module is not None and "mpitools" in vars(module):
        return "mpi"
    return "unit"


# Modules that take minutes, started first when pytest-xdist shares the modules among
# workers (``-n N --dist loadfile --no-loadscope-reorder``), longest first,
# so that the last minutes do not run one long module alone. Order only: a module not
# listed keeps its place after these.
_LONG_FIRST = ("test_fault_tolerance", "test_pipeline", "test_benchmarks", "test_cluster",
               "test_mpi_suites", "test_transparency", "test_hpo_oracles", "test_legacy_tf1",
               "test_readers", "test_parallel", "test_chaos", "test_elastic", "test_launch",
               "test_packaging", "test_layers_distributed", "test_legacy_keras2",
               "test_science_training", "test_legacy_graph")


def _module_name(item):
    return getattr(getattr(item, "module", None), "__name__", "").rsplit(".", 1)[-1]


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, _tier(item)))
    if os.environ.get("PYTEST_XDIST_WORKER"):   # one pytest keeps the files' order
        rank = {name: i for i, name in enumerate(_LONG_FIRST)}
        items.sort(key=lambda item: rank.get(_module_name(item), len(rank)))


@pytest.fixture(autouse=True)
def _explicit_layers_end_with_the_test():
    """A test that used Horovod's layer leaves MaTEx's transparent Keras patches acting for
    the next one (they stand down once a script uses an explicit layer)."""
    yield
    if "matex._transparent" in __import__("sys").modules:
        from matex import _transparent

        _transparent.reset_explicit_layers()
