"""`gguf-trainer snapshot` against a real run: taken while training runs (the trainer keeps its step and goes on),
the run's outputs byte-identical to an uninterrupted run's, and a kill -9 in the middle of a snapshot's export
leaving no GGUF behind and the project resumable."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import gguf
import pytest
from conftest import CLI, FAULT_SETTINGS, cli_env, copy_project, pipeline_outputs
from warm_runs import trainer_popen, trainer_run

from gguf_assets.cli import main as trainer_main
from gguf_assets.lib.core import atomic, faults
from gguf_assets.lib.output.snapshots import read_snapshots
from gguf_assets.lib.project.layout import REPORT_JSON

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
    # (A checkpoint's step: best at the last step writes no GGUF, it links the run's own.)
    killed = subprocess.run([*CLI, "snapshot", str(project.root), "--step", "35", "--eval"], capture_output=True,
                            text=True, timeout=300, start_new_session=True,
                            env=cli_env(**{faults.ENV: "gguf-export:kill"}))
    assert killed.returncode < 0, killed.stderr
    assert [e["step"] for e in read_snapshots(run_dir)] == [STALL_AT]
    assert not (project.root / "output" / "demo-adapter-step35.gguf").exists()
    again = trainer_run(["snapshot", str(project.root), "--step", "35", "--eval"], capture_output=True, text=True,
                        env=cli_env(), timeout=300)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    entry = next(e for e in read_snapshots(run_dir) if e["weights"] == "step35")
    assert entry["file"] == "output/demo-adapter-step35.gguf"
    assert entry["eval"]["val_centred_cosine"] == pytest.approx(entry["val_centred_cosine"], abs=0.02)
    assert not [p for p in (project.root / "output").iterdir() if p.name.startswith(atomic.TEMP_PREFIX)]
    status = trainer_run(["status", str(project.root)], capture_output=True, text=True, env=cli_env(), timeout=120)
    assert status.returncode == 0 and "stale" not in status.stdout and "missing" not in status.stdout, status.stdout

    refused = trainer_run(["snapshot", str(project.root), "--step", "7"], capture_output=True, text=True,
                          env=cli_env(), timeout=120)
    assert refused.returncode == 2 and "step 7 is not kept" in refused.stderr and "Traceback" not in refused.stderr


def test_lowering_the_steps_mid_run_ends_it_now_with_an_exported_and_evaluated_gguf(shards_done_project, tmp_path):
    import dagster as dg

    from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
    from gguf_assets.studio.app import ObservationFeed, project_view

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
    # #65: a lowered count's page, and `status`, say where it ended, not "finished: 10/10 steps".
    ended = f"ended at step {STALL_AT} (training.steps lowered to {lowered})"
    assert any(line.split() == ["adapter", "current", *ended.split()] for line in status.stdout.splitlines())
    page = project_view(project, ObservationFeed(dg.DagsterInstance.ephemeral()))
    assert page.training["text"] == ended and page.training["progress"]["percent"] == 100.0, page.training


def test_deleting_one_snapshot_of_a_step_leaves_the_other_and_best_at_the_end_is_the_runs_own_gguf(
        finished_project, tmp_path, capsys):
    """#65: with "best" and a plain snapshot both at the last step, `--delete` removes exactly the file it names;
    a step with two files is refused, naming both. Best at the last step is a hard link to the run's GGUF."""
    paths = copy_project(finished_project[0], tmp_path / "project")
    output = paths.root / "output"
    best, plain = output / "demo-adapter-best-step40.gguf", output / "demo-adapter-step40.gguf"
    for asked in (["--best"], ["--step", "40"]):
        assert trainer_main(["snapshot", str(paths.root), *asked]) == 0
    said = capsys.readouterr().out

    assert trainer_main(["snapshot", str(paths.root), "--delete", "40"]) == 2
    refused = capsys.readouterr().err
    assert "step 40 has 2 snapshot GGUFs: demo-adapter-best-step40.gguf, demo-adapter-step40.gguf" in refused
    assert best.is_file() and plain.is_file()
    assert "the same file as output/demo-adapter.gguf" in said, said
    assert best.samefile(output / "demo-adapter.gguf") and not plain.samefile(best)
    # The run's report scored those very bytes: the list, the studio and Compare give the best file that score.
    from gguf_assets.lib.project.settings import load_settings
    from gguf_assets.lib.runs import compare, listing
    from gguf_assets.studio.app import snapshots_view

    scored = atomic.read_json(output / REPORT_JSON)["val_centred_cosine"]
    assert trainer_main(["snapshot", str(paths.root), "--list"]) == 0
    best_line = capsys.readouterr().out.split("demo-adapter-best-step40.gguf:")[1].split("\n  demo")[0]
    assert best_line.startswith(" step 40 of 40 (best), val centred cosine") and f"GGUF eval {scored:.4f}" in best_line
    settings = load_settings(paths.root)
    rows = {row["name"]: row for row in snapshots_view(paths, settings)["rows"] if row.get("name")}
    assert rows[best.name]["eval"] == scored and rows[plain.name]["eval"] is None, rows
    compared = compare.find_compared(listing.list_runs(paths, settings), best.name)
    assert compared.gguf_val_centred_cosine == scored and compared.snapshot["evaluated"], compared.snapshot

    assert trainer_main(["snapshot", str(paths.root), "--delete", best.name]) == 0
    listed = capsys.readouterr().out
    assert listed.startswith("deleted output/demo-adapter-best-step40.gguf\n"), listed
    assert not best.exists() and plain.is_file() and (output / "demo-adapter.gguf").is_file()
    run_dir = paths.checkpoints_dir(atomic.read_json(paths.adapter_manifest)["fingerprint"])
    assert [(e["step"], e["weights"]) for e in read_snapshots(run_dir)] == [(40, "step40")]
    assert "demo-adapter-step40.gguf: step 40 of 40 (step40)" in listed
    # One plain file left at step 40: the step names it again.
    assert trainer_main(["snapshot", str(paths.root), "--delete", "40"]) == 0
    assert not plain.exists() and read_snapshots(run_dir) == []


def test_the_list_the_studio_and_a_refused_step_agree_on_a_continued_run(finished_project, tmp_path, capsys):
    """#65: after a continuation (training.steps raised), the parent's snapshot GGUF and steps stay listed by
    `snapshot --list` and the studio, a refused --step names the same steps, and a parent's step can be taken."""
    from gguf_assets.lib.materials.materials_run import load_manifest
    from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
    from gguf_assets.lib.training.training_run import LINEAGE_FILE, continuation_fingerprint, planned_adapter_run
    from gguf_assets.studio.app import snapshots_view

    paths = copy_project(finished_project[0], tmp_path / "project")
    parent = atomic.read_json(paths.adapter_manifest)["fingerprint"]
    assert trainer_main(["snapshot", str(paths.root), "--step", "35"]) == 0  # the parent's, before it is continued
    # The continuation as a run leaves it (cheaply): its lineage entry and a checkpoint at step 60 of 80.
    child = continuation_fingerprint(parent, 80)
    lineage_file = paths.root / "checkpoints" / LINEAGE_FILE
    lineage = atomic.read_json(lineage_file)
    lineage["runs"].append({**lineage["runs"][0], "run": child, "planned_steps": 80, "parent": parent})
    atomic.write_json(lineage_file, lineage)
    checkpoint = paths.checkpoints_dir(child) / "step-00000060"
    shutil.copytree(paths.checkpoints_dir(parent) / "step-00000040", checkpoint)
    atomic.write_json(checkpoint / "meta.json", {**atomic.read_json(checkpoint / "meta.json"), "step": 60})
    write_project_file(paths.root, replace(load_settings(paths.root), training={"steps": 80}))
    settings = load_settings(paths.root)
    assert planned_adapter_run(paths, settings, load_manifest(paths)).fingerprint == child
    capsys.readouterr()

    steps = (f"60 (checkpoint); of run {parent}, which this run continues: 30 (checkpoint), 35 (kept for a "
             "snapshot), 40 (final weights)")
    assert trainer_main(["snapshot", str(paths.root), "--list"]) == 0
    listed = " ".join(capsys.readouterr().out.split())  # unwrapped (it fits 80 columns)
    assert f"training run {child}, which continues {parent}" in listed
    assert f"demo-adapter-step35.gguf: step 35 of 40 (step35) of run {parent}" in listed, listed
    assert f"steps a snapshot can take: {steps}" in listed, listed

    view = snapshots_view(paths, settings)
    assert view["run"] == child and view["steps"] == steps
    assert [(r["step"], r["run"], r["name"]) for r in view["rows"]] == [
        (30, parent, None), (35, parent, "demo-adapter-step35.gguf"), (40, parent, None), (60, child, None)]

    assert trainer_main(["snapshot", str(paths.root), "--step", "7"]) == 2
    assert f"step 7 is not kept: the steps a snapshot can take are {steps}. " in capsys.readouterr().err
    # A step of the parent is taken from the parent's weights, and listed with the parent's snapshots.
    assert trainer_main(["snapshot", str(paths.root), "--step", "30"]) == 0
    assert [e["step"] for e in read_snapshots(paths.checkpoints_dir(parent))] == [30, 35]
    assert _metadata(paths.root / "output" / "demo-adapter-step30.gguf")["adapter.training.fingerprint"] == parent
