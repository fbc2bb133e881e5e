"""The benchmark scripts run, at their small sizes, and their own pass/fail criteria hold."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_status_reads_under_one_percent_of_the_shard_bytes():
    """bench_status.py --quick: status reads records, never shard data."""
    out = _run("bench_status.py", "--quick")
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [20, 80]
    assert all(float(r[3].rstrip("%")) < 1.0 for r in rows), out


@pytest.mark.slow
def test_gpu_check_passes_on_cpu_at_its_tiny_size():
    """gpu_check.py --tiny: the checks that need CUDA say SKIP, every other one passes."""
    out = _run("gpu_check.py", "--tiny")
    status = {line[6:32].strip(): line[:4] for line in out.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")}
    assert "FAIL" not in status.values(), out
    for name in ("environment", "precompute sequential", "bf16 student states", "training 64 x 1",
                 "GGUF agrees with torch"):
        assert status[name] == "PASS", out
    if "cuda" not in out.splitlines()[0]:
        assert status["precompute balanced"] == status["out-of-memory auto-lower"] == "SKIP", out
