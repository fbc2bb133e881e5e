"""A project made before ggk's contract (#55) is never silently reused: `status` names each result of an older
format and why it is made again (lib/project/formats.py, older_format)."""

from __future__ import annotations

import json

from conftest import copy_project

from gguf_assets.lib.project import formats
from gguf_assets.lib.project.settings import load_settings
from gguf_assets.lib.status.states import State, project_status


def _as_before_55(record_path, *, fingerprint: str = "made-by-an-older-version") -> None:
    """The record as a version before the key existed wrote it: no "format", another fingerprint."""
    record = json.loads(record_path.read_text())
    record.pop("format", None)
    record["fingerprint"] = fingerprint
    record_path.write_text(json.dumps(record))


def test_status_says_an_adapter_and_shards_of_the_old_layout_are_made_again_and_why(finished_project, tmp_path):
    paths = copy_project(finished_project[0], tmp_path / "project")
    settings = load_settings(paths.root)
    assert {s.stage: s.state for s in project_status(paths, settings)}["adapter"] == State.CURRENT
    assert json.loads(paths.adapter_manifest.read_text())["format"] == formats.TRAINING_RUN

    # The old run's folder is named by its old fingerprint: no checkpoint of the run these settings make now.
    manifest = json.loads(paths.adapter_manifest.read_text())
    old_run = paths.root / "checkpoints" / "made-by-an-older-version"
    (paths.root / manifest["run_dir"]).rename(old_run)
    paths.adapter_manifest.write_text(json.dumps({**manifest, "run_dir": str(old_run.relative_to(paths.root))}))
    _as_before_55(paths.adapter_manifest)
    adapter = {s.stage: s for s in project_status(paths, settings)}["adapter"]
    assert adapter.state == State.STALE
    assert "the product's own adapter, which ggk cannot load" in adapter.detail
    assert f"format 1, now {formats.TRAINING_RUN}" in adapter.detail

    student_half = sorted(paths.root.glob("shards/train/*/student.json"))[0]
    assert json.loads(student_half.read_text())["format"] == formats.SHARD_HALF
    _as_before_55(student_half)
    shards = {s.stage: s for s in project_status(paths, settings)}["train_shards"]
    assert shards.state == State.STALE
    assert "its student half was made before the student read what ggk feeds it" in shards.detail
