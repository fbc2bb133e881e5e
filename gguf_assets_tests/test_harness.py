"""The test harness itself: what scripts/test.sh relies on from pytest and pytest-xdist."""

import subprocess
import sys


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
