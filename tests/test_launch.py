"""`python -m matex` and `matexrun`: scripts behave as when run alone; failures end the job."""

import os
import subprocess
import sys
import textwrap

import mpitools

SCRIPT = textwrap.dedent("""
    import sys
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    print("rank", rank, "name", __name__, "argv", sys.argv[1:], flush=True)
    if "--fail-on" in sys.argv and rank == int(sys.argv[-1]):
        raise RuntimeError("boom on rank %d" % rank)
    if "--fail-on" in sys.argv:
        MPI.COMM_WORLD.Barrier()   # would hang forever if the job were not ended
    sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
""")


def _script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    return str(path)


def test_argv_name_and_exit_code_are_preserved(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "matex", _script(tmp_path), "3", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "name __main__ argv ['3', 'x']" in proc.stdout


def test_exit_code_of_every_rank_is_the_job_exit_code_under_mpiexec(tmp_path):
    proc = mpitools.run_mpi(2, [sys.executable, "-m", "matex", _script(tmp_path), "3"],
                            timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "rank 0 name __main__ argv ['3']" in proc.stdout


def test_matexrun_ft_verbose_prints_the_ulfm_flags_and_runs(tmp_path):
    matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
    proc = subprocess.run([matexrun, "--ft", "-v", "--all-ranks", "-n", "2", _script(tmp_path),
                           "0"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    command = [l for l in proc.stderr.splitlines() if l.startswith("matexrun: ")]
    assert len(command) == 1, proc.stderr[-3000:]
    assert "--with-ft ulfm" in command[0] and "-n 2" in command[0]
    assert command[0].endswith("-m matex --all-ranks %s 0" % _script(tmp_path))
    lines = sorted(proc.stdout.splitlines())
    assert len(lines) == 2, proc.stdout
    assert lines[0].startswith("[rank 1] rank 1 ") and lines[1].startswith("rank 0 ")


def test_exception_on_one_rank_ends_the_whole_job_with_its_traceback(tmp_path):
    proc = mpitools.run_mpi(2, [sys.executable, "-m", "matex", _script(tmp_path), "go",
                                "--fail-on", "1"], timeout=120)
    assert proc.returncode != 0
    assert "[rank 1]" in proc.stderr and "RuntimeError: boom on rank 1" in proc.stderr


def test_matexrun_prints_the_command_and_runs_the_script(tmp_path):
    matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
    quiet = subprocess.run([matexrun, "-n", "2", _script(tmp_path), "0"], capture_output=True,
                           text=True, timeout=180)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert [l.split()[1] for l in quiet.stdout.splitlines()] == ["0"]   # rank 1 is quiet
    proc = subprocess.run([matexrun, "-v", "--all-ranks", "-n", "3", _script(tmp_path), "0"],
                          capture_output=True, text=True, timeout=180,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("OMPI_ALLOW")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "matexrun: " in proc.stderr and "-n 3" in proc.stderr
    assert "--oversubscribe" in proc.stderr or (os.cpu_count() or 1) >= 3
    lines = sorted(proc.stdout.splitlines())
    assert lines[0].startswith("[rank 1] rank 1 ") and lines[1].startswith("[rank 2] rank 2 ")
    assert lines[2].startswith("rank 0 ")


def test_matexrun_rejects_a_missing_script():
    matexrun = os.path.join(os.path.dirname(sys.executable), "matexrun")
    proc = subprocess.run([matexrun, "-n", "2", "/no/such/script.py"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "no such script: /no/such/script.py" in proc.stderr


def test_the_launcher_package_reexports_its_public_functions():
    import matex.launcher as launcher
    from matex.launcher import cli, hosts, mpiexec, supervise

    for name in launcher.__all__:
        assert getattr(launcher, name) is getattr(
            next(m for m in (cli, hosts, mpiexec, supervise) if hasattr(m, name)), name)
    assert launcher.main is cli.main and launcher.parse_hosts("a:2") == [("a", 2)]
    proc = subprocess.run([sys.executable, "-c", "import matex.launch"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "No module named 'matex.launch'" in proc.stderr


def test_python_m_matex_launcher_is_matexrun(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "matex.launcher", "--dry-run", "--ft", "-n",
                           "2", _script(tmp_path), "0"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    command = proc.stderr.strip().splitlines()[-1]
    assert "--with-ft ulfm" in command and command.endswith("%s 0" % _script(tmp_path))
