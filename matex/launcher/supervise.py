"""Supervising the job: rank failures under ``--ft``, restarts under ``--restart``.

Under ULFM, ``mpiexec`` exits 0 even when every rank died, and waits for a
hung rank the survivors excluded. So the ranks report to a status directory
(``matex._status``): where they run, that they failed, or that their script
returned (exit status, ranks they lost). The launcher creates the directory,
names it to every rank in ``MATEX_STATUS_DIR``, ends excluded ranks that
still run once the others are done, decides the exit status from the reports
(``job_exit_status``) and removes the directory. Nothing depends on what the
ranks print, or on where their stderr goes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from matex._config import RELAUNCHED_FROM_VAR, STATUS_DIR_VAR
from matex.launcher.mpiexec import STARTUP_RETRIES, startup_failed
from matex._status import (Status, failed_ranks, read_status,  # noqa: F401 - re-exported
                           report_failure)


@contextlib.contextmanager
def status_directory(parent: str | None = None) -> Iterator[str]:
    """A new, empty status directory in ``parent`` (default: the temporary directory).

    Removed, with whatever the ranks wrote, when the block ends.
    """
    directory = tempfile.mkdtemp(prefix="matexrun-status-", dir=parent)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# After every rank has finished, failed or been excluded by a survivor, a rank
# still running is one the survivors excluded (a hung rank: mpiexec would wait
# for it forever). It is SIGKILLed where it runs on this host; if mpiexec has
# still not ended this many seconds later, it is terminated.
END_GRACE_S = 20.0
POLL_S = 0.25


def job_exit_status(status: Status, nranks: int,
                    mpiexec_code: int) -> tuple[int, str | None]:
    """``matexrun --ft``'s exit status from the ranks' reports, with the line explaining it.

    The rule: 1 when no rank finished its script (every rank failed or was
    killed); else the first non-zero exit status of a rank that finished (a
    surviving rank that failed fails the job); else 0: the survivors finished
    cleanly, and ranks lost on the way (killed, failed, hung and excluded) do
    not fail a fault-tolerant job. ``mpiexec_code`` only matters when no rank
    reported anything (mpiexec could not start them).
    """
    if not status.exited:
        if mpiexec_code and not status.started:
            return mpiexec_code, None
        return 1, ("matexrun: every rank failed (%d of %d): no rank finished its script; "
                   "the job failed" % (nranks, nranks))
    bad = {rank: code for rank, code in sorted(status.exited.items()) if code}
    if bad:
        rank, code = next(iter(bad.items()))
        return code, ("matexrun: rank(s) %s finished with exit status %s; the job failed"
                      % (", ".join(map(str, bad)), ", ".join(map(str, bad.values()))))
    gone = sorted(set(range(nranks)) - set(status.exited))
    if gone:
        return 0, ("matexrun: rank(s) %s failed; the %d other(s) finished cleanly"
                   % (", ".join(map(str, gone)), len(status.exited)))
    return 0, None


def _is_our_rank(pid, directory):
    """Whether process ``pid`` is a rank of this job (its environment names ``directory``)."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as environ:
            names = environ.read().split(b"\0")
    except OSError:
        return False
    return ("%s=%s" % (STATUS_DIR_VAR, directory)).encode() in names


def _end_excluded_ranks(status, directory):
    """SIGKILL the ranks still alive on this host that the survivors excluded; their ranks."""
    here = socket.gethostname()
    ended = []
    for rank in sorted(status.lost - set(status.exited)):
        host, pid = status.started.get(rank, (None, None))
        if host == here and pid and _is_our_rank(pid, directory):
            try:
                os.kill(pid, signal.SIGKILL)
                ended.append(rank)
            except OSError:
                pass   # gone already
    return ended


class _Mpiexec:
    """An mpiexec whose stderr passes through to ours as it comes, its tail kept.

    The tail tells a transient start-up failure (``startup_failed``) from the
    job's own; nothing else reads what the ranks print.
    """

    TAIL = 1 << 16

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str]):
        self.proc = subprocess.Popen(list(cmd), env=dict(env), stderr=subprocess.PIPE)
        self._tail = bytearray()
        self._pump = threading.Thread(target=self._copy, name="matexrun-stderr", daemon=True)
        self._pump.start()

    def _copy(self):
        fd = self.proc.stderr.fileno()
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            try:
                os.write(2, chunk)
            except OSError:
                pass   # our stderr is gone; keep draining so mpiexec never blocks
            self._tail += chunk
            del self._tail[:-self.TAIL]

    def wait(self) -> int:
        self.proc.wait()
        self._pump.join()
        if self.proc.stderr is not None:   # always a pipe here
            self.proc.stderr.close()
        return self.proc.returncode

    def failed_to_start(self) -> bool:
        return startup_failed(self.proc.returncode, self._tail.decode("utf-8", "replace"))


def _note_retry(attempt):
    print("matexrun: mpiexec failed to start the job (a transient launcher failure, above); "
          "retrying (%d of %d)" % (attempt, STARTUP_RETRIES), file=sys.stderr, flush=True)


def _call(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``cmd`` (an mpiexec) to the end; retried when it failed transiently to start."""
    for attempt in range(STARTUP_RETRIES + 1):
        job = _Mpiexec(cmd, env)
        try:
            code = job.wait()
        except BaseException:
            job.proc.kill()
            job.wait()
            raise
        if not job.failed_to_start() or attempt == STARTUP_RETRIES:
            return code
        _note_retry(attempt + 1)
    return code


def run_captured(cmd: Sequence[str], env: Mapping[str, str] | None = None,
                 timeout: float | None = None,
                 cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (an mpiexec) with its output captured; retried when it failed to start.

    For drivers and tests that read a job's output. On timeout, mpiexec and
    every rank it started are killed, and ``subprocess.TimeoutExpired`` carries
    what they printed.
    """
    for attempt in range(STARTUP_RETRIES + 1):
        proc = subprocess.Popen(list(cmd), env=None if env is None else dict(env), cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # mpiexec and every rank it started
            out, err = proc.communicate()
            assert timeout is not None   # communicate() times out only with a timeout
            raise subprocess.TimeoutExpired(list(cmd), timeout, out, err) from None
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        if not startup_failed(proc.returncode, err) or attempt == STARTUP_RETRIES:
            break
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def run_fault_tolerant(cmd: Sequence[str], env: Mapping[str, str], nranks: int,
                       status_parent: str | None = None, one_host: bool = False) -> int:
    """Run ``cmd`` (an mpiexec under ULFM) on ``nranks`` ranks; the job's exit status.

    The ranks find their status directory, created in ``status_parent``, in
    ``MATEX_STATUS_DIR`` (``cmd`` must forward it to other hosts, and there
    ``status_parent`` must be a directory they share). The exit status follows
    ``job_exit_status``. Once every rank has finished, failed or been excluded
    by a survivor, excluded ranks still running are ended (see ``END_GRACE_S``).
    A launch that failed transiently before any rank started is retried.

    ULFM recovers from a lost rank only once MPI has started: a rank lost
    before (or inside) ``MPI_Init`` leaves every other rank waiting in
    ``MPI_Init`` forever. When a rank on this host has died while no rank has
    MPI running yet (``report_ready``), nothing has been computed, so the job
    is ended and launched again on the ranks that are left (at most
    ``INIT_RELAUNCHES`` times). The ranks' processes on this host are found by
    their environment (``_job_ranks``); with ``one_host`` (every rank runs
    here) a rank with no process is dead too, however early it died. A rank
    on another host lost that early is not seen here.
    """
    retries = relaunches = 0
    cmd, env, launched = list(cmd), dict(env), nranks
    while True:
        code, line, outcome = _run_fault_tolerant_once(cmd, env, nranks, status_parent,
                                                       one_host)
        if outcome == "failed to start" and retries < STARTUP_RETRIES:
            retries += 1
            _note_retry(retries)
            continue
        if isinstance(outcome, list) and relaunches < INIT_RELAUNCHES \
                and nranks > len(outcome):
            relaunches += 1
            nranks -= len(outcome)
            cmd[cmd.index("-n") + 1] = str(nranks)
            env["MATEX_INJECT_FAULT"] = ""   # injected faults fire in the first run only
            if RELAUNCHED_FROM_VAR not in env:
                # the ranks as first launched: rank groups (a search's) are made as launched
                env[RELAUNCHED_FROM_VAR] = str(launched)
                at = cmd.index("-n") + 2
                cmd[at:at] = ["-x", RELAUNCHED_FROM_VAR]
            print("matexrun: rank(s) %s died while MPI was starting, before any rank could "
                  "compute (ULFM recovers from a lost rank only once MPI has started); "
                  "relaunching the job on %d rank(s) (%d of %d)"
                  % (", ".join(map(str, outcome)), nranks, relaunches, INIT_RELAUNCHES),
                  file=sys.stderr, flush=True)
            continue
        break
    if line:
        print(line, file=sys.stderr, flush=True)
    return code


# A rank on this host that died while no rank had started MPI leaves the
# others inside MPI_Init for good; after this many seconds with no rank
# reporting MPI started, the job is ended and relaunched (INIT_RELAUNCHES).
INIT_DEATH_GRACE_S = 3.0
INIT_RELAUNCHES = 3


def _job_ranks(directory) -> dict[int, int]:
    """{world rank: pid} of this job's live rank processes on this host (found by the
    status directory in their environment: before they report anything)."""
    wanted = ("%s=%s" % (STATUS_DIR_VAR, directory)).encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/environ" % entry, "rb") as environ:
                names = environ.read().split(b"\0")
        except OSError:
            continue   # gone, or not ours to read
        if wanted not in names:
            continue
        for name in names:
            if name.startswith((b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=")):
                found[int(name.split(b"=", 1)[1])] = int(entry)
                break
    return found


def _dead_local_ranks(status, directory, seen, nranks, one_host):
    """Ranks of this host that reported no end and whose process is gone: seen alive
    before (``seen``, updated here) or reported started; with ``one_host``, any rank."""
    here = socket.gethostname()
    alive = _job_ranks(directory)
    seen.update(alive)
    candidates = set(seen) | {r for r, (host, _) in status.started.items() if host == here}
    if one_host and seen:   # (not before mpiexec has started any rank)
        candidates = set(range(nranks))
    return sorted(r for r in candidates
                  if r not in alive and r not in status.exited and r not in status.failed)


def _end_job(job, status, directory):
    """End mpiexec and every rank of the job still running on this host."""
    for pid in _job_ranks(directory).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass   # gone already
    job.proc.terminate()
    try:
        job.proc.wait(timeout=END_GRACE_S)
    except subprocess.TimeoutExpired:
        job.proc.kill()


def _run_fault_tolerant_once(cmd, env, nranks, status_parent, one_host=False):
    """One launch under ``--ft``: (exit status, its line, outcome): outcome is None, "failed
    to start" (transient launcher failure) or the ranks that died before MPI started."""
    with status_directory(status_parent) as directory:
        job = _Mpiexec(cmd, {**env, STATUS_DIR_VAR: directory})
        proc = job.proc
        settled, terminated, dying, seen = None, False, None, {}
        try:
            while proc.poll() is None:
                time.sleep(POLL_S)
                if settled is None:
                    status = read_status(directory)
                    if not status.ready and not status.exited:
                        dead = _dead_local_ranks(status, directory, seen, nranks, one_host)
                        if not dead:
                            dying = None
                        elif dying is None:
                            dying = time.monotonic()
                        elif time.monotonic() - dying > INIT_DEATH_GRACE_S:
                            _end_job(job, status, directory)
                            job.wait()
                            return proc.returncode, None, dead
                    accounted = set(status.exited) | set(status.failed) | status.lost
                    if status.exited and accounted >= set(range(nranks)):
                        settled = time.monotonic()
                        ended = _end_excluded_ranks(status, directory)
                        if ended:
                            print("matexrun: ended rank(s) %s, excluded by the survivors but "
                                  "still running (hung)" % ", ".join(map(str, ended)),
                                  file=sys.stderr, flush=True)
                elif time.monotonic() - settled > END_GRACE_S:
                    if terminated:
                        proc.kill()
                    else:
                        print("matexrun: every rank finished or was excluded %.0f s ago; "
                              "ending mpiexec" % END_GRACE_S, file=sys.stderr, flush=True)
                        proc.terminate()
                        terminated, settled = True, time.monotonic() - END_GRACE_S + 10
        except BaseException:
            proc.kill()
            job.wait()
            raise
        job.wait()
        status = read_status(directory)
        code, line = job_exit_status(status, nranks, proc.returncode)
        return code, line, ("failed to start" if job.failed_to_start() and not status.started
                            else None)


def run_with_restarts(cmd: Sequence[str], nranks: int, env: dict[str, str],
                      restarts: int,
                      run: Callable[[list[str], dict[str, str], int], int] | None = None,
                      replan: Callable[[list[str], int], tuple[list[str], int] | None]
                      | None = None) -> int:
    """Run ``cmd``; after a failure rerun it up to ``restarts`` times, from the last checkpoint.

    ``run(cmd, env, nranks)`` makes one launch and returns its exit status
    (default: plain mpiexec; ``matexrun --ft --elastic`` passes
    ``run_fault_tolerant``). ``replan(cmd, nranks)`` says where the next launch
    goes: a new ``(cmd, nranks)``, or None to stop (default: the same command
    on one rank fewer, ``--restart``; ``--elastic`` asks the host discovery
    script). The ranks resume from what they wrote to ``MATEX_CHECKPOINT_DIR``.
    """
    def plain(c, e, n):
        return _call(c, e)

    run = run or plain
    replan = replan or _one_rank_fewer
    code = run(list(cmd), env, nranks)
    for attempt in range(restarts):
        if code == 0:
            break
        planned = replan(list(cmd), nranks)
        if planned is None:
            break
        cmd, nranks = planned
        env["MATEX_INJECT_FAULT"] = ""   # injected faults fire in the first run only
        print("matexrun: the job failed (exit %d); restarting from the last checkpoint in %s "
              "on %d rank(s) (restart %d of %d)" % (code, env["MATEX_CHECKPOINT_DIR"], nranks,
                                                   attempt + 1, restarts),
              file=sys.stderr, flush=True)
        code = run(list(cmd), env, nranks)
    return code


def _one_rank_fewer(cmd, nranks):
    """``--restart``'s plan: the same command on one rank fewer (None when one is left)."""
    if nranks == 1:
        return None
    cmd[cmd.index("-n") + 1] = str(nranks - 1)
    return cmd, nranks - 1


DISCOVERY_TIMEOUT_S = 60.0
DISCOVERY_POLL_S = 1.0   # between two runs of the discovery script while waiting for hosts


def discover_hosts(script: str, slots: int | None = None) -> list[tuple[str, int]]:
    """The hosts a discovery script names now (horovodrun's ``--host-discovery-script``).

    The script prints one host per line, ``HOST`` or ``HOST:SLOTS``; a host
    without slots gets ``slots`` (default 1). Blank lines and ``#`` comments
    are skipped. Raises ``HostError`` when the script fails, times out
    (``DISCOVERY_TIMEOUT_S``) or prints a line that is not a host.
    """
    from matex.launcher.hosts import HostError, parse_hosts

    try:
        proc = subprocess.run([script], capture_output=True, text=True,
                              timeout=DISCOVERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HostError("host discovery script %s failed: %s" % (script, exc)) from exc
    if proc.returncode != 0:
        raise HostError("host discovery script %s exited with status %d: %s"
                        % (script, proc.returncode, proc.stderr.strip()[-500:]))
    hosts: dict[str, int] = {}
    for line in proc.stdout.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        for name, count in parse_hosts(line):
            hosts[name] = count if count is not None else (slots or 1)
    return list(hosts.items())
