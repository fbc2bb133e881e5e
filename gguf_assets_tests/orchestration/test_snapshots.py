"""`gguf-trainer snapshot` against a real run: taken while training runs (the trainer keeps its step and goes on),
the run's outputs byte-identical to an uninterrupted run's, and a kill -9 in the middle of a snapshot's export
leaving no GGUF behind and the project resumable."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import gguf
import pytest
from conftest import CLI, FAULT_SETTINGS, cli_env, pipeline_outputs
from warm_runs import trainer_popen, trainer_run

from gguf_assets.cli import main as trainer_main
from gguf_assets.lib.core import atomic, faults
from gguf_assets.lib.output.snapshots import read_snapshots

pytestmark = pytest.mark.slow  # a whole pipeline

STALL_AT, STALL_S = 20, 12  # the trainer waits at this step, so the snapshot lands mid-run whatever the machine's pace


def _metadata(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {field.name: field.contents() for field in reader.fields.values() if field.name.startswith("adapter.")}


def _run_held_at_the_stall(root: Path, tmp_path: Path) -> subprocess.Popen:
    """`gguf-trainer run` of ``root``, returned once its trainer is held at step STALL_AT (for STALL_S seconds)."""
    reached = tmp_path / "reached"
    reached.mkdir()
    env = cli_env(**{faults.ENV: f"train-step@{STALL_AT}:stall:{STALL_S}", faults.REACHED_ENV: str(reached)})
    run = trainer_popen(["run", str(root)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        start_new_session=True)
    deadline = time.monotonic() + 300
    while not list(reached.glob("train-step.*")):
        if run.poll() is not None or time.monotonic() > deadline:
            run.kill()
            raise AssertionError(f"training never reached the stall: {run.communicate()[0]}")
        time.sleep(0.1)
    return run


def test_a_snapshot_mid_run_changes_nothing_and_a_kill_during_one_leaves_no_gguf(shards_done_project, reference_run,
                                                                                 tmp_path, capsys):
    project = shards_done_project  # the reference run's project, before training: its run trains and exports
    run = _run_held_at_the_stall(project.root, tmp_path)
    try:
        # In this process (torch already imported): the request is written within the stall.
        capsys.readouterr()
        assert trainer_main(["snapshot", str(project.root)]) == 0
        said = capsys.readouterr().out
        output, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output
    assert f"snapshot of step {STALL_AT} of {FAULT_SETTINGS['steps']} (step{STALL_AT})" in said, said
    snapshot = project.root / "output" / f"demo-adapter-step{STALL_AT}.gguf"
    meta = _metadata(snapshot)
    assert (meta["adapter.training.steps"], meta["adapter.training.planned_steps"],
            meta["adapter.training.checkpoint"]) == (STALL_AT, FAULT_SETTINGS["steps"], f"step{STALL_AT}")
    assert f"snapshot: step {STALL_AT} kept" in output  # the trainer said so in the run's console, and went on

    # The run's outputs are byte-identical to an uninterrupted run's; the snapshot is the only file more.
    expected, _ = reference_run
    outputs = pipeline_outputs(project.root)
    assert {k: outputs[k] for k in expected} == expected
    assert sorted(set(outputs) - set(expected)) == [f"output/demo-adapter-step{STALL_AT}.gguf"]

    # kill -9 while a snapshot's GGUF is written: no GGUF of it is left, and the next one, and `run`, go on.
    run_dir = next(p.parent.parent for p in project.root.glob("checkpoints/*/final/meta.json"))
    killed = subprocess.run([*CLI, "snapshot", str(project.root), "--best", "--eval"], capture_output=True,
                            text=True, timeout=300, start_new_session=True,
                            env=cli_env(**{faults.ENV: "gguf-export:kill"}))
    assert killed.returncode < 0, killed.stderr
    best_step = atomic.read_json(run_dir / "best" / "meta.json")["step"]
    assert [e["step"] for e in read_snapshots(run_dir)] == [STALL_AT]
    assert not (project.root / "output" / f"demo-adapter-best-step{best_step}.gguf").exists()
    again = trainer_run(["snapshot", str(project.root), "--best", "--eval"], capture_output=True, text=True,
                        env=cli_env(), timeout=300)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    entry = next(e for e in read_snapshots(run_dir) if e["weights"] == "best")
    assert entry["file"] == f"output/demo-adapter-best-step{best_step}.gguf"
    assert entry["eval"]["val_centred_cosine"] == pytest.approx(entry["val_centred_cosine"], abs=0.02)
    assert not [p for p in (project.root / "output").iterdir() if p.name.startswith(atomic.TEMP_PREFIX)]
    status = trainer_run(["status", str(project.root)], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert status.returncode == 0 and "stale" not in status.stdout and "missing" not in status.stdout, status.stdout

    refused = trainer_run(["snapshot", str(project.root), "--step", "7"], capture_output=True, text=True,
                          env=cli_env(), timeout=120)
    assert refused.returncode == 2 and "step 7 is not kept" in refused.stderr and "Traceback" not in refused.stderr


def test_lowering_the_steps_mid_run_ends_it_now_with_an_exported_and_evaluated_gguf(shards_done_project, tmp_path):
    from gguf_assets.lib.project.layout import REPORT_JSON
    from gguf_assets.lib.project.settings import load_settings, replace, write_project_file

    project = shards_done_project
    run = _run_held_at_the_stall(project.root, tmp_path)
    try:
        lowered = STALL_AT // 2
        write_project_file(project.root, replace(load_settings(project.root), training={"steps": lowered}))
        output, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output
    assert f"training.steps was lowered to {lowered} while the run trained: it ends now, at step {STALL_AT}" in output
    # The run's closing lines tell the same story: the lowered count was followed, not left for the next run.
    assert f"(training.steps {FAULT_SETTINGS['steps']} → {lowered}): the run followed it" in output, output[-2000:]
    assert "finished under the settings it started with" not in output
    final = atomic.read_json(next(project.root.glob("checkpoints/*/final/meta.json")))
    assert (final["step"], final["planned_steps"], final["lowered_to"]) == (STALL_AT, FAULT_SETTINGS["steps"], lowered)
    settings = load_settings(project.root)
    report = atomic.read_json(project.output_dir(settings) / REPORT_JSON)
    assert report["val_centred_cosine"] is not None
    gguf_meta = _metadata(project.located(report["gguf_path"]))
    assert (gguf_meta["adapter.training.steps"], gguf_meta["adapter.training.planned_steps"]) == \
        (STALL_AT, FAULT_SETTINGS["steps"])
    # The lowered count stands for this run: nothing is left to do.
    status = trainer_run(["status", str(project.root)], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert status.returncode == 0 and "stale" not in status.stdout and "missing" not in status.stdout, status.stdout
