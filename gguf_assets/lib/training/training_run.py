"""What a training run is: the settings its result depends on, its fingerprint and whether the adapter on disk
is current. No torch here: `status` and the planner compute the fingerprint too (lib/status/)."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from gguf_assets.lib.core import atomic, liveness, verify
from gguf_assets.lib.core.metrics import VAL_CENTRED_COSINE
from gguf_assets.lib.precompute.shards import shard_fingerprints
from gguf_assets.lib.project import formats
from gguf_assets.lib.project.layout import (
    BEST_DIR,
    FINAL_DIR,
    META_FILE,
    SESSION_FILE,
    STEP_DIR,
    WEIGHTS_FILE,
    ProjectPaths,
    RecordPathError,
)
from gguf_assets.lib.project.manifests import MaterialsManifest, recorded
from gguf_assets.lib.project.settings import Settings

# Shards shuffled together (lib/training/train_data.py). Part of the data order, hence of the run fingerprint.
SHUFFLE_WINDOW_SHARDS = 4
# Settings that change speed or bookkeeping, not the trained weights (the device and precision: only within
# rounding, so a change resumes the same run).
NON_RESULT_KEYS = ("device", "precision", "grad_checkpoint", "log_every", "validate_every", "checkpoint_every",
                   "keep_checkpoints", "keep_steps_every", "keep_steps_from", "keep_steps_to", "keep_steps_last",
                   # heads follow from width (ggk's head dim); layer_fusion has no effect since one layer is fed
                   "heads", "layer_fusion")
# Result settings added after runs existed, with the value that means "as before": they enter the
# fingerprint only when set otherwise, so a new key never retrains an existing project.
OFF_VALUES = {"ema_decay": 0.0, "target_standardization": "per_row_dim", "relational_weight": 0.0, "init": "random",
              "query_lr_scale": 1.0}


def training_settings(settings: Settings) -> dict:
    """The training settings the result depends on (cadence and device settings change nothing).

    A key of OFF_VALUES at its off value is left out: the result is what it was before the key existed.
    """
    return {k: v for k, v in settings.section_dict("training").items()
            if k not in NON_RESULT_KEYS and not (k in OFF_VALUES and v == OFF_VALUES[k])}


def adapter_stage_settings(settings: Settings) -> dict:
    """What the adapter is computed from, as settings/adapter shows it: the training settings, and the
    precompute mode (training needs both halves)."""
    return {"training": training_settings(settings), "mode": settings.precompute.mode}


def training_fingerprint(settings: Settings, train_fps: list[str], val_fps: list[str]) -> str:
    return atomic.fingerprint({"training": training_settings(settings), "train": train_fps, "val": val_fps,
                               "shuffle_window_shards": SHUFFLE_WINDOW_SHARDS, "format": formats.TRAINING_RUN})


def adapter_fingerprint(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest) -> str:
    """The fingerprint of the training run these settings and the shards as planned now make (the shards are
    planned from the corpus: callers that planned them already call run_fingerprint)."""
    return planned_adapter_run(paths, settings, materials).fingerprint


def planned_adapter_run(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest) -> "PlannedRun":
    return planned_run(paths, settings, shard_fingerprints(paths, settings, materials, "train"),
                       shard_fingerprints(paths, settings, materials, "val"))


def run_fingerprint(paths: ProjectPaths, settings: Settings, train_fps: list[str], val_fps: list[str]) -> str:
    return planned_run(paths, settings, train_fps, val_fps).fingerprint


# -- lineage: a run continued to more steps, or ended early when its steps were lowered ------------------------
#
# checkpoints/lineage.json lists the runs in the order they started, each with its lineage key (the training
# settings but the step count, and the shards), its planned steps, its parent (a continued run) and the count it
# was lowered to (a run ended early). Which run the settings stand for (planned_run):
#   1. a run planned at this count from the start (the fresh fingerprint) that exists;
#   2. else a run of this lineage ended early because training.steps was lowered to this count;
#   3. else a run of this lineage planned at this count (a continuation made before: reused, not trained again);
#   4. else, when the newest run of this lineage reached fewer steps than this count, its continuation: a run of
#      its own, whose fingerprint names the parent and the count, that starts from the parent's newest checkpoint;
#   5. else a fresh run.

LINEAGE_FILE = "lineage.json"
RUN_ID = re.compile(r"[0-9a-f]{16}")  # atomic.fingerprint's form: a run's folder name under checkpoints/


@dataclass(frozen=True)
class PlannedRun:
    fingerprint: str
    lineage: str  # the training settings but the step count, and the shards
    planned_steps: int
    parent: str | None = None  # the run a continuation starts from
    lowered: bool = False  # a run ended early for this count


def lineage_key(settings: Settings, train_fps: list[str], val_fps: list[str]) -> str:
    kept = {k: v for k, v in training_settings(settings).items() if k != "steps"}
    return atomic.fingerprint({"training": kept, "train": train_fps, "val": val_fps,
                               "shuffle_window_shards": SHUFFLE_WINDOW_SHARDS, "format": formats.TRAINING_RUN})


def continuation_fingerprint(parent: str, steps: int) -> str:
    return atomic.fingerprint({"parent": parent, "steps": steps, "format": formats.TRAINING_RUN})


def read_lineage(paths: ProjectPaths) -> list[dict]:
    """checkpoints/lineage.json's runs. Their ids become folder names (checkpoints/<run>), so an id that is not a
    fingerprint (``../x``, ``/tmp``) is refused, naming the file: a received project's lineage leads nowhere else."""
    file = paths.root / "checkpoints" / LINEAGE_FILE
    try:
        doc = atomic.read_json(file)
    except (OSError, ValueError):
        return []
    runs = [r for r in doc.get("runs", []) if isinstance(r, dict) and "run" in r] if isinstance(doc, dict) else []
    for entry in runs:
        for key in ("run", "parent"):
            if key in entry and not RUN_ID.fullmatch(str(entry[key])):
                raise RecordPathError(f"{file}: a run's {key} is {entry[key]!r}, not a run fingerprint (16 hex "
                                      "digits), so it would name a folder outside checkpoints/: nothing was read or "
                                      "written. Remove that entry, or get the project again from its sender.")
    return runs


def _write_lineage(paths: ProjectPaths, runs: list[dict]) -> None:
    folder = paths.root / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_json(folder / LINEAGE_FILE, {"runs": runs})


def remember_run(paths: ProjectPaths, planned: PlannedRun) -> None:
    """Put a starting run in the lineage (once)."""
    runs = read_lineage(paths)
    if not any(r["run"] == planned.fingerprint for r in runs):
        runs.append({"run": planned.fingerprint, "lineage": planned.lineage, "planned_steps": planned.planned_steps,
                     **({"parent": planned.parent} if planned.parent else {})})
        _write_lineage(paths, runs)


def remember_lowered(paths: ProjectPaths, run: str, lowered_to: int) -> None:
    """The run ``run`` ended early because training.steps was lowered to ``lowered_to``."""
    runs = read_lineage(paths)
    for entry in runs:
        if entry["run"] == run:
            entry["lowered_to"] = lowered_to
    _write_lineage(paths, runs)


def reached_step(run_dir: Path) -> int:
    """How far a run got: its final step, else its newest checkpoint's."""
    try:
        return int(atomic.read_json(run_dir / FINAL_DIR / META_FILE)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    steps = [int(m.group(1)) for d in (run_dir.iterdir() if run_dir.is_dir() else []) if (m := STEP_DIR.match(d.name))]
    return max(steps, default=0)


def _has_work(run_dir: Path) -> bool:
    return (run_dir / FINAL_DIR / META_FILE).is_file() or reached_step(run_dir) > 0


# Continuations planned in this process, by fingerprint: the parent of one that has not started yet (so not in the
# lineage file) is known to whoever asks next, e.g. `status` saying where training will start.
_PLANNED_PARENTS: dict[str, str] = {}


def parent_of(paths: ProjectPaths, run: str) -> str | None:
    """The run ``run`` continues (a continuation), or None."""
    if run in _PLANNED_PARENTS:
        return _PLANNED_PARENTS[run]
    return next((r.get("parent") for r in read_lineage(paths) if r["run"] == run), None)


def planned_run(paths: ProjectPaths, settings: Settings, train_fps: list[str], val_fps: list[str]) -> PlannedRun:
    """Which training run these settings and shards stand for (the rules above)."""
    steps = settings.training.steps
    fresh = training_fingerprint(settings, train_fps, val_fps)
    key = lineage_key(settings, train_fps, val_fps)
    if _has_work(paths.checkpoints_dir(fresh)):
        return PlannedRun(fresh, key, steps)
    family = [r for r in read_lineage(paths) if r.get("lineage") == key and _has_work(paths.checkpoints_dir(r["run"]))]
    for entry in reversed(family):
        if entry.get("lowered_to") == steps:
            return PlannedRun(entry["run"], key, int(entry["planned_steps"]), lowered=True)
    for entry in reversed(family):
        if entry.get("planned_steps") == steps:
            return PlannedRun(entry["run"], key, steps, parent=entry.get("parent"))
    if family and reached_step(paths.checkpoints_dir(family[-1]["run"])) < steps:
        parent = family[-1]["run"]
        planned = PlannedRun(continuation_fingerprint(parent, steps), key, steps, parent=parent)
        _PLANNED_PARENTS[planned.fingerprint] = parent
        return planned
    return PlannedRun(fresh, key, steps)


def adapter_is_current(paths: ProjectPaths, adapter_fp: str) -> bool:
    """The adapter manifest names this fingerprint, and the finished weights are still as written."""
    try:
        manifest = atomic.read_json(paths.adapter_manifest)
    except (OSError, ValueError):
        return False
    if manifest.get("fingerprint") != adapter_fp:
        return False
    try:  # a final.json naming a folder outside checkpoints/ is not this project's finished run: train again
        weights = final_run_dir(paths, manifest) / FINAL_DIR / WEIGHTS_FILE
    except RecordPathError:
        return False
    recorded_weights = manifest.get("final_weights")
    return verify.unchanged(weights, recorded_weights) if recorded_weights else weights.is_file()


def final_run_dir(paths: ProjectPaths, manifest: dict | None = None) -> Path:
    """The finished run's folder that checkpoints/final.json (``manifest``, read when None) names, confined to
    checkpoints/ (RecordPathError otherwise)."""
    manifest = atomic.read_json(paths.adapter_manifest) if manifest is None else manifest
    return paths.inside(manifest.get("run_dir"), record=paths.adapter_manifest, under=paths.root / "checkpoints")


def final_weights(paths: ProjectPaths) -> Path:
    """The finished adapter's weights file, as the adapter manifest names its run."""
    return final_run_dir(paths) / FINAL_DIR / WEIGHTS_FILE


def last_checkpoint_step(paths: ProjectPaths, adapter_fp: str) -> int:
    """The step of the newest checkpoint of the training run ``adapter_fp`` (0: none); a continuation that has none
    of its own yet starts from its parent's."""
    run_dir = paths.checkpoints_dir(adapter_fp)
    steps = [int(m.group(1)) for d in (run_dir.iterdir() if run_dir.is_dir() else []) if (m := STEP_DIR.match(d.name))]
    if not steps and (parent := parent_of(paths, adapter_fp)):
        return reached_step(paths.checkpoints_dir(parent))
    return max(steps, default=0)


def final_weights_stored(paths: ProjectPaths) -> str:
    """Where the adapter manifest says the finished weights are, as stored (relative to the project)."""
    run_dir = recorded(paths.adapter_manifest, "run_dir") or "checkpoints/<run>"
    return f"{run_dir}/{FINAL_DIR}/{WEIGHTS_FILE}"


def record_finished_run(paths: ProjectPaths, fingerprint: str, *, settings_hash: str,
                        val_centred_cosine: float | None) -> None:
    """checkpoints/final.json: which finished run is the adapter, its weights' stamp and the settings it was
    trained under (what `status` and the export read). Training writes it when a run finishes, and
    `gguf-trainer runs --use` when it makes a finished run current again."""
    run_dir = paths.checkpoints_dir(fingerprint)
    weights = run_dir / FINAL_DIR / WEIGHTS_FILE
    recorded_sha256 = (atomic.read_json(run_dir / FINAL_DIR / META_FILE).get("sha256") or {}).get(WEIGHTS_FILE)
    atomic.write_json(paths.adapter_manifest, {"fingerprint": fingerprint,
                                               "run_dir": str(run_dir.relative_to(paths.root)),
                                               "final_weights": verify.record(weights, recorded_sha256),
                                               VAL_CENTRED_COSINE: val_centred_cosine,
                                               "format": formats.TRAINING_RUN, "settings_hash": settings_hash})


def final_weights_intact(run_dir: Path) -> bool:
    """Whether final/ holds finished weights whose bytes match the sha256 its meta recorded (read in full)."""
    try:
        recorded_sha256 = (atomic.read_json(run_dir / FINAL_DIR / META_FILE).get("sha256") or {}).get(WEIGHTS_FILE)
        return recorded_sha256 is not None and atomic.sha256_file(run_dir / FINAL_DIR / WEIGHTS_FILE) == recorded_sha256
    except (OSError, ValueError, AttributeError):
        return False


def newest_meta(run_dir: Path) -> dict | None:
    """What a training run records of itself: its final/ meta, else its newest checkpoint's, else its best/'s."""
    steps = sorted((d for d in run_dir.iterdir() if STEP_DIR.match(d.name)), reverse=True) if run_dir.is_dir() else []
    for folder in (run_dir / FINAL_DIR, *steps, run_dir / BEST_DIR):
        try:
            meta = atomic.read_json(folder / META_FILE)
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict):
            return meta
    return None


# -- the training session: running (which process), stopped or failed ---------------------


class RunOutcome(StrEnum):
    """How a training run stands or ended: the one vocabulary of the session record (session.json's "state"), the
    Runs list (lib/status/runs.py, `gguf-trainer runs`) and the studio's last-run line (studio/last_run.py). The
    values are the words users read and the files hold."""

    FINISHED = "finished"  # final/ is there: the finished weights (a Dagster run: it succeeded)
    RUNNING = "running"  # its training process trains it now
    STOPPED = "stopped"  # stopped on purpose (Ctrl-C, Stop, Terminate): its checkpoints are kept
    FAILED = "failed"  # its training ended with an error (the message says which)
    PARTIAL = "partial"  # checkpoints only: cut off by a kill or a reboot, or from before runs recorded how they ended


# The states a session record names (a finished run has none: end_session).
SESSION_RUNNING, SESSION_STOPPED, SESSION_FAILED = RunOutcome.RUNNING, RunOutcome.STOPPED, RunOutcome.FAILED


def write_session(run_dir: Path, state: str, *, step: int, message: str = "", settings_hash: str = "",
                  steps_per_s: float | None = None) -> None:
    """Record how the run's training session stands: running (by this process, which a kill -9 or a reboot ends
    without a word: ``session_alive`` tells), stopped on purpose, or failed and why. Checkpoints say how far it
    got; this says how it ended. While it runs, each log step records its step and this process's steps/s."""
    pid = os.getpid()
    atomic.write_json(run_dir / SESSION_FILE, {
        "state": state, "step": step, "message": message, "at": round(time.time(), 1), "pid": pid,
        "pid_started": liveness.process_started(pid), "boot_id": liveness.boot_id(), "machine": liveness.machine_id(),
        **({"settings_hash": settings_hash} if settings_hash else {}),
        **({"steps_per_s": steps_per_s} if steps_per_s is not None else {})})


def read_session(run_dir: Path) -> dict | None:
    try:
        session = atomic.read_json(run_dir / SESSION_FILE)
    except (OSError, ValueError):
        return None
    return session if isinstance(session, dict) else None


def end_session(run_dir: Path) -> None:
    """A finished run has no session to tell of: final/ says it all."""
    (run_dir / SESSION_FILE).unlink(missing_ok=True)


def session_alive(session: dict) -> bool | None:
    """Whether the process a running session names still trains: True or False on this machine since its boot;
    None when it ran on another machine (a cluster worker) and cannot be asked from here."""
    if session.get("machine") != liveness.machine_id():
        return None
    pid = session.get("pid")
    return (session.get("boot_id") == liveness.boot_id() and isinstance(pid, int) and liveness.process_alive(pid)
            and liveness.process_started(pid) == session.get("pid_started"))


def shards_identity(folders: list[Path]) -> str:
    """What the shards hold (their recorded half fingerprints), to tell a data change from a settings change."""
    parts = []
    for folder in folders:
        parts.append([folder.name] + [atomic.read_json(folder / f"{half}.json").get("fingerprint")
                                      for half in ("teacher", "student") if (folder / f"{half}.json").is_file()])
    return atomic.fingerprint(parts)


@dataclass(frozen=True)
class TrainedAdapter:
    """What `train_adapter` returns: a training run's result, typed (its final/meta.json holds the same
    fields and more). ``finished`` is False for a run paused by ``stop_after``; the scores are then None."""

    fingerprint: str
    finished: bool
    step: int
    val_centred_cosine: float | None = None
    empty_prompt_cosine: float | None = None
    untrained_val_centred_cosine: float | None = None
    val_loss: float | None = None
    per_shard: list[dict] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # {step, loss, lr, ...} and {step, val_centred_cosine, ...}
    best: dict = field(default_factory=dict)  # the best validation: {step, val_centred_cosine, ...}
    started: dict = field(default_factory=dict)  # why this run started (new settings, new shards) and its message
    read_mb_per_s: float | None = None
    verdict: str = ""
    advice: str = ""
    shape: dict = field(default_factory=dict)  # the adapter's shape (width, depth, heads, query rows, dims)

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> "TrainedAdapter":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in summary.items() if k in known and v is not None}
        values["untrained_val_centred_cosine"] = summary.get("untrained_val_centred_cosine", summary.get("untrained"))
        return cls(**values)
