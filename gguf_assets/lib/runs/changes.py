"""Changing training runs: label one, delete one, or go back to one (``use_run``: its settings back into
project.yaml, its kept GGUF and report made current again). The runs are read by listing.py."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.lock import ProjectLock
from gguf_assets.lib.output.export_run import exported_files_unchanged, gguf_path
from gguf_assets.lib.output.kept import NotRestorable, keep_current, restore_kept
from gguf_assets.lib.project import settings_file, settings_history
from gguf_assets.lib.project.layout import DELETING_DIR, LABEL_FILE, ProjectPaths
from gguf_assets.lib.project.manifests import recorded_fingerprint
from gguf_assets.lib.project.presets import set_keys
from gguf_assets.lib.project.settings import Settings, replace, settings_from_text
from gguf_assets.lib.runs.listing import (
    Run,
    RunsError,
    RunState,
    disk_usage,
    find_run,
    list_runs,
    made_by,
    read_runs,
    run_with,
    settings_diff,
    shown_value,
    tensorboard_folders,
)
from gguf_assets.lib.status.stages import INPUT_STAGES, TRAINING_STAGES, expected_fingerprints, stage_settings
from gguf_assets.lib.status.states import State, project_status
from gguf_assets.lib.training.training_run import final_weights_intact, newest_meta, record_finished_run

LABEL_MAX_CHARS = 200


def label_run(paths: ProjectPaths, ref: str, text: str) -> Run:
    """Give a run a label (one line; empty removes it), stored atomically in its folder."""
    label = " ".join(str(text).split())
    if len(label) > LABEL_MAX_CHARS:
        raise RunsError(f"a run's label is one line of at most {LABEL_MAX_CHARS} characters; this one has "
                        f"{len(label)}")
    run = find_run(read_runs(paths), ref)
    file = paths.checkpoints_dir(run.fingerprint) / LABEL_FILE
    if label:
        atomic.write_text(file, label + "\n")
    else:
        file.unlink(missing_ok=True)
        atomic.fsync_dir(file.parent)
    return run_with(run, label=label)


@dataclass(frozen=True)
class Deleted:
    name: str
    fingerprint: str
    freed_bytes: int


def _remove_aside(folder: Path) -> None:
    """Rename ``folder`` into its parent's .deleting/ (one atomic step: it is no run from then on), then remove it."""
    aside_root = folder.parent / DELETING_DIR
    aside = aside_root / folder.name
    aside_root.mkdir(exist_ok=True)
    if aside.exists():  # a deletion a kill cut off
        shutil.rmtree(aside)
    os.replace(folder, aside)
    atomic.fsync_dir(folder.parent)
    shutil.rmtree(aside)
    try:
        aside_root.rmdir()
    except OSError:
        pass


def delete_run(paths: ProjectPaths, ref: str) -> Deleted:
    """Remove a run's folder (and its TensorBoard events); never the current run's, nor one that trains now."""
    with ProjectLock(paths.lock_file, describe="gguf-trainer runs --delete"):
        view = read_runs(paths)
        run = find_run(view, ref)
        if run.current:
            raise RunsError(f"{run.name} is the current run: the output folder's GGUF and report are its, so it is "
                            f"not deleted. Make another run current first (`{trainer('runs', paths.root)} --use "
                            "RUN`), then delete this one.")
        if run.state == RunState.RUNNING:
            raise RunsError(f"{run.name} is training now ({run.detail}); stop it first, then delete it.")
        run_dir = paths.checkpoints_dir(run.fingerprint)
        meta = newest_meta(run_dir)
        folders = [run_dir, *tensorboard_folders(paths, run.fingerprint, (meta or {}).get("training"))]
        _, freed = disk_usage(folders)
        for folder in folders:
            _remove_aside(folder)
    return Deleted(run.name, run.fingerprint, freed)


@dataclass(frozen=True)
class Used:
    run: Run
    changed: list[str]  # the project.yaml keys set, "key old → new"
    left: list[str]  # keys that differ but change no result (device, cadence): left as project.yaml has them
    restored: list[str]  # the files put back into the output folder (as stored)
    next_run: str  # what the next `gguf-trainer run` does for it
    settings_sha256: str  # project.yaml's sha256 now (the studio's next edit is made on it)
    stages: list[str]  # the stages whose results are the run's now, without a run (Dagster is told: the callers)
    settings: Settings  # project.yaml's settings now

    def to_json(self) -> dict:
        return {"run": self.run.to_json(), "changed": self.changed, "left": self.left, "restored": self.restored,
                "next_run": self.next_run, "settings_sha256": self.settings_sha256, "stages": self.stages}


def _training_only(run: Run, now: Settings, paths: ProjectPaths) -> Settings:
    """A run whose settings snapshot is gone: its training section (its checkpoints record it) on ``now``."""
    meta = newest_meta(paths.checkpoints_dir(run.fingerprint)) or {}
    if not meta.get("training"):
        raise RunsError(f"{run.name} recorded no settings (it has no checkpoint yet), so there is nothing to go back "
                        "to")
    return replace(now, training=meta["training"])


def use_run(paths: ProjectPaths, ref: str, *, base_sha256: str | None = None,
            seen: settings_file.SeenTexts | None = None) -> Used:
    """Go back to a run: set the project.yaml keys that decide its result to its values (in place, comments
    kept; refused with SettingsChanged when the file is no longer the text ``base_sha256`` names), then make
    its finished weights, its kept GGUF and its kept report current again, without training or exporting.

    The output folder's GGUF and report are kept with their own run first, so they stay listed and can come
    back the same way. A run that cannot be what its settings make now (its shards changed since) is refused
    before anything is written."""
    with ProjectLock(paths.lock_file, describe="gguf-trainer runs --use"):
        text = settings_file.read(paths.project_file)
        now = settings_from_text(paths.project_file, text.text)
        view = list_runs(paths, now)
        run = find_run(view, ref)
        if run.state == RunState.RUNNING:
            raise RunsError(f"{run.name} is training now ({run.detail}); wait for it, or stop it, then use it.")
        run_settings = settings_history.recall(paths.root, run.settings_hash) or _training_only(run, now, paths)
        diffs = settings_diff(run_settings, now)
        changes: dict[str, dict] = {}
        for d in diffs:
            if d.result:
                section, key = d.key.split(".", 1)
                changes.setdefault(section, {})[key] = d.run
        new_text = set_keys(text.text, changes) if changes else text.text
        new = settings_from_text(paths.project_file, new_text)
        now_stages, new_stages = stage_settings(now), stage_settings(new)
        # When "use" would change the inputs' settings, the next run makes the materials or the corpus again first,
        # and only then can it be known whether that reproduces the run.
        upstream_changes = [s for s in INPUT_STAGES if now_stages[s] != new_stages[s]]
        expected: dict[str, str] = {}
        if not upstream_changes:
            try:
                expected = expected_fingerprints(paths, new)
            except (OSError, ValueError, KeyError, TypeError, UserError):
                expected = {}
            if expected.get("adapter") not in (None, run.fingerprint) and run.fingerprint in made_by(paths, new)[1]:
                # project.yaml stands for it and for the current run (a continuation lowered back to this run's
                # count): it becomes the current one, and the one the settings mean from then on.
                expected = expected_fingerprints(paths, new, adapter_fp=run.fingerprint)
            if expected.get("adapter") not in (None, run.fingerprint):
                why = ("its shards changed since it trained (the materials, the prompts or a shard)"
                       if run.settings_source.startswith("its") else
                       f"its settings were {run.settings_source}, and they do not make it, or its shards changed")
                raise RunsError(f"{run.name} cannot come back: its settings now make another training run "
                                f"({expected['adapter']}): {why}. Nothing was changed.")
        if not changes and run.current and all(s.state == State.CURRENT for s in project_status(paths, now)):
            return Used(run=run, changed=[], left=[d.key for d in diffs], restored=[],
                        next_run="nothing: it is the current run, and every stage is current",
                        settings_sha256=text.sha256, stages=[], settings=now)
        keep_current(paths, now)  # what the output folder holds now stays with its run, listed
        saved = settings_file.SettingsText(text.text, text.sha256)
        if changes:
            saved = settings_file.save_if_unchanged(paths.project_file, paths.dagster_home, new_text,
                                                    base_sha256 or text.sha256, seen)
        settings_hash = settings_history.remember(paths.root, new)
        restored, next_run, stages = _make_current(paths, new, run, expected, settings_hash, upstream_changes)
    return Used(run=run_with(run, current=bool(stages) or run.current, made_by_settings=not upstream_changes),
                changed=[f"{d.key} {shown_value(d.now)} → {shown_value(d.run)}" for d in diffs if d.result],
                left=[d.key for d in diffs if not d.result], restored=restored, next_run=next_run,
                settings_sha256=saved.sha256, stages=stages, settings=new)


def _make_current(paths: ProjectPaths, settings: Settings, run: Run, expected: dict[str, str], settings_hash: str,
                  upstream_changes: list[str]) -> tuple[list[str], str, list[str]]:
    """Point checkpoints/final.json at the finished run and put its kept files back; (what was restored, what the
    next `gguf-trainer run` does, the stages whose results are this run's now)."""
    if upstream_changes:
        return [], (f"the next `gguf-trainer run` makes the {' and '.join(upstream_changes)} again (its settings for "
                    "them differ), then the shards; training is reused when they make this run again"), []
    if run.state != RunState.FINISHED:
        return [], (f"it is {run.state} at step {run.step}: the next `gguf-trainer run` continues its training from "
                    "there"), []
    if expected.get("adapter") != run.fingerprint:
        return [], "the next `gguf-trainer run` makes what it needs first (no corpus or shards yet)", []
    run_dir = paths.checkpoints_dir(run.fingerprint)
    if not final_weights_intact(run_dir):
        return [], ("its finished weights changed on disk since training wrote them: the next `gguf-trainer run` "
                    "trains its last steps again from its newest intact checkpoint"), []
    record_finished_run(paths, run.fingerprint, settings_hash=settings_hash,
                        val_centred_cosine=run.final_val_centred_cosine)
    sidecar = gguf_path(paths, settings).with_suffix(".json")
    if recorded_fingerprint(sidecar) == expected["gguf"] and exported_files_unchanged(paths, settings) and \
            recorded_fingerprint(paths.report_json(settings)) == expected.get("eval_report"):
        return [paths.stored(paths.adapter_manifest)], \
            "nothing: its GGUF and report were in the output folder already", list(TRAINING_STAGES)
    try:
        done = restore_kept(paths, settings, run.fingerprint, gguf_fp=expected["gguf"],
                            report_fp=expected.get("eval_report"))
    except NotRestorable as exc:
        return [paths.stored(paths.adapter_manifest)], (
            f"its GGUF was not restored ({exc}): the next `gguf-trainer run` exports and evaluates it again from its "
            "finished weights, without training"), ["adapter"]
    restored = [paths.stored(paths.adapter_manifest), paths.stored(done.gguf), *(paths.stored(c) for c in done.copies)]
    if done.report is None:
        return restored, "its report was not kept: the next `gguf-trainer run` evaluates its GGUF again", \
            ["adapter", "gguf"]
    return [*restored, paths.stored(done.report)], "nothing: its adapter, GGUF and report are current", \
        list(TRAINING_STAGES)
