"""What transparent mode (``python -m matex``, ``import matex.keras``) sets up around a script.

One seed for every rank
-----------------------
Transparent mode runs one copy of the script per rank, and every rank
produces the same *global* batches and keeps its slice (``_batch_slicing``). That
holds only if the randomness the script draws is the same on every rank: an
unseeded ``tf.data`` ``.shuffle()``, a generator drawing its order from
``random`` or ``np.random``, a ``PyDataset`` reshuffling itself. So when
MaTEx becomes active (``python -m matex``: before the script runs;
``import matex.keras``: at that import) it seeds Python's ``random``, NumPy's
global generator and TensorFlow's global seed (``tf.random.set_seed``; when
TensorFlow is imported later, right after that import) with one seed drawn
from fresh entropy on rank 0 and broadcast. A run is therefore still random
from one run to the next, unless the script seeds itself: a script that
seeds afterwards (``keras.utils.set_random_seed(0)``) overrides it, and does
so identically on every rank. A single process is left alone.

Effect on Keras: initializers and layers built without a seed draw theirs
from Python's ``random``, so an unseeded script now builds the same initial
weights and the same dropout generators on every rank. This changes nothing
in what is trained: ``fit`` and a custom loop's first step take rank 0's
weights anyway, and ``fit`` takes rank 0's dropout generator states too
(they are model variables). The generator states are therefore the same on
every rank; the seed a layer draws from one inside a step is made specific to
the rank (``matex._keras.randomness``), so masks and noise differ across the
global batch as in one process while the states stay equal.

TF_CONFIG
---------
At the same moment (several ranks only) a ``TF_CONFIG`` naming a cluster of
more than one task is removed from the environment, and rank 0 says so.
Every rank inherits the same one: ``MultiWorkerMirroredStrategy()`` would
have each rank claim the same task and wait, at construction, for gRPC
peers that never come. Under MaTEx the MPI ranks are the workers: without
it each rank is a single worker and MaTEx averages across them
(``matex._keras.strategies``).
"""

import importlib.abc
import importlib.util
import json
import os
import random
import sys

from matex import _config, _state

_now = _state.namespace("transparent", "process",
                       seed=None,   # the seed in use; None: not decided yet
                       decided=False)
# explicit distributed layers the script imported ("horovod")
_explicit = _state.table("transparent.explicit", "process", factory=list)


def explicit_layer_in_use(name: str) -> None:
    """The script uses an explicit distributed layer (``hvd.init()``, Horovod's optimizer
    or tape): from now on the transparent Keras patches stand down
    (``matex._keras.calls.patch``), so a script that distributes itself is never reduced
    a second time by them. ``reset_explicit_layers`` undoes it (tests)."""
    if name not in _explicit:
        _explicit.append(name)


def explicit_layer():
    """The explicit layer in use (its name), or None."""
    return _explicit[0] if _explicit else None


def reset_explicit_layers() -> None:
    """Forget the explicit layers used so far (the transparent patches act again)."""
    _explicit.clear()


class _ImportHook(importlib.abc.MetaPathFinder):
    """Run module ``name``'s first execution as ``run(execute, module)``.

    Stays in place until then: TensorFlow probes for Keras with find_spec
    before importing it.
    """

    def __init__(self, name, run):
        self.name, self.run, self.searching = name, run, False

    def find_spec(self, name, path, target=None):
        if name != self.name or self.searching:
            return None
        self.searching = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.searching = False
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module
        finder = self

        def exec_module(module):
            try:
                finder.run(execute, module)
            finally:
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)

        spec.loader.exec_module = exec_module
        return spec


def after_import(name, action):
    """Call ``action(module)`` once top-level module ``name`` is imported (now if it is)."""
    if name in sys.modules:
        action(sys.modules[name])
    else:
        def run(execute, module):
            execute(module)
            action(module)

        sys.meta_path.insert(0, _ImportHook(name, run))


def around_import(name, context):
    """Run top-level module ``name``'s first import inside ``context()`` (a context manager).

    Nothing happens if it is imported already.
    """
    if name not in sys.modules:
        def run(execute, module):
            with context():
                execute(module)

        sys.meta_path.insert(0, _ImportHook(name, run))


launched_size = _config.launched_size


def _seed_tensorflow(module):
    module.random.set_seed(_now.seed)


def seed_script_rngs():
    """Seed ``random``, NumPy and TensorFlow with rank 0's fresh seed, once per process.

    Collective on MaTEx's communicator the first time (every rank must call
    it); does nothing in a single process. Returns the seed, or None.
    """
    if _now.decided:
        return _now.seed
    _now.decided = True
    from matex import _runtime

    comm = _runtime.control()
    if comm.Get_size() == 1:
        return None
    import numpy as np

    from matex import _resilience

    def share(c):
        fresh = int(np.random.SeedSequence().entropy % (2 ** 31 - 1)) if c.Get_rank() == 0 \
            else None
        return c.bcast(fresh, root=0)

    # at start-up, outside any recovery loop: a rank lost meanwhile must not end the others
    if _config.ft_requested():
        from matex import _faults

        _faults.maybe_fail(0, "seed")
    _now.seed = _resilience.uniformly(share)
    comm = _runtime.control()
    random.seed(_now.seed)
    np.random.seed(_now.seed)
    after_import("tensorflow", _seed_tensorflow)
    _drop_tf_config(comm.Get_rank(), comm.Get_size())
    return _now.seed


def _drop_tf_config(rank, size):
    """Remove a ``TF_CONFIG`` naming a cluster (see the module's docstring); tasks dropped."""
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster") or {}
        tasks = sum(len(addresses) for addresses in cluster.values())
    except (ValueError, AttributeError, TypeError):
        return 0   # not TF's format either: TensorFlow says so if a strategy reads it
    if tasks <= 1:
        return 0
    del os.environ["TF_CONFIG"]
    if rank == 0:
        print("matex: ignoring TF_CONFIG (a cluster of %d tasks): the %d MPI ranks are the "
              "workers, each one a single-worker MultiWorkerMirroredStrategy" % (tasks, size),
              flush=True)
    return tasks


def leave_script_rngs_alone():
    """Never seed in this process (a single process: nothing to agree on)."""
    _now.decided = True
