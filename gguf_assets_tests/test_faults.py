"""Fault injection: SIGKILL at random moments of a whole pipeline run, and a disk that fills up.

After each fault the rerun finishes and its shards, weights and GGUF are byte-identical to an
uninterrupted run. The kill moments are drawn at random (the seed is printed, and can be
fixed with GGUF_FAULT_SEED to reproduce a failure).
"""

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gguf_assets.lib import atomic
from gguf_assets.runner import PipelineFailed, run_pipeline

CLI = [sys.executable, "-m", "gguf_assets.cli"]
SETTINGS = dict(steps=40, mock_teacher=True, training={"checkpoint_every": 5, "validate_every": 20, "log_every": 10})
KILLS = 3


def _outputs(root: Path) -> dict[str, bytes]:
    """Everything that must not depend on faults: shard halves, final weights, the GGUF."""
    files = sorted(root.glob("shards/*/*/*.safetensors")) + sorted(root.glob("checkpoints/*/final/adapter.safetensors"))
    files += sorted(root.glob("output/*.gguf"))
    return {str(f.relative_to(root)): f.read_bytes() for f in files}


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "GGUF_ASSETS_PROJECT")}


def test_sigkill_at_random_moments_then_auto_resume_gives_identical_outputs(make_project):
    reference = make_project(**SETTINGS)
    start = time.perf_counter()
    subprocess.run([*CLI, "run", str(reference.root)], env=_env(), check=True, capture_output=True, timeout=600)
    duration = time.perf_counter() - start
    expected = _outputs(reference.root)
    assert len(expected) == 5 * 2 + 2

    seed = int(os.environ.get("GGUF_FAULT_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    table = []
    for _ in range(KILLS):
        project = make_project(**SETTINGS)
        delay = rng.uniform(0.5, duration * 0.9)
        proc = subprocess.Popen([*CLI, "run", str(project.root)], env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(delay)
        finished_first = proc.poll() is not None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had already finished: that point tests a plain rerun
            pass
        proc.wait()
        done = sorted({p.parts[len(project.root.parts)] for p in project.root.glob("*/**/*.json")})
        resumed = subprocess.run([*CLI, "--auto-resume", str(project.root), "--no-daemon"], env=_env(),
                                 capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, f"seed {seed}, kill at {delay:.1f}s: {resumed.stdout}\n{resumed.stderr}"
        identical = _outputs(project.root) == expected
        table.append((round(delay, 1), finished_first, done, identical))
        assert not list(project.root.rglob(f"{atomic.TEMP_PREFIX}*")), "temp files left after the rerun"
        assert identical, f"seed {seed}: outputs differ after a kill at {delay:.1f}s"
    print(f"\nfault seed {seed}; uninterrupted run {duration:.1f}s; (kill at s, had finished, stages begun, identical):")
    for row in table:
        print("  ", row)


def test_disk_full_during_shard_write_fails_clearly_then_rerun_is_identical(make_project, monkeypatch):
    reference = make_project(**SETTINGS)
    run_pipeline(reference, echo=lambda _: None)
    expected = _outputs(reference.root)

    project = make_project(**SETTINGS)
    from gguf_assets.lib import shards

    real_save, calls = shards.save_file, {"n": 0}

    def save_until_full(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 3:  # the second shard's teacher half: the disk is full
            Path(filename).write_bytes(b"\0" * 100)  # a torn partial write, as a full disk leaves
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(shards, "save_file", save_until_full)
    with pytest.raises(PipelineFailed, match="No space left on device"):
        run_pipeline(project, echo=lambda _: None)
    assert not list(project.root.rglob(f"{atomic.TEMP_PREFIX}*")), "a torn temp file was left behind"

    monkeypatch.setattr(shards, "save_file", real_save)
    run_pipeline(project, echo=lambda _: None)
    assert _outputs(project.root) == expected
