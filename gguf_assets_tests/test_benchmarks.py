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


@pytest.mark.slow  # about 10 s: builds shards and times status against hashing them
def test_status_reads_under_one_percent_of_the_shard_bytes():
    """bench_status.py --quick: status reads records, never shard data."""
    out = _run("bench_status.py", "--quick")
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [20, 80]
    assert all(float(r[3].rstrip("%")) < 1.0 for r in rows), out


@pytest.mark.slow  # about 25 s: two pairs built and trained
def test_quality_benchmark_prints_its_table_and_applies_its_own_rule():
    """bench_quality.py --quick: every variant on both pairs, deltas against the same run's current
    recipe, and a verdict line that follows from the table by the adoption rule."""
    out = _run("bench_quality.py", "--quick")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["pair", "variant"])
    rows = []
    for line in lines[header + 1:]:
        parts = line.split()
        if len(parts) != 7 or parts[0] not in ("A", "B"):
            break
        pair, variant, steps, cpu, ratio, cosine, delta = parts
        rows.append({"pair": pair, "variant": variant, "steps": int(steps), "cpu": float(cpu), "ratio": float(ratio),
                     "cosine": float(cosine), "delta": float(delta)})
    variants = ["current", "current-seed1", "ema-0.99", "ema-0.998", "mix-all-layers", "lr-width-scaled", "w128xd1",
                "w64xd2", "w32xd1"]
    assert [(r["pair"], r["variant"]) for r in rows] == [(p, v) for p in "AB" for v in variants], out
    base = {r["pair"]: r for r in rows if r["variant"] == "current"}
    for r in rows:
        assert r["steps"] >= 1 and r["cpu"] > 0 and -1.0 <= r["cosine"] <= 1.0, r
        assert abs(r["delta"] - (r["cosine"] - base[r["pair"]]["cosine"])) <= 2e-4, r
        cpu, b = r["cpu"], base[r["pair"]]["cpu"]  # both printed to 0.01 s, the ratio to 0.01
        assert (cpu - 0.005) / (b + 0.005) - 0.005 <= r["ratio"] <= (cpu + 0.005) / (b - 0.005) + 0.005, r
    assert all(base[p]["delta"] == 0.0 and base[p]["ratio"] == 1.0 for p in "AB")
    # The verdict: a variant wins only with >= 0.01 on both pairs at (nearly) equal CPU time.
    # (Within printing precision of a threshold either verdict is right.)
    def winners(margin: float, tolerance: float) -> set[str]:
        return {v for v in variants[2:]
                if all(r["delta"] >= margin and r["ratio"] <= tolerance for r in rows if r["variant"] == v)}

    verdict = lines[header + 1 + len(rows)]
    if verdict.startswith("winner: "):
        assert verdict.split()[1] in winners(0.01 - 5e-5, 1.10 + 5e-3), out
    else:
        assert verdict == "no variant wins by >= 0.01 on both pairs; defaults unchanged", out
        assert not winners(0.01 + 5e-5, 1.10 - 5e-3), out


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
