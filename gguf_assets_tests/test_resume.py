"""Survive a kill -9: the cut-off run is marked failed, a second pipeline is refused while one
runs, and --auto-resume finishes with weights bit-identical to an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
from dagster._core.instance.ref import InstanceRef

from gguf_assets.lib import atomic
from gguf_assets.runner import run_pipeline

CLI = [sys.executable, "-m", "gguf_assets.cli"]
SETTINGS = dict(steps=120, mock_teacher=True, training={"checkpoint_every": 10, "validate_every": 60, "log_every": 10})


def _final_weights(root: Path) -> bytes:
    run_dir = root / atomic.read_json(root / "checkpoints" / "final.json")["run_dir"]
    return (run_dir / "final" / "adapter.safetensors").read_bytes()


def _wait_for(predicate, *, timeout: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}: {proc.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_kill9_during_training_then_auto_resume_is_bit_identical(make_project, tmp_path):
    killed = make_project(**SETTINGS)
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "GGUF_ASSETS_PROJECT")}
    proc = subprocess.Popen([*CLI, "run", str(killed.root)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        _wait_for(lambda: any(killed.root.glob("checkpoints/*/step-00000020")), timeout=240,
                  what="the second checkpoint", proc=proc)
        # One pipeline per folder: a second one is refused and names the holder.
        second = subprocess.run([*CLI, "run", str(killed.root)], capture_output=True, text=True, env=env, timeout=120)
        assert second.returncode != 0
        assert "in use by another pipeline" in second.stderr and f"pid {proc.pid}" in second.stderr
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not any(killed.root.glob("checkpoints/*/final"))

    instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(killed.dagster_home)))
    started = instance.get_run_records(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
    assert len(started) == 1, "the killed run should be left STARTED, as Dagster leaves it"
    cut_off = started[0].dagster_run.run_id

    resumed = subprocess.run([*CLI, "--auto-resume", str(killed.root), "--no-daemon"], capture_output=True,
                             text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "marked 1 interrupted run(s) as failed" in resumed.stdout
    assert "resuming training run" in resumed.stdout + resumed.stderr
    run = instance.get_run_by_id(cut_off)
    assert run.status == dg.DagsterRunStatus.FAILURE

    clean = make_project(**SETTINGS)
    run_pipeline(clean, echo=lambda _: None)
    assert _final_weights(killed.root) == _final_weights(clean.root)
    for shard in sorted(clean.root.glob("shards/*/*/*.safetensors")):
        twin = killed.root / shard.relative_to(clean.root)
        assert twin.read_bytes() == shard.read_bytes(), shard
