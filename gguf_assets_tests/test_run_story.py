"""#65: how a run's end is told. A continuation ended early by a lowered training.steps says where it ended (the
studio's training line and chart, `status`, `runs`), and a run raised past it goes on from there; a result below
earlier weights says so and offers them (report, studio, `run`'s closing lines), and the offered commands give them;
a running stage never says what Run would do.

Built cheaply on a copy of the suite's finished project (40 steps): its run continued to 80 steps and ended at step
60 by training.steps lowered back to 40, written as the trainer leaves it through the product's own record functions
(lineage, final.json); no training."""

from __future__ import annotations

import shutil

import dagster as dg
import pytest
from conftest import copy_project

from gguf_assets.cli import main as trainer_main
from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.commands import shell_line, trainer
from gguf_assets.lib.core.lock import HolderRecord, RunningRun
from gguf_assets.lib.core.metrics import VAL_CENTRED_COSINE
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import FINAL_DIR, META_FILE, WEIGHTS_FILE, ProjectPaths
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.lib.runs.listing import RunState, read_runs
from gguf_assets.lib.status.states import State, project_status, with_running
from gguf_assets.lib.training.better import better_weights
from gguf_assets.lib.training.training_run import (
    PlannedRun,
    continuation_fingerprint,
    read_lineage,
    record_finished_run,
    remember_lowered,
    remember_run,
)
from gguf_assets.studio.app import ObservationFeed, project_view

pytestmark = pytest.mark.slow  # copies of the suite's finished project (one pipeline run, shared)

ENDED = "ended at step 60 (training.steps lowered to 40)"


def lowered_continuation(paths: ProjectPaths, *, weights_step: int = 30) -> tuple[str, str]:
    """The finished run (40 steps) continued to 80 and ended at step 60 by training.steps lowered back to 40, as a
    run from before the trainer validated such an end leaves it: its best validation at step 50 (best/), its history
    stopping there, its final/ scoring below its best and the parent's (it holds the weights of the parent's step
    ``weights_step``), and final.json naming it. Returns (parent, continuation)."""
    parent = atomic.read_json(paths.adapter_manifest)["fingerprint"]
    parent_dir = paths.checkpoints_dir(parent)
    final = atomic.read_json(parent_dir / FINAL_DIR / META_FILE)
    child = continuation_fingerprint(parent, 80)
    remember_run(paths, PlannedRun(child, read_lineage(paths)[0]["lineage"], 80, parent=parent))
    child_dir = paths.checkpoints_dir(child)
    shutil.copytree(parent_dir / f"step-{weights_step:08d}", child_dir / "step-00000060")
    shutil.copytree(parent_dir / FINAL_DIR, child_dir / FINAL_DIR)
    shutil.copyfile(parent_dir / f"step-{weights_step:08d}" / WEIGHTS_FILE, child_dir / FINAL_DIR / WEIGHTS_FILE)
    best = {**final["best"], "step": 50, VAL_CENTRED_COSINE: final[VAL_CENTRED_COSINE] + 0.002}
    shutil.copytree(parent_dir / "best", child_dir / "best")
    atomic.write_json(child_dir / "best" / META_FILE, {**atomic.read_json(child_dir / "best" / META_FILE), **best,
                                                        "fingerprint": child})
    settings = replace(load_settings(paths.root), training={"steps": 80})
    score = final[VAL_CENTRED_COSINE] - 0.004
    meta = {**final, "fingerprint": child, "parent": parent, "step": 60, "planned_steps": 80, "lowered_to": 40,
            VAL_CENTRED_COSINE: score, "training": settings.section_dict("training"), "best": best,
            "history": [*final["history"], best],
            "settings_hash": settings_history.remember(paths.root, settings), "started_at": final["started_at"] + 60,
            "started": {"continues": parent, "from_step": 40, "previous_run": parent},
            "sha256": {WEIGHTS_FILE: atomic.sha256_file(child_dir / FINAL_DIR / WEIGHTS_FILE)}}
    atomic.write_json(child_dir / FINAL_DIR / META_FILE, meta)
    atomic.write_json(child_dir / "step-00000060" / META_FILE, {
        **atomic.read_json(child_dir / "step-00000060" / META_FILE), "fingerprint": child, "step": 60})
    remember_lowered(paths, child, 40)
    record_finished_run(paths, child, settings_hash=meta["settings_hash"], val_centred_cosine=score)
    return parent, child


@pytest.fixture
def lowered(finished_project, tmp_path, monkeypatch) -> tuple[ProjectPaths, str, str]:
    paths = copy_project(finished_project[0], tmp_path / "project")
    monkeypatch.setenv("DAGSTER_HOME", str(paths.dagster_home))
    return paths, *lowered_continuation(paths)


def test_a_lowered_counts_page_says_where_it_ended(lowered, capsys):
    paths, parent, child = lowered
    view = project_view(paths, ObservationFeed(dg.DagsterInstance.ephemeral()))
    assert view.training["text"] == ENDED and view.training["progress"]["percent"] == 100.0, view.training
    # Its last score is on the chart: the validation charts run to step 60 (its final evaluation; the history of a
    # run from before the trainer validated such an end stops at 40).
    assert view.training["svg"].count('text-anchor="end">60</text>') == 2, view.training["svg"]
    adapter = next(s for s in view.stages if s["stage"] == "adapter")
    assert (adapter["state"], adapter["detail"]) == (State.CURRENT, ENDED)

    assert trainer_main(["status", str(paths.root)]) == 0
    assert any(line.split() == ["adapter", "current", *ENDED.split()] for line in capsys.readouterr().out.splitlines())
    listed = read_runs(paths)
    ended = next(r for r in listed.runs if r.fingerprint == child)
    assert (ended.state, ended.detail, ended.curve[-1][0]) == (RunState.FINISHED, ENDED, 60)
    # project.yaml stands for both runs; the current one is the one it means.
    assert [(r.fingerprint, r.made_by_settings, r.current) for r in listed.runs] == [
        (parent, True, False), (child, True, True)]
    assert listed.to_json()["compare_default"] == [parent, child]

    # Raised past where it ended: the run that goes on from it is not "stopped at step 60/100".
    write_project_file(paths.root, replace(load_settings(paths.root), training={"steps": 100}))
    view = project_view(paths, ObservationFeed(dg.DagsterInstance.ephemeral()))
    assert view.training["text"] == \
        "goes on from step 60 to 100 (training.steps raised): Run continues the run that ended there", view.training


def _export_and_report(paths: ProjectPaths):
    """What the gguf and eval_report assets do (defs/output.py), in process."""
    from gguf_assets.lib.materials.materials_run import load_manifest
    from gguf_assets.lib.output.checkpoint_outputs import checkpoint_outputs
    from gguf_assets.lib.output.export import export_adapter
    from gguf_assets.lib.output.gguf_eval import evaluate_gguf, training_centre
    from gguf_assets.lib.output.report import build_report
    from gguf_assets.lib.output.report_run import report_fingerprint
    from gguf_assets.lib.precompute.shards_run import require_current, shard_fingerprints
    from gguf_assets.lib.training.training_run import final_weights

    settings = load_settings(paths.root)
    materials = load_manifest(paths)
    val = require_current(paths, settings, materials, "val")
    sidecar = export_adapter(paths, settings, materials, atomic.read_json(paths.adapter_manifest), val_folders=val)
    weights = final_weights(paths)
    evaluation = evaluate_gguf(paths.located(sidecar.path), val, training_centre(weights),
                               checkpoint=checkpoint_outputs(weights.parent.parent))
    return build_report(paths, settings, materials, sidecar, evaluation, fingerprint=report_fingerprint(
        settings, sidecar.fingerprint, shard_fingerprints(paths, settings, materials, "val")))


def test_a_result_below_earlier_weights_says_so_and_the_offered_commands_give_them(lowered, capsys):
    from gguf_assets.cli.commands import _print_results
    from gguf_assets.studio.app import report_view

    paths, parent, child = lowered
    parent_report = atomic.read_json(paths.checkpoints_dir(parent) / "export" / "kept.json")["report"]
    report = _export_and_report(paths)
    name = next(r.name for r in read_runs(paths).runs if r.fingerprint == parent)
    # Its best validation (step 50) and the run it continues scored higher.
    assert report.val_centred_cosine < parent_report[VAL_CENTRED_COSINE] - 0.001
    assert [(b["kind"], b["step"], b.get("name")) for b in report.better_weights] == [
        ("best", 50, None), ("parent", 40, name)]
    assert "But earlier weights scored higher (its best validation, step 50: " in report.verdict
    assert "the run it continues: " in report.verdict
    # The report's files name the project folder as "." (no absolute path); the studio and `run` name it.
    for command in (shell_line("gguf-trainer", "snapshot", ".", "--best"),
                    shell_line("gguf-trainer", "runs", ".", "--use", name)):
        assert f"`{command}`" in report.advice, report.advice
    assert str(paths.root) not in report.advice and "More steps" not in report.advice
    kept = f"checkpoints/{parent}/export/demo-adapter.gguf"
    assert f"Its GGUF is kept as {kept}." in report.advice and (paths.root / kept).is_file()
    # A best validation at the parent's end is the parent's GGUF: offered once, as the parent's.
    final = atomic.read_json(paths.checkpoints_dir(child) / FINAL_DIR / META_FILE)
    at_parents_end = {**final, "best": atomic.read_json(paths.checkpoints_dir(parent) / FINAL_DIR / META_FILE)["best"]}
    assert [b["kind"] for b in better_weights(paths, at_parents_end, torch_score=final[VAL_CENTRED_COSINE],
                                              gguf_score=report.val_centred_cosine)] == ["parent"]
    shown = report_view(paths, load_settings(paths.root))["advice"]
    best, use = trainer("snapshot", paths.root, "--best"), trainer("runs", paths.root, "--use", name)
    assert f"`{best}`" in shown and f"`{use}`" in shown
    capsys.readouterr()
    _print_results(paths)
    printed = capsys.readouterr().out.splitlines()
    assert any("But earlier weights scored higher" in line for line in printed)
    # Each command on a line of its own, whole, to paste; the words around it within 80 columns.
    assert f"    {best}" in printed and f"    {use}" in printed, printed
    said = printed[next(i for i, line in enumerate(printed) if line.startswith("  Its best validation")):
                   printed.index(f"    {use}")]
    assert all(len(line) <= 80 for line in said if line.strip() != best), said

    # The offered commands do what they say: the best weights as a GGUF; the parent current again, from its kept
    # GGUF, without training, and every stage current.
    assert trainer_main(["snapshot", str(paths.root), "--best"]) == 0
    assert (paths.root / "output" / "demo-adapter-best-step50.gguf").is_file()
    assert trainer_main(["runs", str(paths.root), "--use", name]) == 0
    assert atomic.read_json(paths.adapter_manifest)["fingerprint"] == parent
    assert (paths.root / "output" / "demo-adapter.gguf").read_bytes() == (paths.root / kept).read_bytes()
    assert all(s.state == State.CURRENT for s in project_status(paths, load_settings(paths.root)))


def test_a_running_stage_says_what_it_was_not_what_run_would_do(finished_project, tmp_path):
    paths = copy_project(finished_project[0], tmp_path / "project")
    paths.adapter_manifest.unlink()  # trained to its last checkpoint, not recorded: Run would resume it
    stages = project_status(paths, load_settings(paths.root))
    adapter = next(s for s in stages if s.stage == "adapter")
    assert adapter.detail == "trained to step 40 of 40 (checkpoint kept; `gguf-trainer run` resumes from it)"
    running = HolderRecord(running=RunningRun(run_id="1a2b3c4d5e6f", job="train_export_evaluate",
                                              assets=("adapter", "gguf", "eval_report")))
    shown = next(s for s in with_running(stages, running) if s.stage == "adapter")
    assert shown.detail == "run 1a2b3c4d of train_export_evaluate; was partial: trained to step 40 of 40"
