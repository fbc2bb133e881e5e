"""The test harness itself: what scripts/test.sh relies on from pytest and pytest-xdist."""

import os
import re
import subprocess
import sys
from pathlib import Path

SUITE_CPU = Path(__file__).parents[1] / "scripts" / "suite_cpu.py"


def test_loadgroup_runs_a_group_on_one_worker(tmp_path):
    """scripts/test.sh's --dist loadgroup keeps a module's xdist_group on one worker, which builds its module
    fixture (a `gguf-trainer ui`, a studio, a pipeline) once. pytest 9.2 with xdist 3.8 silently stopped
    grouping (pytest-dev/pytest-xdist#1386): every worker then built them again. pyproject.toml pins pytest
    below 9.2; this says so if an upgrade brings it back."""
    (tmp_path / "test_grouped.py").write_text(
        "import os\nimport pytest\n\npytestmark = pytest.mark.xdist_group('together')\n\n\n"
        "@pytest.mark.parametrize('i', range(6))\ndef test_where(i):\n"
        "    print('WORKER', os.environ['PYTEST_XDIST_WORKER'])\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                           "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = {line.split()[0] for line in done.stdout.splitlines() if "PASSED" in line and line.startswith("[gw")}
    assert len(workers) == 1, f"the group ran on {sorted(workers)}: --dist loadgroup is not grouping\n{done.stdout}"


def test_suite_cpu_sums_each_kind_of_process_and_returns_the_command_s_status(tmp_path):
    """scripts/suite_cpu.py (where the suite's CPU goes, #34): a parent and its child, each spinning a known CPU time,
    are read as two processes of their script's kind with about their sum; the machine's own figure covers them; the
    command's exit status comes back. (The script has a name of its own: the tool reads every process on the machine,
    and under the suite other tests start `python -c` processes of their own at the same time. The child's command
    line holds a newline and a tab, as many a test's `python -c` does: --raw keeps one line of four fields each.)"""
    workload = tmp_path / "suite_cpu_spin_workload.py"
    workload.write_text(
        "import subprocess, sys, time\n\n\ndef spin(seconds):\n    t = time.process_time()\n"
        "    while time.process_time() - t < seconds:\n        pass\n\n\n"
        "if sys.argv[1:2] == ['child']:\n    spin(0.8)\n    sys.exit(0)\n"
        "spin(0.2)\nchild = subprocess.Popen([sys.executable, __file__, 'child', 'one\\ntwo\\tthree'])\nspin(0.6)\n"
        "child.wait()\nsys.exit(3)\n")
    raw = tmp_path / "processes.tsv"
    done = subprocess.run([sys.executable, str(SUITE_CPU), "--every", "0.05", "--raw", str(raw), "--",
                           sys.executable, str(workload)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    rows = {m[5]: (float(m[1]), int(m[3])) for line in done.stderr.splitlines()
            if (m := re.fullmatch(r" *([\d.]+) +([\d.]+)% +(\d+) +([\d.]+)  (.+)", line))}
    cpu_s, count = rows[f"{Path(sys.executable).name} {workload.name}"]
    # 1.6 s spun, plus starting Python; a process's last reading may come before its end (by 0.05 s on an idle
    # machine, more on a busy one, where the reader waits for a core too)
    assert count == 2 and 1.0 <= cpu_s <= 2.5, done.stderr
    # --raw: one line per process (CPU s, kind, test, command line), the table's rows summed from them
    lines = [line.split("\t") for line in raw.read_text().splitlines()]
    assert all(len(fields) == 4 for fields in lines), [fields for fields in lines if len(fields) != 4]
    ours = [fields for fields in lines if fields[1] == f"{Path(sys.executable).name} {workload.name}"]
    assert sorted(row[3].split(workload.name)[1] for row in ours) == ["", " child one two three"], ours
    assert abs(sum(float(row[0]) for row in ours) - cpu_s) <= 0.1, (ours, cpu_s)
    busy = float(done.stderr.split("the machine busy ")[1].split()[0])
    assert busy >= cpu_s - 0.5, done.stderr  # the machine's count (to the second) holds what the readings saw
    # The idle time, minute by minute: a command of a few seconds has one minute, holding all of it.
    idle = float(done.stderr.split("idle ")[1].split()[0])
    minutes = done.stderr.split("idle CPU s in each minute: ")[1].splitlines()[0].split()
    assert len(minutes) == 1 and abs(float(minutes[0]) - idle) <= 1, done.stderr


def _suite_cpu_module():
    """scripts/suite_cpu.py as a module (it is a script, not a package's module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_cpu", SUITE_CPU)
    suite_cpu = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = suite_cpu  # where its dataclass looks itself up
    try:
        spec.loader.exec_module(suite_cpu)
    finally:
        del sys.modules[spec.name]
    return suite_cpu


def test_idle_by_minute_puts_each_readings_idle_time_in_its_minute():
    suite_cpu = _suite_cpu_module()
    readings = [(0.0, 100.0), (30.0, 103.0), (59.0, 110.0), (61.0, 110.5), (150.0, 111.0), (151.0, 119.0)]
    assert suite_cpu.idle_by_minute(readings) == [10.5, 0.5, 8.0]


def test_suite_cpu_counts_a_warm_fork_to_the_test_that_asked_for_it(tmp_path):
    """A process the warm loader forks shows the loader's command line and environment in /proc, so no test there:
    suite_cpu.py reads its test from the fork log (warm_runs.py's _note_fork), by pid and start time, so that a
    reused pid is not taken for it."""
    suite_cpu = _suite_cpu_module()
    seen = {("41", "900"): suite_cpu.Seen(3.0, "python warm_runs.py SOCKET", "-"),
            ("42", "950"): suite_cpu.Seen(1.0, "python warm_runs.py SOCKET", "-"),
            ("43", "990"): suite_cpu.Seen(2.0, "python x.py", "t.py::cold")}
    log = tmp_path / "forks.tsv"
    log.write_text("41\t900\tt.py::test_a\n42\t949\tt.py::test_b\n")
    suite_cpu.attribute_forks(seen, str(log))
    assert [s.test for s in seen.values()] == ["t.py::test_a", "-", "t.py::cold"]
    suite_cpu.attribute_forks(seen, str(tmp_path / "none.tsv"))  # no fork was noted: no file, nothing changes
    assert "t.py::test_a" in suite_cpu.report(seen, 1.0, 6.0, 0.0, tests=5)


def test_a_warm_script_starts_as_a_cold_one_and_ends_with_its_status(tmp_path, monkeypatch):
    """warm_runs.py's scripts (the benchmarks' tests run them so): forked by the loader, a script sees what
    `python SCRIPT ARGS` sees (its name "__main__", __file__, sys.argv, its folder first on sys.path, so a module
    beside it imports, the folder it runs in, stdout's buffering), writes stdout and stderr apart, and ends with the
    cold run's status, from sys.exit or from an exception it does not catch (whose last line it prints), after its
    threads and atexit functions, as Python ends (the fork skips the teardown of what the loader loaded). The fork is
    noted for scripts/suite_cpu.py under the test that asked; an environment the loader's libraries would read
    differently starts the script cold."""
    from warm_runs import FORK_LOG_ENV, WarmRun, script_popen, script_run

    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "beside.py").write_text("WHERE = 'beside the script'\n")
    script = folder / "probe.py"
    script.write_text(
        "import atexit\nimport os\nimport sys\nimport threading\nimport time\n\nfrom beside import WHERE\n\n"
        "print(__name__, __file__, sys.argv, sys.path[0], WHERE, sys.stdout.line_buffering, os.getcwd())\n"
        "print('to stderr', file=sys.stderr)\n"
        "atexit.register(print, 'atexit, after the thread')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('a thread ends after the script'))).start()\n"
        "if sys.argv[1] == 'raise':\n    raise RuntimeError('the script s own error')\n"
        "sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])\n")
    env = dict(os.environ)
    for args in (["3"], ["0"], ["raise"], ["a message for stderr"]):
        warm = script_run(script, args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        cold = subprocess.run([sys.executable, str(script), *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert cold.stdout.startswith(f"__main__ {script} ") and str(folder) in cold.stdout, cold.stdout
        assert cold.stdout.endswith("a thread ends after the script\natexit, after the thread\n"), cold.stdout
        assert (warm.returncode, warm.stdout) == (cold.returncode, cold.stdout), (warm, cold)
        assert warm.stderr.splitlines()[0] == "to stderr" and warm.stderr.splitlines()[-1:] == \
            cold.stderr.splitlines()[-1:], (warm.stderr, cold.stderr)

    log = tmp_path / "forks.tsv"
    monkeypatch.setenv(FORK_LOG_ENV, str(log))
    forked = script_popen(script, ["0"], env=env, stdout=subprocess.DEVNULL)
    forked.wait(timeout=120)
    test = os.environ["PYTEST_CURRENT_TEST"].split(" ")[0]
    assert isinstance(forked, WarmRun) and log.read_text().split("\t")[::2] == [str(forked.pid), f"{test}\n"]

    cold = script_popen(script, ["0"], env={**env, "HF_HOME": str(tmp_path / "hf-home")}, stdout=subprocess.DEVNULL)
    assert not isinstance(cold, WarmRun) and cold.args == [sys.executable, str(script), "0"]
    assert cold.wait(timeout=120) == 0


def test_suite_cpu_names_the_suites_processes_by_kind():
    suite_cpu = _suite_cpu_module()
    kinds = {
        "/w/.venv/bin/python -m gguf_assets.cli run /tmp/p --workers 2": "gguf-trainer run",
        "/w/.venv/bin/python /w/.venv/bin/gguf-trainer status /tmp/p": "gguf-trainer status",
        "/w/.venv/bin/python /w/.venv/bin/dagster api grpc --lazy-load-user-code --port 0": "Dagster code server",
        "/w/.venv/bin/python -m gguf_assets.lib.materials.hub": "hub child",
        "/w/.venv/bin/python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)":
            "multiprocessing worker",
        "/w/.venv/bin/python /w/benchmarks/bench_quality.py --quick": "benchmark bench_quality.py",
        "/usr/lib/chromium/chromium --type=renderer": "chromium",
        "/usr/lib/postgresql/15/bin/postgres -D /tmp/pg": "postgres",
        "/w/.venv/bin/python -c import sys;exec(eval(sys.stdin.readline()))": "pytest-xdist worker",
        "": "(no command line: a kernel thread, or gone before its first reading)",
        "/usr/bin/bash scripts/test.sh -q": "bash",
        "/w/.venv/bin/python /tmp/x/spin.py child": "python spin.py",
        "/w/.venv/bin/python -m http.server 0": "python -m http.server",
    }
    assert {command: suite_cpu.process_kind(command) for command in kinds} == kinds


def test_a_warm_run_says_what_a_cold_run_says_and_dies_as_a_process_of_its_own_group(make_project):
    """warm_runs.py (#34): a `run` forked by the test process's loader is the run process itself, so its refusal of
    a bad project.yaml is the cold run's, word for word and with its status; it leads a process group of its own and
    its kill -9 comes back as the status; and a request whose environment a loaded library would read differently
    (HF_HOME here) starts the command cold."""
    import signal

    from conftest import CLI, FAULT_SETTINGS, cli_env
    from warm_runs import WarmRun, trainer_popen, trainer_run

    paths = make_project(**FAULT_SETTINGS)
    good = (paths.root / "project.yaml").read_text()
    (paths.root / "project.yaml").write_text(good.replace("steps: 40", "steps: -5"))
    warm = trainer_run(["run", str(paths.root)], env=cli_env(), capture_output=True, text=True, timeout=120)
    cold = subprocess.run([*CLI, "run", str(paths.root)], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert "steps" in warm.stderr and warm.returncode == cold.returncode == 2, warm.stderr
    assert warm.stderr == cold.stderr and isinstance(warm.args, list) and warm.args[0] == "run"

    (paths.root / "project.yaml").write_text(good)
    run = trainer_popen(["run", str(paths.root)], env=cli_env(), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert isinstance(run, WarmRun) and os.getpgid(run.pid) == run.pid and run.poll() is None
    finally:
        os.killpg(run.pid, signal.SIGKILL)
    out, _ = run.communicate(timeout=60)
    assert run.returncode == -signal.SIGKILL, out

    hf_home = cli_env(HF_HOME=str(paths.root / "hf-home"))
    refused = trainer_popen(["run", str(paths.root / "no-such-folder")], env=hf_home, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, stderr = refused.communicate(timeout=120)
    assert not isinstance(refused, WarmRun) and refused.args[:3] == CLI and refused.returncode == 2, stderr
