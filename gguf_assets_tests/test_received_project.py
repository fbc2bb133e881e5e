"""A received project whose records were edited to lead outside it (#66): snapshots.json, checkpoints/final.json and
checkpoints/lineage.json naming absolute paths, ``..`` and non-fingerprint run ids. Nothing outside the project is
deleted, read or written (canary files), and each refusal names the record, with no traceback."""

from __future__ import annotations

import json

import pytest
from conftest import cli, copy_project

from gguf_assets.lib.core import atomic
from gguf_assets.lib.output import snapshots
from gguf_assets.lib.project.layout import ProjectPaths, RecordPathError
from gguf_assets.lib.project.settings import load_settings
from gguf_assets.lib.training.training_run import adapter_is_current, final_weights, read_lineage


@pytest.fixture
def received(finished_project, tmp_path) -> tuple[ProjectPaths, dict]:
    paths = copy_project(finished_project[0], tmp_path / "received")
    canaries = {"absolute": tmp_path / "canary.txt", "climbing": tmp_path / "canary-2.txt"}
    for canary in canaries.values():
        canary.write_text("must survive")
    return paths, canaries


@pytest.mark.slow  # a copy of the suite's finished project (conftest's finished_project)
def test_a_hostile_snapshots_list_deletes_nothing_outside_the_output_folder(received):
    paths, canaries = received
    settings = load_settings(paths.root)
    final = atomic.read_json(paths.adapter_manifest)
    run_dir = paths.root / final["run_dir"]
    atomic.write_json(run_dir / snapshots.SNAPSHOTS_FILE, {"snapshots": [
        {"file": str(canaries["absolute"]), "step": 5, "weights": "step5"},
        {"file": "output/../../canary-2.txt", "step": 6, "weights": "step6"},
        {"file": "output/demo-adapter-step6.gguf", "step": 6, "weights": "step6"}]})
    (paths.root / "output" / "demo-adapter-step6.gguf").write_bytes(b"a snapshot")

    for step in (5, 6):
        refused = cli("snapshot", str(paths.root), "--delete", str(step))
        console = refused.stdout + refused.stderr
        assert refused.returncode != 0 and "Traceback" not in console, console
        assert snapshots.SNAPSHOTS_FILE in console and "nothing was opened, written or deleted" in console
    assert all(c.read_text() == "must survive" for c in canaries.values())
    # No side effect at all: the step's inside file and the entries stay (the studio's Delete calls the same).
    assert (paths.root / "output" / "demo-adapter-step6.gguf").is_file()
    assert len(snapshots.read_snapshots(run_dir)) == 3
    with pytest.raises(RecordPathError):
        snapshots.delete_snapshot(paths, run_dir, 5, output_dir=paths.output_dir(settings))
    # The studio's list shows only the entry inside output/.
    from gguf_assets.studio.app import snapshots_view

    view = snapshots_view(paths, settings)
    files = [row["file"] for row in view["rows"] if row.get("file")]
    assert files == [str(paths.root / "output" / "demo-adapter-step6.gguf")]


@pytest.mark.slow  # a copy of the suite's finished project (conftest's finished_project)
def test_a_hostile_final_json_and_lineage_lead_nowhere_outside(received, tmp_path):
    paths, canaries = received
    final = atomic.read_json(paths.adapter_manifest)
    fingerprint = final["fingerprint"]
    outside = tmp_path / "elsewhere"
    (outside / "final").mkdir(parents=True)
    for run_dir in (str(outside), "checkpoints/../../elsewhere"):
        atomic.write_json(paths.adapter_manifest, {**final, "run_dir": run_dir})
        with pytest.raises(RecordPathError, match="final.json"):
            final_weights(paths)
        assert not adapter_is_current(paths, fingerprint)  # not this project's run: trained again, never read

    atomic.write_json(paths.adapter_manifest, final)
    lineage = paths.root / "checkpoints" / "lineage.json"
    doc = atomic.read_json(lineage)
    doc["runs"].append({"run": "../../canary-dir", "lineage": "x", "planned_steps": 1})
    lineage.write_text(json.dumps(doc))
    with pytest.raises(RecordPathError, match="lineage.json"):
        read_lineage(paths)
    status = cli("status", str(paths.root))
    assert "Traceback" not in status.stdout + status.stderr
    assert all(c.read_text() == "must survive" for c in canaries.values())


def test_commands_printed_for_pasting_run_as_themselves_in_a_folder_named_with_quotes_and_dollar(tmp_path):
    """A project folder named with a space, quotes and $(...): the command `init` prints, pasted into bash, runs
    `gguf-trainer run` on exactly that folder and nothing else (no file is made by the name's $(...))."""
    import subprocess

    from gguf_assets.lib.core.commands import shell_line, trainer

    folder = tmp_path / "H hints $(touch PWNED-hint) 'q\" end"
    created = cli("init", str(folder))
    assert created.returncode == 0, created.stderr
    printed = [line.strip() for line in created.stdout.splitlines() if "gguf-trainer" in line and " run " in line]
    assert printed == [trainer("run", folder)]
    pasted = subprocess.run(["bash", "-c", printed[0]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    said = pasted.stdout + pasted.stderr
    assert f"{folder}/project.yaml" in said and "materials.teacher is empty" in said, said
    assert not list(tmp_path.rglob("PWNED-hint"))
    import shlex

    for words in (["mv", str(folder), f"{folder}.damaged"], ["a b", "", "'", '"', "$(x)", "`y`", "ok"]):
        assert shlex.split(shell_line(*words)) == words


def test_a_material_inside_a_folder_the_product_writes_is_refused_at_load_naming_the_key_and_line(tmp_path):
    from gguf_assets.lib.project.settings import SettingsError, settings_from_text

    (tmp_path / "output").mkdir()
    (tmp_path / "output" / "demo-adapter-student.gguf").write_bytes(b"GGUF")
    (tmp_path / "shards" / "train").mkdir(parents=True)
    (tmp_path / "materials" / "student").mkdir(parents=True)
    text = "materials:\n  teacher: materials/student\n  student: {student}\n  datasets: []\n{tokenizer}" \
           "precompute:\n  mock_teacher: true\n"
    for student in ("output/demo-adapter-student.gguf", "./shards/train", str(tmp_path / "output")):
        tokenizer = "  student_tokenizer: materials/student\n" if student.endswith(".gguf") else ""
        with pytest.raises(SettingsError) as refused:
            settings_from_text(tmp_path / "project.yaml", text.format(student=student, tokenizer=tokenizer))
        said = str(refused.value)
        assert said.startswith(f"{tmp_path / 'project.yaml'}:3: materials.student = {student!r}"), said
        assert "which the product writes" in said
    # Elsewhere in the project, or a hub id that happens to read like a path there, is fine.
    assert settings_from_text(tmp_path / "project.yaml", text.format(student="materials/student", tokenizer=""))
    assert settings_from_text(tmp_path / "project.yaml", text.format(student="output/some-repo", tokenizer=""))


@pytest.mark.slow  # a copy of the suite's finished project (conftest's finished_project)
def test_a_killed_snapshot_write_leaves_no_temp_after_verify_and_a_live_one_is_left_alone(received):
    import os
    import subprocess

    paths, _ = received
    ended = subprocess.Popen(["true"])  # a pid that has ended (and was reaped)
    ended.wait()
    output = paths.root / "output"
    killed = output / f".tmp-demo-adapter-step256.gguf.{ended.pid}-k1ll3d"
    alive = output / f".tmp-demo-adapter-best-step300.gguf.{os.getpid()}-wr1t1ng"
    before_pids = output / ".tmp-demo-adapter-step12.gguf.x7y8z9ab"  # the temps' names before they named a pid
    users = output / ".tmp-notes.txt.123-abc"  # not the product's: the output folder is shared
    for file in (killed, alive, before_pids, users):
        file.write_bytes(b"half a GGUF")
    verified = cli("verify", str(paths.root))
    assert "removed 2 temp file(s)" in verified.stdout, verified.stdout + verified.stderr
    assert not killed.exists() and not before_pids.exists()
    assert alive.exists() and users.exists()


@pytest.mark.slow  # a copy of the suite's finished project (conftest's finished_project)
def test_an_export_record_naming_a_file_elsewhere_is_refused_by_verify_and_never_read(received):
    from gguf_assets.lib.output.export_run import exported_files_unchanged, gguf_path

    paths, canaries = received
    settings = load_settings(paths.root)
    sidecar = gguf_path(paths, settings).with_suffix(".json")
    doc = atomic.read_json(sidecar)
    assert exported_files_unchanged(paths, settings)
    canary = canaries["absolute"]
    doc["files"].append({"role": "copy", "path": str(canary), "bytes": canary.stat().st_size,
                         "sha256": atomic.sha256_file(canary)})
    atomic.write_json(sidecar, doc)
    assert not exported_files_unchanged(paths, settings)  # not this export's file: it is made again
    verified = cli("verify", str(paths.root))
    said = verified.stdout + verified.stderr
    assert verified.returncode != 0 and "Traceback" not in said, said
    assert sidecar.name in said and str(canary) in said and "nothing was opened" in said
    assert canary.read_text() == "must survive"
