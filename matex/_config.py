"""Every ``MATEX_*`` setting read from the environment, in one place.

``VARIABLES`` is the registry: each ``MATEX_*`` variable with its default and
meaning (docs/reference/environment.md is generated from it). The accessors
below read through ``_get``, which refuses a ``MATEX_*`` name the registry
lacks, so a variable cannot exist without its entry.

Each function reads the variable when called (a launcher or test may set it
after import) and turns a bad value into a ``ValueError`` naming the variable.
Nothing here imports MPI or TensorFlow.
"""

import os
from typing import NamedTuple

from matex import _state


class Variable(NamedTuple):
    """One registered environment variable."""

    name: str
    default: str      # as the user would write it; "" for unset
    meaning: str      # one paragraph of Markdown
    scope: str        # "user": set it yourself; "matexrun": matexrun sets it for the ranks
                      # (you may too); "internal": launcher-to-rank plumbing; "tests": the
                      # test suite and benchmarks only


VARIABLES: dict = _state.table("config.variables", lifetime="process")   # name -> Variable


def _register(name: str, default: str, meaning: str, scope: str = "user") -> str:
    VARIABLES[name] = Variable(name, default, " ".join(meaning.split()), scope)
    return name


_register("MATEX_SCALING", "strong", """`fit`'s scaling when the script passes no `scaling=`:
    `strong` (the script's global batch and learning rate, split over the ranks) or `weak`
    (the script's batch per rank, learning rate ramped to N x over the first epoch).""")
_register("MATEX_FUSION_THRESHOLD", "16777216", """Bytes per fused gradient bucket (one
    allreduce per bucket); `0` sends each gradient alone. `matexrun --fusion-threshold-mb`
    sets it.""", "matexrun")
_register("MATEX_COMPRESSION", "", """Gradient compression `DistributedOptimizer` uses when
    the script names none (`matex.keras`, `python -m matex`): `none`, `fp16`, `bf16`,
    `topk:RATIO`, `randomk:RATIO` (RATIO in (0, 1]), `powersgd:RANK`.""")
_register("MATEX_START_TIMEOUT", "600", """Seconds every rank has to reach MaTEx's start
    (starting is collective); after that the ranks that did start raise an error instead of
    hanging. `matexrun --start-timeout` sets it.""", "matexrun")
_register("MATEX_CHECKPOINT_DIR", "", """Where `fit` keeps the checkpoints a restarted job
    resumes from, and `hvd.elastic` its commits. `matexrun --restart`/`--elastic` set it from
    `--checkpoint-dir`.""", "matexrun")
_register("MATEX_INJECT_FAULT", "", """Planned faults for testing recovery, e.g.
    `rank=2,step=30,kind=kill` (several separated by `;`; kinds `kill`, `exception`, `hang`).
    `matexrun --inject-fault` sets it.""", "matexrun")
_register("MATEX_RANKS_PER_TRIAL", "", """Hyperparameter search: ranks that train one trial
    together (must divide the rank count); unset: all ranks. `matexrun --ranks-per-trial`
    sets it.""", "matexrun")
_register("MATEX_TIMELINE", "", """Directory where each rank writes its Chrome-trace
    timeline (`timeline-rank<N>.json`); unset: no timeline. `matexrun --timeline` sets
    it.""", "matexrun")
_register("MATEX_TIMELINE_STEPS", "", """With a timeline: the training steps it records,
    `FIRST-LAST` (both included) or one step; unset: all. `matexrun --timeline-steps`
    sets it.""", "matexrun")
_register("MATEX_MONITOR", "", """`1`: rank 0 prints the job's samples/s, slowest rank and
    allreduce share during `fit`. `matexrun --monitor` sets it.""", "matexrun")
_register("MATEX_MONITOR_INTERVAL", "10", "Seconds between the monitor's lines.")
_register("MATEX_FLIGHT_DIR", "matex-flight", """Where flight-recorder dumps
    (`rank<N>.json`) and stall reports go.""")
_register("MATEX_FLIGHT_ENTRIES", "1024", """Collectives the flight recorder keeps per rank;
    `0` records none.""")
_register("MATEX_STALL_WARNING_S", "60", """Seconds a collective may wait for the other ranks
    before each waiting rank reports the stall; `0` turns the stall inspector off.""")
_register("MATEX_STALL_ABORT_S", "0", """Seconds after which a stalled collective ends the
    job (with the stall report and flight dumps); `0`: never.""")
_register("MATEX_READER_MEMORY", "", """A `matex.readers.DataSet`'s memory budget per rank,
    e.g. `512M`, `2G`; unset: a quarter of the node's memory shared by its ranks, at most
    4 GiB per rank.""")
_register("MATEX_BUILD_DIR", "", """Where the compiled ops are cached (share it between
    nodes); unset: under the virtual environment (`share/matex/build`).""")
_register("MATEX_MPI_INCLUDE", "", """The directory holding the MPI's `mpi.h`, when the op
    build does not find it.""")
_register("MATEX_MPIEXEC", "", """The `mpiexec` matexrun runs; unset: the one of the MPI
    library mpi4py uses.""")
_register("MATEX_HOROVOD_JOIN", "auto", """Whether each Horovod-API reduction is announced
    by a small allreduce, which `hvd.join()` needs where ranks join at different points:
    `auto` (on, unless the main script imports Horovod and never calls its `join`), `1`
    (on), `0` (off: `hvd.join()` then works only where every rank joins at the same
    point).""")
_register("MATEX_ELASTIC_WRITE_EVERY", "1", """`hvd.elastic`: rank 0 writes every N-th
    commit to `MATEX_CHECKPOINT_DIR` (a host loss then resumes from up to N - 1 commits
    back).""")
STATUS_DIR_VAR = _register("MATEX_STATUS_DIR", "", """Set by `matexrun --ft` for the ranks:
    the directory where a failing rank leaves its status for the launcher.""", "internal")
RELAUNCHED_FROM_VAR = _register("MATEX_RELAUNCHED_FROM", "", """Set by `matexrun --ft` when
    it relaunched the job on fewer ranks (a rank died while MPI started): the rank count of
    the first launch.""", "internal")
# the test suite's and benchmarks' own (read by tests/ and benchmarks/, not by matex)
for _name, _default, _meaning in (
        ("MATEX_TEST_REPORT_DIR", "", "Where per-rank test suites leave their reports."),
        ("MATEX_TEST_TIMEOUT", "180", "Seconds a per-rank test may run."),
        ("MATEX_TEST_WORKERS", "1", "`make test`'s pytest-xdist workers (1: none)."),
        ("MATEX_TEST_NETNS", "", "`0` skips the network-namespace cluster tests."),
        ("MATEX_TEST_SYSMPI", "", "`0` skips the tests against the system's MPI libraries."),
        ("MATEX_TEST_SEARCH_AGAIN", "", "Test script: run the search again with N trials."),
        ("MATEX_TEST_KILL_IN_BUILD", "", "Test script: the rank killed while building a model."),
        ("MATEX_TEST_OWNER_DIES_IN_DRAIN", "", "Test script: kill a trial's owner in the drain."),
        ("MATEX_TEST_EXPORT_DIR", "", "Where a graph-mode test exports its trained graph."),
        ("MATEX_CHAOS_RUNS", "2", "Runs per chaos-campaign workload."),
        ("MATEX_CHAOS_SEED", "1", "The chaos campaign's seed (`random`: drawn)."),
        ("MATEX_CHAOS_WORKLOADS", "", "The chaos campaign's workloads (comma-separated)."),
        ("MATEX_PIPELINE_SAVE_DIR", "", "Where pipeline tests save and compare models."),
        ("MATEX_BENCH_DIR", "", "Where the reader benchmarks keep their files."),
        ("MATEX_NETNS_SUBNET", "", "The network-namespace cluster's subnet."),
        ("MATEX_NETNS_AGENT_LOG", "", "File the namespace launch agent logs to."),
        ("MATEX_SYSMPI_CACHE", "~/.cache/matex/sysmpi", "Where system MPI builds are cached."),
        ("MATEX_CLUSTER_DIR", "", "The cluster test's shared directory."),
        ("MATEX_WAIT_FOR", "", "Cluster test: the host to wait for."),
        ("MATEX_SSH_PORT", "", "Cluster test: the ssh port."),
):
    _register(_name, _default, _meaning, "tests")

# (rank variable, size variables) of each launcher MaTEx knows, in this order: Open MPI,
# PMI (MPICH's Hydra, Intel MPI), MVAPICH2, PMIx, Slurm's srun. Rank and size are read from
# the same launcher's pair; Slurm's only within an srun step (SLURM_STEP_ID set: a batch
# script's SLURM_PROCID/SLURM_NTASKS describe the allocation, not this process).
_LAUNCHERS = (
    ("OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",)),
    ("PMI_RANK", ("PMI_SIZE",)),
    ("MV2_COMM_WORLD_RANK", ("MV2_COMM_WORLD_SIZE",)),
    ("PMIX_RANK", ()),
    ("SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")),
)


def _get(name: str, default: str = "", env=None) -> str:
    if name.startswith("MATEX_") and name not in VARIABLES:
        raise KeyError("%s is not in matex._config.VARIABLES: register it there" % name)
    return (os.environ if env is None else env).get(name, default)


def variable(name: str) -> str:
    """The value of registered ``MATEX_*`` variable ``name``, or "" when unset."""
    return _get(name)


def _number(name: str, default: float, kind=float, minimum=None):
    text = _get(name).strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ValueError("%s must be a %s, not %r" % (
            name, "whole number" if kind is int else "number", text)) from None
    if minimum is not None and value < minimum:
        raise ValueError("%s must be >= %s, not %s" % (name, minimum, text))
    return value


def _mpi_world():
    """(rank, size) in ``MPI_COMM_WORLD`` when MPI is running in this process, else None.

    Imports nothing: only an MPI that mpi4py already initialised is asked.
    """
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    except Exception:  # noqa: BLE001 - identity must never fail
        pass
    return None


def _launcher():
    """The (rank, size or None) the launcher's environment gives, or None."""
    for rank_var, size_vars in _LAUNCHERS:
        if not _get(rank_var).isdigit():
            continue
        if rank_var == "SLURM_PROCID" and not _get("SLURM_STEP_ID"):
            continue
        size = next((int(_get(v)) for v in size_vars if _get(v).isdigit()), None)
        return int(_get(rank_var)), size
    return None


def launched_rank() -> int:
    """This process's rank in ``MPI_COMM_WORLD``: MPI's answer once MPI runs, before that
    the launcher's environment (``_LAUNCHERS``); 0 for a process no launcher started."""
    world = _mpi_world()
    if world is not None:
        return world[0]
    launched = _launcher()
    return launched[0] if launched is not None else 0


def launched_size():
    """Number of ranks in ``MPI_COMM_WORLD`` (MPI's answer once MPI runs, else the
    launcher's environment), or None when unknown."""
    world = _mpi_world()
    if world is not None:
        return world[1]
    launched = _launcher()
    return launched[1] if launched is not None else None


def launched_on_one_node() -> bool | None:
    """Whether every rank of this job runs on this node, from the launcher's environment
    (before MPI starts): True for a process no launcher started, None when the launcher
    does not say (only Open MPI's gives the node's share, ``OMPI_COMM_WORLD_LOCAL_SIZE``)."""
    if _launcher() is None:
        return True
    size, local = _get("OMPI_COMM_WORLD_SIZE"), _get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if size.isdigit() and local.isdigit():
        return size == local
    return None


def ft_requested() -> bool:
    """Whether the launcher asked for ULFM (``mpiexec --with-ft ulfm``); no MPI needed."""
    return _get("OMPI_MCA_mpi_ft_enable").lower() in ("1", "true", "yes")


def scaling(given=None) -> str:
    """``fit``'s scaling mode: the argument, else ``MATEX_SCALING``, else "strong"."""
    value = given or _get("MATEX_SCALING") or "strong"
    if value not in ("strong", "weak"):
        raise ValueError("scaling must be 'strong' or 'weak', not %r" % value)
    return value


def checkpoint_dir():
    """``MATEX_CHECKPOINT_DIR`` (set by ``matexrun --restart``), or None."""
    return _get("MATEX_CHECKPOINT_DIR") or None


def inject_fault_spec() -> str:
    """``MATEX_INJECT_FAULT``: the planned faults (see ``matex._faults``)."""
    return _get("MATEX_INJECT_FAULT")


def relaunched_from() -> int | None:
    """The rank count ``matexrun --ft`` first launched this job with, when it relaunched
    it on fewer ranks (a rank died while MPI started); None otherwise."""
    text = _get(RELAUNCHED_FROM_VAR).strip()
    return int(text) if text.isdigit() else None


def status_dir(env=None):
    """``MATEX_STATUS_DIR`` (of ``env``, default the process's): where a failing rank
    leaves its status for the launcher (``matex._status``), or None."""
    return _get(STATUS_DIR_VAR, env=env) or None


def build_dir():
    """``MATEX_BUILD_DIR``: where compiled libraries are cached (None: under the venv)."""
    return _get("MATEX_BUILD_DIR") or None


def mpi_include():
    """``MATEX_MPI_INCLUDE``: the directory holding the MPI's ``mpi.h``, when given."""
    return _get("MATEX_MPI_INCLUDE") or None


def mpiexec():
    """``MATEX_MPIEXEC``: the mpiexec matexrun runs, when given."""
    return _get("MATEX_MPIEXEC") or None


def reader_memory():
    """``MATEX_READER_MEMORY``: a DataSet's memory budget per rank ("512M", "2G"), or None."""
    return _get("MATEX_READER_MEMORY") or None


DEFAULT_FUSION_THRESHOLD = 16 * 1024 * 1024


def horovod_join() -> str:
    """``MATEX_HOROVOD_JOIN``: "auto" (default), "1" or "0"; anything else is a ValueError."""
    value = _get("MATEX_HOROVOD_JOIN").strip().lower() or "auto"
    if value not in ("auto", "1", "0"):
        raise ValueError("MATEX_HOROVOD_JOIN must be auto, 1 or 0, not %r" % value)
    return value


ELASTIC_WRITE_EVERY_VAR = "MATEX_ELASTIC_WRITE_EVERY"


def elastic_write_every() -> int:
    """``MATEX_ELASTIC_WRITE_EVERY``: rank 0 writes every N-th ``hvd.elastic`` commit (1)."""
    value = _get(ELASTIC_WRITE_EVERY_VAR) or "1"
    try:
        every = int(value)
    except ValueError:
        every = 0
    if every < 1:
        raise ValueError("%s must be a positive integer, not %r"
                         % (ELASTIC_WRITE_EVERY_VAR, value))
    return every


def fusion_threshold() -> int:
    """Gradient bucket size in bytes: ``MATEX_FUSION_THRESHOLD`` or 16 MiB; 0 disables fusion."""
    return _number("MATEX_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD, int, 0)


_register("MATEX_INTRA_OP_THREADS", "auto", """TensorFlow compute threads per rank: `auto`
    (this rank's share of the cores its node's ranks may run on, set as
    `TF_NUM_INTRAOP_THREADS` when MaTEx starts), `tf` (TensorFlow's default: every core the
    process may run on), or a number. `TF_NUM_INTRAOP_THREADS` set by you wins.""")


_register("MATEX_INTRA_OP_THREADS_SET", "", """The `TF_NUM_INTRAOP_THREADS` MaTEx set in a
    rank, so that a process the rank starts tells it from one the user set.""", "internal")


_register("MATEX_MPI_WAIT", "yield", """How a rank waits in MPI (Open MPI): `yield` (its core
    goes to whatever else wants it, `mpi_yield_when_idle`) or `poll` (Open MPI's busy polling:
    lowest latency when every rank has a core to itself and nothing else runs). Set before MPI
    starts; `OMPI_MCA_mpi_yield_when_idle` set by you wins.""")


_register("MATEX_MPI_WAIT_SET", "", """The `OMPI_MCA_mpi_yield_when_idle` MaTEx set, so that a
    process started from a MaTEx process tells it from one the user set.""", "internal")


_register("MATEX_MPI_BTL_SET", "", """The `OMPI_MCA_btl` MaTEx set (`^ofi`, on one node), so that
    a process started from a MaTEx process tells it from one the user set.""", "internal")


def mpi_wait() -> str:
    """``MATEX_MPI_WAIT``: ``"yield"`` (the default) or ``"poll"``."""
    text = _get("MATEX_MPI_WAIT").strip().lower() or "yield"
    if text not in ("yield", "poll"):
        raise ValueError("MATEX_MPI_WAIT must be yield or poll, not %r"
                         % _get("MATEX_MPI_WAIT"))
    return text


def intra_op_threads():
    """``MATEX_INTRA_OP_THREADS``: ``"auto"``, ``"tf"`` or a whole number >= 1."""
    text = _get("MATEX_INTRA_OP_THREADS").strip().lower()
    if text in ("", "auto", "tf"):
        return text or "auto"
    return _number("MATEX_INTRA_OP_THREADS", 0, int, 1)


def start_timeout() -> float:
    """Seconds every rank has to reach MaTEx's start (``MATEX_START_TIMEOUT``, default 600).

    Starting is collective: a script that imports ``matex.keras`` (or first
    uses MaTEx) on some ranks only would hang there; after this long it is
    an error instead.
    """
    return _number("MATEX_START_TIMEOUT", 600.0, float, 0.001)


def ranks_per_trial():
    """``MATEX_RANKS_PER_TRIAL`` (set by ``matexrun --ranks-per-trial``): ranks that train one
    hyperparameter-search trial together, or None when not set."""
    return _number("MATEX_RANKS_PER_TRIAL", None, int, 1)


def flight_dir() -> str:
    """``MATEX_FLIGHT_DIR``: where flight-recorder dumps and stall reports go (./matex-flight)."""
    return _get("MATEX_FLIGHT_DIR") or "matex-flight"


def flight_entries() -> int:
    """``MATEX_FLIGHT_ENTRIES``: collectives the flight recorder keeps per rank (default 1024;
    0 records none)."""
    return _number("MATEX_FLIGHT_ENTRIES", 1024, int, 0)


def stall_warning_s() -> float:
    """``MATEX_STALL_WARNING_S``: seconds a collective may wait for the other ranks before each
    waiting rank reports the stall (default 60; 0 turns the stall inspector off)."""
    return _number("MATEX_STALL_WARNING_S", 60.0, float, 0.0)


def stall_abort_s():
    """``MATEX_STALL_ABORT_S``: seconds after which a stalled collective ends the job (with
    the stall report and flight dumps); None (unset or 0): never."""
    value = _number("MATEX_STALL_ABORT_S", 0.0, float, 0.0)
    return value or None


def job_id() -> str:
    """The launcher's id of this job (PMIx namespace, Slurm job id), or "": tells the dumps of
    one run from those an earlier run left in the same directory."""
    for var in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID"):
        if _get(var):
            return _get(var)
    if _get("SLURM_JOB_ID"):   # one job's srun steps are separate runs
        step = _get("SLURM_STEP_ID")
        return _get("SLURM_JOB_ID") + ("." + step if step else "")
    return ""


def timeline_dir():
    """``MATEX_TIMELINE`` (set by ``matexrun --timeline DIR``): where each rank writes its
    Chrome-trace timeline, or None (no timeline)."""
    return _get("MATEX_TIMELINE") or None


def parse_step_range(text: str, name: str = "MATEX_TIMELINE_STEPS"):
    """``"100-120"`` (both included) or ``"7"`` -> ``(first, last)``; a clear ValueError else."""
    parts = text.strip().split("-")
    try:
        if len(parts) == 1:
            first = last = int(parts[0])
        elif len(parts) == 2:
            first, last = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError("%s must be a step or a range of steps like 100-120, not %r"
                         % (name, text)) from None
    if first < 0 or last < first:
        raise ValueError("%s: the range %r is empty or negative (first step <= last step, "
                         "both >= 0)" % (name, text))
    return first, last


def timeline_steps():
    """``MATEX_TIMELINE_STEPS`` (``matexrun --timeline-steps 100-120``): the training steps the
    timeline records (first, last), or None (all)."""
    text = _get("MATEX_TIMELINE_STEPS").strip()
    return parse_step_range(text) if text else None


def monitor() -> bool:
    """``MATEX_MONITOR`` (``matexrun --monitor``): whether rank 0 prints live job figures."""
    return _get("MATEX_MONITOR").strip().lower() in ("1", "true", "yes", "on")


_register("MATEX_METRICS_EVERY", "10", """Batches between the exact global metrics `fit`'s
    and `evaluate`'s progress bar shows (one small allreduce each time; the epoch's figures
    are always exact). A callback that reads every batch's logs gets them every batch.""")


_register("MATEX_SKIP_LIMIT", "5", """Steps in a row `fit` may leave uncommitted because a
    rank's gradients held a NaN or an infinity (each step's commit vote rides in the gradients'
    allreduce), and calls in a row of a `run_resilient` step that commit nothing (a
    `matex.should_commit` vote refused them); at this many every rank raises the same
    error.""")


_register("MATEX_COMMIT_VOTE", "1", """`0`: `fit`'s step carries no commit vote (a rank's
    non-finite gradients are then averaged into every rank's weights, as in MaTEx before the
    vote); read when the step is traced.""")


def commit_vote() -> bool:
    """``MATEX_COMMIT_VOTE``: whether ``fit``'s step carries the commit vote (1)."""
    value = _get("MATEX_COMMIT_VOTE").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError("MATEX_COMMIT_VOTE must be 0 or 1, not %r" % value)
    return value == "1"


def skip_limit() -> int:
    """``MATEX_SKIP_LIMIT``: refused steps in a row before every rank raises (5)."""
    return _number("MATEX_SKIP_LIMIT", 5, int, 1)


def metrics_every() -> int:
    """``MATEX_METRICS_EVERY``: batches between the progress bar's global metrics (10)."""
    return _number("MATEX_METRICS_EVERY", 10, int, 1)


def monitor_interval() -> float:
    """``MATEX_MONITOR_INTERVAL``: seconds between the monitor's lines (default 10)."""
    return _number("MATEX_MONITOR_INTERVAL", 10.0, float, 0.001)


# name -> what follows the colon: a ratio in (0, 1], a whole rank >= 1, or nothing
_COMPRESSION_ARGS = {"none": None, "fp16": None, "bf16": None, "topk": "ratio",
                     "randomk": "ratio", "powersgd": "rank"}


def parse_compression(text: str, name: str = "MATEX_COMPRESSION"):
    """``"topk:0.01"`` -> ``("topk", 0.01)``; ``"fp16"`` -> ``("fp16", None)``; "none"/"" -> None.

    Known: none, fp16, bf16, topk:RATIO, randomk:RATIO (RATIO in (0, 1]), powersgd:RANK
    (RANK >= 1). Anything else is a ValueError naming ``name``.
    """
    text = text.strip().lower()
    if not text:
        return None
    kind, _, arg = text.partition(":")
    if kind not in _COMPRESSION_ARGS:
        raise ValueError("%s: unknown compression %r (known: none, fp16, bf16, topk:RATIO, "
                         "randomk:RATIO, powersgd:RANK)" % (name, text))
    wants = _COMPRESSION_ARGS[kind]
    if wants is None:
        if arg:
            raise ValueError("%s: %r takes no argument, got %r" % (name, kind, text))
        return None if kind == "none" else (kind, None)
    try:
        value = float(arg) if wants == "ratio" else int(arg)
    except ValueError:
        raise ValueError("%s: %s needs a %s after the colon, e.g. %s, not %r" % (
            name, kind, "ratio in (0, 1]" if wants == "ratio" else "whole rank >= 1",
            "topk:0.01" if wants == "ratio" else "powersgd:4", text)) from None
    if wants == "ratio" and not 0 < value <= 1:
        raise ValueError("%s: the %s ratio must be in (0, 1], not %s" % (name, kind, arg))
    if wants == "rank" and value < 1:
        raise ValueError("%s: the powersgd rank must be >= 1, not %s" % (name, arg))
    return kind, value


def compression():
    """``MATEX_COMPRESSION``: the gradient compression ``DistributedOptimizer`` uses when none
    is given (``matex.keras``, ``python -m matex``), as ``(kind, value)``, or None."""
    return parse_compression(_get("MATEX_COMPRESSION"))
