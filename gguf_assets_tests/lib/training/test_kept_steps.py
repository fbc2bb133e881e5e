"""Kept steps, snapshots, finishing now and going on (#57), on the trainer's own test shards (test_train.py): in
process, a few seconds each."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from test_train import SETTINGS, write_shards

from gguf_assets.cli import runs as runs_cli
from gguf_assets.lib.core import atomic
from gguf_assets.lib.output import snapshots
from gguf_assets.lib.project.layout import FINAL_DIR, META_FILE, WEIGHTS_FILE, ProjectPaths
from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import replace, write_project_file
from gguf_assets.lib.runs.compare import compare_runs
from gguf_assets.lib.runs.listing import default_compared, list_runs
from gguf_assets.lib.training import kept_steps as kept
from gguf_assets.lib.training.events import LogStep, Note
from gguf_assets.lib.training.train import train_adapter
from gguf_assets.lib.training.training_run import (
    ended_early,
    last_checkpoint_step,
    planned_run,
    shards_identity,
    standing_runs,
    training_fingerprint,
)

MATERIALS = MaterialsManifest(student={"source": "demo/student", "commit": "c0ffee", "path": "."},
                              teacher={"source": "demo/teacher", "commit": "beef", "path": "."})


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return {"train": write_shards(root / "train", shards=5, prompts=40, seed=1),
            "val": write_shards(root / "val", shards=1, prompts=30, seed=2)}


def _write_yaml(root: Path, settings) -> None:
    """project.yaml of these training settings (the mock teacher makes the rest of the file a valid project)."""
    write_project_file(root, replace(settings, precompute={"mock_teacher": True},
                                     materials={"student": "student", "datasets": ["prompts"]}))


def _train(root: Path, shards, settings, **kwargs):
    paths = ProjectPaths.of(root)
    root.mkdir(parents=True, exist_ok=True)
    _write_yaml(root, settings)
    planned = planned_run(paths, settings, [shards_identity(shards["train"])], [shards_identity(shards["val"])])
    result = train_adapter(paths, settings, train_folders=shards["train"], val_folders=shards["val"],
                           fingerprint=planned.fingerprint, planned=planned, **kwargs)
    return result, paths.checkpoints_dir(result.fingerprint)


def _final_bytes(run_dir: Path) -> bytes:
    return (run_dir / FINAL_DIR / WEIGHTS_FILE).read_bytes()


def test_kept_steps_and_a_snapshot_request_leave_the_result_as_it_was_and_export_the_same_bytes(tmp_path, shards):
    plain, plain_dir = _train(tmp_path / "plain", shards, SETTINGS)
    schedule = replace(SETTINGS, training={"keep_steps_every": 10, "keep_steps_from": 10, "keep_steps_to": 30,
                                           "keep_steps_last": 2})
    _, scheduled_dir = _train(tmp_path / "scheduled", shards, schedule)
    assert kept.kept_steps(scheduled_dir) == [20, 30]  # 10 was kept, then pruned: the newest 2 stay

    requests = []

    def ask_at_20(event):  # two requests land while step 20's bookkeeping runs (the studio's and a CLI's), as
        if isinstance(event, LogStep) and event.step == 20:  # they would between steps: both are answered
            requests.extend([kept.ask(asked_dir), kept.ask(asked_dir)])

    asked_dir = ProjectPaths.of(tmp_path / "asked").checkpoints_dir(plain.fingerprint)
    _, asked_dir = _train(tmp_path / "asked", shards, SETTINGS, on_event=ask_at_20)
    assert kept.kept_steps(asked_dir) == [20]
    assert len(set(requests)) == 2 and kept.asked(asked_dir) == []
    for request in requests:  # each asker reads its own answer, which is then gone
        assert kept.wait_for_answer(asked_dir, request, still_training=lambda: False, timeout_s=1) == 20
        assert not list(asked_dir.glob(f"*{request}*"))
    # Keeping steps, and a snapshot mid-run, change nothing of the run's result.
    assert _final_bytes(scheduled_dir) == _final_bytes(asked_dir) == _final_bytes(plain_dir)

    gguf = {}
    for name, run_dir in (("scheduled", scheduled_dir), ("asked", asked_dir)):
        paths = ProjectPaths.of(tmp_path / name)
        entry = snapshots.take_snapshot(paths, SETTINGS, MATERIALS, run_dir, val_folders=shards["val"], step=20)
        assert entry["weights"] == "step20" and entry["planned_steps"] == SETTINGS.training.steps
        gguf[name] = paths.located(entry["file"]).read_bytes()
        assert snapshots.read_snapshots(run_dir) == [entry]
    assert gguf["scheduled"] == gguf["asked"]
    # `gguf-trainer runs` counts them: one snapshot, the two kept steps.
    (listed,) = list_runs(ProjectPaths.of(tmp_path / "scheduled"), schedule).runs
    assert (listed.snapshots, listed.kept_steps, listed.parent, listed.lowered_to) == (1, [20, 30], None, None)

    with pytest.raises(snapshots.SnapshotError, match=r"step 7 is not kept: the steps a snapshot can take are 20, 30"):
        snapshots.take_snapshot(ProjectPaths.of(tmp_path / "scheduled"), SETTINGS, MATERIALS, scheduled_dir,
                                val_folders=shards["val"], step=7)


def test_lowering_the_steps_mid_run_finishes_now_and_raising_them_after_goes_on_from_the_checkpoint(tmp_path, shards,
                                                                                                      capsys):
    root = tmp_path / "project"

    def lower_at_15(event):
        if isinstance(event, LogStep) and event.step == 15:
            _write_yaml(root, replace(SETTINGS, training={"steps": 12}))

    early, run_dir = _train(root, shards, SETTINGS, on_event=lower_at_15)
    assert early.finished and early.step == 15
    meta = atomic.read_json(run_dir / FINAL_DIR / META_FILE)
    assert (meta["planned_steps"], meta["lowered_to"]) == (40, 12)
    # #65: the end is validated like a planned last step (validate_every is 10): the chart's last point is step 15's
    # score, and every list says where it ended.
    last = next(e for e in reversed(meta["history"]) if "val_centred_cosine" in e)
    assert last["step"] == 15 and last["val_centred_cosine"] == pytest.approx(meta["val_centred_cosine"], abs=1e-6)
    assert ended_early(meta) == "ended at step 15 (training.steps lowered to 12)"
    # The lowered count now stands for that run: nothing is trained again.
    lowered = replace(SETTINGS, training={"steps": 12})
    fps = [shards_identity(shards["train"])], [shards_identity(shards["val"])]
    assert planned_run(ProjectPaths.of(root), lowered, *fps).fingerprint == early.fingerprint

    longer = replace(SETTINGS, training={"steps": 25})
    # Before it starts, `status` already knows where the continuation will start: the parent's step.
    continuation = planned_run(ProjectPaths.of(root), longer, *fps)
    assert continuation.parent == early.fingerprint
    assert last_checkpoint_step(ProjectPaths.of(root), continuation.fingerprint) == 15
    events = []
    went_on, went_on_dir = _train(root, shards, longer, on_event=events.append)
    notes = [e.message for e in events if isinstance(e, Note)]
    steps = [e.step for e in events if isinstance(e, LogStep)]
    assert went_on.finished and went_on.step == 25 and went_on.fingerprint != early.fingerprint
    assert min(steps) > 15, steps  # continued from the checkpoint at step 15, never from step 0
    assert any(f"continuing run {early.fingerprint} from step 15" in n for n in notes), notes
    assert atomic.read_json(went_on_dir / FINAL_DIR / META_FILE)["parent"] == early.fingerprint
    assert went_on.fingerprint != training_fingerprint(longer, *fps)  # a fresh run to 25 stays another run

    # `gguf-trainer runs`: the early end and the continuation, each on a line of its own in its run's block.
    view = list_runs(ProjectPaths.of(root), longer)
    first, second = (next(r for r in view.runs if r.fingerprint == fp) for fp in (early.fingerprint,
                                                                                 went_on.fingerprint))
    assert (first.step, first.planned_steps, first.lowered_to, first.parent) == (15, 40, 12, None)
    assert first.detail == "ended at step 15 (training.steps lowered to 12)" and first.curve[-1][0] == 15
    assert (second.step, second.planned_steps, second.parent, second.parent_step) == (25, 25, early.fingerprint, 15)
    capsys.readouterr()
    runs_cli._table(ProjectPaths.of(root), view)
    printed = capsys.readouterr().out
    blocks = {block.split()[0]: " ".join(block.split()) for block in re.split(r"\n(?=\S)", printed)}  # unwrapped
    assert " ended at step 15: training.steps lowered to 12 (it was planned to 40)" in blocks[first.name]
    assert f" continues {first.name} from step 15 (training.steps raised to 25)" in blocks[second.name]
    assert second.to_json()["parent"] == early.fingerprint and first.to_json()["lowered_to"] == 12

    # The same continuation again, on a copy of the project: reused, not trained again.
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    events = []
    again, _ = _train(copy, shards, longer, on_event=events.append)
    assert again.fingerprint == went_on.fingerprint and again.step == 25
    assert not [e for e in events if isinstance(e, LogStep)]
    assert any("already finished" in e.message for e in events if isinstance(e, Note))


def test_a_continuation_lowered_back_to_its_parents_count_stands_for_it_and_compares_with_it(tmp_path, shards):
    """#65: a run of 20 steps, continued to 40, lowered back to 20 at step 25: the settings stand for both runs, and
    mean the one that finished last (the current one), which says where it ended. Compare starts with the two, draws
    their shared history once, and scales its axis to the validations (the untrained step 0 left out)."""
    root = tmp_path / "project"
    short = replace(SETTINGS, training={"steps": 20})
    parent, _ = _train(root, shards, short)

    def lower_at_25(event):
        if isinstance(event, LogStep) and event.step == 25:
            _write_yaml(root, short)

    child, child_dir = _train(root, shards, replace(SETTINGS, training={"steps": 40}), on_event=lower_at_25)
    assert child.finished and child.step == 25 and child.fingerprint != parent.fingerprint
    paths, fps = ProjectPaths.of(root), ([shards_identity(shards["train"])], [shards_identity(shards["val"])])
    assert {r.fingerprint for r in standing_runs(paths, short, *fps)} == {parent.fingerprint, child.fingerprint}
    assert planned_run(paths, short, *fps).fingerprint == child.fingerprint  # the current run, not the parent

    view = list_runs(paths, short)
    first, second = view.runs  # the continuation after the run it continues
    assert (first.fingerprint, second.fingerprint) == (parent.fingerprint, child.fingerprint)
    assert second.current and not first.current
    assert second.detail == "ended at step 25 (training.steps lowered to 20)"
    assert [r.fingerprint for r in default_compared(view)] == [parent.fingerprint, child.fingerprint]
    assert [step for step, _ in second.curve] == [0, 10, 20, 25]  # its history holds its parent's

    _, svg = compare_runs(view, [parent.fingerprint, child.fingerprint])
    lines = ET.fromstring(svg).findall("{http://www.w3.org/2000/svg}polyline")
    drawn = [len(line.get("points").split()) for line in lines]
    assert drawn == [2, 2], drawn  # the parent's 10 and 20; the continuation's own 20 and 25 (none at 0)
    y_labels = [float(t.text) for t in ET.fromstring(svg).iter("{http://www.w3.org/2000/svg}text") if t.get("x") == "2"]
    validations = [cosine for step, cosine in second.curve if step > 0]  # the axis spans them, not the untrained 0
    assert y_labels == pytest.approx([max(validations), min(validations)], abs=1e-3), (y_labels, second.curve)
    assert min(validations) > second.curve[0][1] + 0.01


def test_the_trainer_s_closing_note_offers_better_weights_as_the_report_does(tmp_path, shards):
    """#65: a continuation that ends below the run it continues says so in the trainer's own closing note, with the
    command that makes the parent's result current again (lib/training/better.py, the report's words), for this
    project's folder."""
    from gguf_assets.lib.core.commands import trainer
    from gguf_assets.lib.training.better import better_weights, shortfall

    root = tmp_path / "project"
    short = replace(SETTINGS, training={"steps": 20})
    parent, parent_dir = _train(root, shards, short)
    # The parent ended higher than 20 more steps will take its child (as a lowered or unlucky continuation would).
    parent_final = parent_dir / FINAL_DIR / META_FILE
    atomic.write_json(parent_final, {**atomic.read_json(parent_final), "val_centred_cosine": 0.99})
    events = []
    child, child_dir = _train(root, shards, replace(SETTINGS, training={"steps": 40}), on_event=events.append)
    (note,) = [e.message for e in events if isinstance(e, Note) and e.message.startswith("training finished: ")]
    meta = atomic.read_json(child_dir / FINAL_DIR / META_FILE)
    better = better_weights(ProjectPaths.of(root), meta, torch_score=meta["val_centred_cosine"], gguf_score=None)
    assert [(b["kind"], b["run"], b["score"]) for b in better] == [("parent", parent.fingerprint, 0.99)]
    parent_name = better[0]["name"]
    assert f"{meta['verdict']} {shortfall(better)}" in note, note
    assert "But earlier weights scored higher (the run it continues: 0.9900)." in note
    assert f"The run it continues, {parent_name}, scored 0.9900 (torch), above this run's " in note
    assert f"`{trainer('runs', root, '--use', parent_name)}`." in note, note
