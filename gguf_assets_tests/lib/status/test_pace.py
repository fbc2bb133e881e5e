"""`status` shows the measured speed and ETA of the precompute from the first finished shard on, and of training
from its first log step on (lib/status/pace.py, on a copy of the suite's finished project)."""

import re
import shutil
import subprocess

import pytest

from gguf_assets.lib.core import atomic, liveness
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.project.layout import SESSION_FILE
from gguf_assets.lib.project.settings import load_settings
from gguf_assets.lib.status.pace import precompute_pace, training_pace
from gguf_assets.lib.training.training_run import SESSION_RUNNING, adapter_fingerprint


@pytest.mark.slow  # the suite's finished project (one pipeline run, shared), copied
def test_status_of_a_project_part_done_shows_the_measured_rate_and_eta(finished_project, tmp_path):
    from conftest import CLI, cli_env, copy_project

    paths = copy_project(finished_project[0], tmp_path / "project")
    settings = load_settings(paths.root)
    # Train shards 00002..00004 and the val shard are left to do; 00000 and 00001 are done.
    for folder in [*(paths.root / "shards/train").glob("0000[234]"), paths.root / "shards/val/00000"]:
        shutil.rmtree(folder)
    measured = precompute_pace(paths, settings)
    assert measured is not None and measured.done == 2 * settings.precompute.shard_size
    assert measured.rate > 0 and 0 < measured.seconds_left < 3600
    shown = subprocess.run([*CLI, "status", str(paths.root)], env=cli_env(), capture_output=True, text=True,
                           timeout=120, check=True).stdout
    line = re.search(r"precompute: (\d+)/(\d+) prompts, ([\d.]+) prompts/s measured, ETA (\S+)", shown)
    assert line is not None, shown
    assert int(line[1]) == measured.done and int(line[2]) == measured.total
    assert re.fullmatch(r"(\d+m)?\d+s", line[4]), line[4]  # a time, not "?"

    # Training: the trainer records its step and steps/s in its session at each log step (12 of 40 at 2 steps/s).
    run_dir = paths.checkpoints_dir(adapter_fingerprint(paths, settings, load_manifest(paths)))
    atomic.write_json(run_dir / SESSION_FILE, {"state": SESSION_RUNNING, "step": 12, "steps_per_s": 2.0})
    measured = training_pace(paths, settings)
    assert (measured.done, measured.total, measured.seconds_left) == (12, 40, 14.0)
    assert measured.text() == "training: 12/40 steps, 2.00 steps/s measured, ETA 14s"

    # A kill -9 leaves the session saying "running". Once its process is gone, the next run resumes from the newest
    # checkpoint: that step is told, at the rate of the last log step it holds, not the step the dead process had
    # reached (`status` said "trained to step 250" above "training: 450/1100 steps, ETA 29s").
    gone = subprocess.Popen(["true"])
    gone.wait()
    atomic.write_json(run_dir / SESSION_FILE, {
        "state": SESSION_RUNNING, "step": 12, "steps_per_s": 2.0, "pid": gone.pid, "pid_started": "gone",
        "boot_id": liveness.boot_id(), "machine": liveness.machine_id()})
    assert training_pace(paths, settings) is None  # the run had finished before: nothing is left to train
    shutil.rmtree(run_dir / "final")  # as if cut off after its first checkpoint
    checkpoints = sorted(d.name for d in run_dir.glob("step-*"))
    for name in checkpoints[1:]:
        shutil.rmtree(run_dir / name)
    measured = training_pace(paths, settings)
    assert measured is not None and measured.done == int(checkpoints[0].removeprefix("step-")) < 40, checkpoints
    assert measured.rate > 0 and measured.rate != 2.0
