"""``python -m matex [--all-ranks] [--horovod] script.py | -m MODULE [args]``: run distributed.

``-m MODULE`` runs a module as ``python -m MODULE`` does (``sys.argv[0]`` its
file, the current directory first on ``sys.path``), e.g. ``-m pytest``.
``--horovod`` makes ``import horovod...`` (``horovod.tensorflow``,
``horovod.tensorflow.keras``, ``horovod.keras``) resolve to ``matex.horovod``
before the script runs, so an unmodified Horovod script runs on MaTEx. Such
a script distributes itself (it shards its data and wraps its optimizer), so
Keras is then left as it is: MaTEx's explicit mode, as with ``import matex``.

``python -m matex --check [--build]`` checks the installation instead
(``matex._check``, as ``matexrun --check``).

The script runs as its own ``__main__`` (``sys.argv``, ``__name__`` and exit
codes behave as when it runs alone). When it imports Keras (``import keras``,
``tf.keras``), Keras is made distributed (``matex._keras``). Ranks other
than 0 print nothing on stdout unless ``--all-ranks`` is given, in which case
their lines are prefixed with ``[rank N]``. An uncaught exception on any rank
prints its traceback and aborts the whole MPI job, so no rank hangs.

Before the script runs on several ranks, Python's ``random``, NumPy's global
generator and TensorFlow's global seed are seeded with one seed from rank 0,
so that the randomness an unseeded script draws agrees on every rank
(``matex._transparent``).

TensorFlow's C++ start-up notices (absl's "All log messages before
absl::InitializeLog()", cpu_feature_guard's instruction-set note, oneDNN's
notice), printed by every rank, are hidden by defaulting
``TF_CPP_MIN_LOG_LEVEL`` to 1 (INFO hidden; warnings, errors and tracebacks
stay visible) before the script imports TensorFlow. A value the user set is
kept. oneDNN's notice ignores that setting on CPUs where TensorFlow turns
oneDNN on by default (AVX512_VNNI/BF16, AMX), so while TensorFlow loads, its
INFO lines are also taken out of the process's stderr (every other line
passes) whenever the level in force hides INFO (``matex._quiet``).
"""

import os
import runpy
import sys
import traceback

from matex import _config, _quiet


class _Prefixed:
    """A text stream that prefixes each line with the rank."""

    def __init__(self, stream, prefix):
        self.stream, self.prefix, self.at_line_start = stream, prefix, True

    def write(self, text):
        out = []
        for piece in text.splitlines(keepends=True):
            if self.at_line_start:
                out.append(self.prefix)
            out.append(piece)
            self.at_line_start = piece.endswith("\n")
        return self.stream.write("".join(out))

    def __getattr__(self, name):
        return getattr(self.stream, name)


USAGE = ("usage: python -m matex [--all-ranks] [--horovod] script.py [args...] | "
         "[--all-ranks] [--horovod] -m MODULE [args...] | --check [--build]")


def _run(argv):
    if argv[:1] == ["--check"]:
        if argv[1:] not in ([], ["--build"]):
            print(USAGE, file=sys.stderr)
            return 2
        from matex import _check

        return _check.main(build=argv[1:] == ["--build"])
    all_ranks = horovod = False
    module = None
    while argv and argv[0].startswith("-"):
        if argv[0] == "--all-ranks":
            all_ranks = True
            argv = argv[1:]
        elif argv[0] == "--horovod":
            horovod = True
            argv = argv[1:]
        elif argv[0] == "-m" and len(argv) > 1:
            module = argv[1]
            argv = argv[1:]   # argv[0] names the module from here on
            break
        elif argv[0].startswith("-m") and len(argv[0]) > 2:   # -mMODULE, as python accepts
            module = argv[0][2:]
            argv = [module] + argv[1:]
            break
        else:
            print(USAGE, file=sys.stderr)
            return 2
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    script = argv[0]
    if module is None and not os.path.isfile(script):
        print("matex: no such script: %s" % script, file=sys.stderr)
        return 2
    if horovod:
        from matex.horovod import _alias

        _alias.install()   # before the script imports anything
    _quiet.quiet_tensorflow_startup()
    rank = _config.launched_rank()
    if _config.ft_requested():
        from matex import _faults

        # MATEX_INJECT_FAULT=...,at=init: lost before it reports anything or MPI starts
        _faults.maybe_fail(0, "init")
    if _config.status_dir():
        from matex import _status

        _status.report_start(rank)   # matexrun --ft: lets it end this rank if excluded
    if rank != 0:
        sys.stdout = _Prefixed(sys.stdout, "[rank %d] " % rank) if all_ranks else open(
            os.devnull, "w")
    from matex import _resilience

    if _resilience.mode() == "ulfm":   # MPI has started
        if _config.status_dir():
            from matex import _status

            _status.report_ready(rank)   # matexrun --ft: ULFM recovers from here on
        # Answer now what would fork later: TensorFlow's import (through h5py)
        # asks `platform` for the processor, which runs `uname -p` once; after
        # MPI_Init a fork is unsafe on RDMA fabrics.
        import platform

        platform.processor()
        # MPI starts now, with the thread that keeps heartbeats flowing while
        # the script imports TensorFlow and computes.
        from matex import _runtime

        _runtime.keep_progressing()
    from matex import _transparent

    sys.argv = list(argv)
    # as python does: the script's directory, or for -m the current directory, first
    sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(script)))
    if module is not None:
        import importlib.util

        try:
            found = importlib.util.find_spec(module)
        except ImportError:
            found = None
        if found is None:
            print("matex: no module named %s" % module, file=sys.stderr)
            return 2
    try:
        size = _transparent.launched_size()
        if size == 1:
            _transparent.leave_script_rngs_alone()
        elif size:
            _transparent.seed_script_rngs()
        # (launcher unknown: seeded when Keras is imported, see matex._keras.install)
        if not horovod:   # a Horovod script distributes itself (its data, its optimizer)
            _transparent.after_import("keras", _install_keras_patch)
            _transparent.after_import("tf_keras", _refuse_tf_keras)   # Keras 2: not covered
            if size != 1:   # TF1 Session scripts (matex.legacy._script)
                _transparent.after_import("tensorflow", _install_tf1_script)
        _transparent.after_import("keras_tuner", _install_tuner_hook)
        if _config.ft_requested():   # a rank lost inside a TF1 Session.run: one clear error
            _transparent.after_import("tensorflow", _install_tf1_ft)
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        code = code or 0
        if code and _config.launched_size() not in (None, 1) and not _config.ft_requested():
            from matex import _resilience   # (ULFM: the survivors go on without this rank)

            _resilience.leave_or_abort(code)   # a peer waiting for this rank must not hang
    except BaseException:  # noqa: BLE001 - any failure must end the whole job
        _abort_job()
        code = 1
    finally:
        sys.stdout.flush()
    _report_exit(rank, code)
    return code


def _report_exit(rank, code):
    """Under ``matexrun --ft``: leave this rank's exit status and the world ranks it lost
    (excluded from its communicator after a failure) for the launcher (``matex._status``)."""
    if not _config.status_dir():
        return
    from matex import _runtime, _status

    lost = ()
    if _runtime.started():
        from mpi4py import MPI

        try:
            world, group = MPI.COMM_WORLD.Get_group(), _runtime.comm().Get_group()
            alive = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
            lost = set(range(world.Get_size())) - set(alive)
            group.Free()
            world.Free()
        except MPI.Exception:
            lost = ()   # a communicator the failure left unusable: the launcher waits
    _status.report_exit(rank, code, lost)


def _install_keras_patch(module):
    from matex._keras.install import install

    install()


def _refuse_tf_keras(module):
    from matex.legacy._keras2 import refuse_transparent

    refuse_transparent(module)


def _install_tf1_script(module):
    from matex.legacy._script import install

    install()


def _install_tf1_ft(module):
    from matex.legacy._script import install_ft

    install_ft()


def _install_tuner_hook(module):
    # Keras Tuner's tuners run distributed: groups of MATEX_RANKS_PER_TRIAL ranks
    from matex.hpo._tuner import install

    install()


def _abort_job():
    # Under ULFM this rank alone dies and the others recover; otherwise every rank
    # ends with its error, or the whole job is aborted so that no rank hangs.
    from matex import _resilience

    _resilience.end_job(traceback.format_exc())


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1:]))
