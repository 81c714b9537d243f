"""TensorFlow's C++ start-up notices kept off stderr (``python -m matex``, ``--check``).

Every rank prints them (absl's "All log messages before absl::InitializeLog()",
cpu_feature_guard's instruction-set note, oneDNN's notice). ``TF_CPP_MIN_LOG_LEVEL``
defaults to 1 (INFO hidden; warnings, errors and tracebacks stay), a value the user
set is kept; oneDNN's notice ignores that level on some CPUs, so while TensorFlow
loads its INFO lines are also filtered out of stderr, in a process of their own.
"""

import contextlib
import os
import re
import subprocess
import sys

QUIET_ENVIRONMENT = {
    # TensorFlow's C++ logging: 1 hides INFO (the start-up notices) and keeps
    # WARNING and ERROR. Read when TensorFlow loads; numerics are unaffected.
    "TF_CPP_MIN_LOG_LEVEL": "1",
}


# What TensorFlow's C++ start-up prints at INFO level: absl-format INFO lines
# ("I0000 00:00:1795507254.554787    2299 port.cc:153] oneDNN ..."), absl's
# banner before its first line, cpu_feature_guard's second line.
_STARTUP_NOTICE = re.compile(
    r"I\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w./-]+:\d+\] "
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    r"|To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler")


def quiet_tensorflow_startup():
    """Default the environment that silences TensorFlow's start-up notices (user values win).

    Where the level in force hides INFO, TensorFlow's import also runs with
    its INFO lines filtered out of stderr (see the module's docstring).
    """
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    try:
        hides_info = int(os.environ["TF_CPP_MIN_LOG_LEVEL"]) >= 1
    except ValueError:
        hides_info = False
    if hides_info:
        from matex import _transparent

        _transparent.around_import("tensorflow", without_startup_notices)


# The filter of _without_startup_notices, in its own process: it passes every other line
# on as it arrives, and outlives this process if TensorFlow's import aborts it (a CPU
# without AVX, a failed CUDA check), so the fatal line that says why is not lost.
_FILTER = (
    "import os, re, sys\n"
    "notice = re.compile(sys.argv[1])\n"
    "pending = b''\n"
    "while chunk := os.read(0, 1 << 16):\n"
    "    *lines, pending = (pending + chunk).split(b'\\n')\n"
    "    kept = b''.join(line + b'\\n' for line in lines\n"
    "                    if not notice.match(line.decode('utf-8', 'replace')))\n"
    "    if kept:\n"
    "        os.write(2, kept)\n"
    "if pending and not notice.match(pending.decode('utf-8', 'replace')):\n"
    "    os.write(2, pending)\n")


@contextlib.contextmanager
def without_startup_notices():
    """File descriptor 2 through a filter process while the block runs: TensorFlow's
    start-up notices are dropped, every other line passes at once (see ``_FILTER``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    try:
        filter_process = subprocess.Popen(
            [sys.executable, "-S", "-c", _FILTER, _STARTUP_NOTICE.pattern],
            stdin=read_end, stdout=subprocess.DEVNULL, stderr=saved, close_fds=True)
    except OSError:   # no filter: TensorFlow's notices stay
        for fd in (read_end, write_end, saved):
            os.close(fd)
        yield
        return
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)   # the pipe's last write end closes: the filter sees its end
        os.close(saved)
        filter_process.wait()
