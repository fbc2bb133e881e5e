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
from gguf_assets.lib.core.metrics import EMPTY_PROMPT_COSINE, VAL_CENTRED_COSINE, VAL_LOSS
from gguf_assets.lib.precompute.shards_run import chain_shard_fingerprints, shard_fingerprints
from gguf_assets.lib.project import formats
from gguf_assets.lib.project.layout import (
    BEST_DIR,
    FINAL_DIR,
    KEPT_DIR,
    KEPT_FILE,
    META_FILE,
    SESSION_FILE,
    STEP_DIR,
    WEIGHTS_FILE,
    ProjectPaths,
    RecordPathError,
)
from gguf_assets.lib.project.manifests import MaterialsManifest, recorded, recorded_fingerprint
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.stage import (
    Chain,
    Stage,
    StageState,
    State,
    older_format,
    record_damage,
    why_stale,
)

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
# Where rules 1 to 3 find several runs (a continuation lowered back to its parent's count: the parent is rule 1's,
# the continuation rule 2's), the current one (checkpoints/final.json's) is the one: the run that finished last, or
# the one `gguf-trainer runs --use` chose.

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


def current_run(paths: ProjectPaths) -> str | None:
    """The fingerprint checkpoints/final.json names (the run whose GGUF and report are the output folder's)."""
    try:
        fingerprint = atomic.read_json(paths.adapter_manifest).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None
    return fingerprint if isinstance(fingerprint, str) else None


def standing_runs(paths: ProjectPaths, settings: Settings, train_fps: list[str],
                  val_fps: list[str]) -> list[PlannedRun]:
    """The runs that exist and that these settings stand for by rules 1 to 3 above, in the rules' order."""
    return _standing(paths, settings, train_fps, val_fps)[0]


def _standing(paths: ProjectPaths, settings: Settings, train_fps: list[str],
              val_fps: list[str]) -> tuple[list[PlannedRun], list[dict]]:
    """(standing_runs, the lineage entries of this lineage that have work)."""
    steps = settings.training.steps
    fresh = training_fingerprint(settings, train_fps, val_fps)
    key = lineage_key(settings, train_fps, val_fps)
    standing = [PlannedRun(fresh, key, steps)] if _has_work(paths.checkpoints_dir(fresh)) else []
    if standing and current_run(paths) in (None, fresh):  # nothing else can be preferred: the lineage is not read
        return standing, []
    family = [r for r in read_lineage(paths) if r.get("lineage") == key and _has_work(paths.checkpoints_dir(r["run"]))]
    standing += [PlannedRun(entry["run"], key, int(entry["planned_steps"]), lowered=True)
                 for entry in reversed(family) if entry.get("lowered_to") == steps]
    standing += [PlannedRun(entry["run"], key, steps, parent=entry.get("parent"))
                 for entry in reversed(family) if entry.get("planned_steps") == steps]
    return standing, family


def planned_run(paths: ProjectPaths, settings: Settings, train_fps: list[str], val_fps: list[str]) -> PlannedRun:
    """Which training run these settings and shards stand for (the rules above)."""
    steps = settings.training.steps
    standing, family = _standing(paths, settings, train_fps, val_fps)
    if standing:
        current = current_run(paths)
        return next((run for run in standing if run.fingerprint == current), standing[0])
    key = lineage_key(settings, train_fps, val_fps)
    if family and reached_step(paths.checkpoints_dir(family[-1]["run"])) < steps:
        parent = family[-1]["run"]
        planned = PlannedRun(continuation_fingerprint(parent, steps), key, steps, parent=parent)
        _PLANNED_PARENTS[planned.fingerprint] = parent
        return planned
    return PlannedRun(training_fingerprint(settings, train_fps, val_fps), key, steps)


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


def finished_meta(run_dir: Path) -> dict | None:
    """A run's final/meta.json (its finished record), or None when it has none that reads."""
    try:
        meta = atomic.read_json(run_dir / FINAL_DIR / META_FILE)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def kept_dir(paths: ProjectPaths, fingerprint: str) -> Path:
    """Where a run keeps its own exported GGUF and report (lib/output/kept.py writes them; read here too, for
    lib/training/better.py, which offers a parent run's)."""
    return paths.checkpoints_dir(fingerprint) / KEPT_DIR


def read_kept(paths: ProjectPaths, fingerprint: str) -> dict[str, Any] | None:
    """The run's kept.json, or None when it kept nothing (or the record cannot be read)."""
    try:
        doc = atomic.read_json(kept_dir(paths, fingerprint) / KEPT_FILE)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("gguf"), dict) else None


def kept_gguf(paths: ProjectPaths, fingerprint: str, kept: dict) -> Path:
    return kept_dir(paths, fingerprint) / Path(kept["gguf"]["file"]).name


def ended_early(meta: dict | None) -> str | None:
    """How a finished run that a lowered training.steps ended mid-run ended, from its final/ meta ("ended at step
    1740 (training.steps lowered to 1600)"); None for any other run. Every place that tells a run's end says it so:
    the studio's training line, `status`, `runs`."""
    lowered = (meta or {}).get("lowered_to")
    if not meta or meta.get("finished") is not True or not isinstance(lowered, int):
        return None
    return f"ended at step {meta['step']} (training.steps lowered to {lowered})"


# A validation's scores that a finished run's final/ meta records for its last step too.
END_SCORES = (VAL_CENTRED_COSINE, EMPTY_PROMPT_COSINE, VAL_LOSS)


def history_to_the_end(meta: dict | None) -> list[dict]:
    """A run's recorded history (its newest meta's), ending with its final evaluation as a validation where the
    history has none at the final step: a run ended by a lowered training.steps before the trainer validated there
    (runs made before it did) would otherwise chart and compare without its last score."""
    history = [e for e in (meta or {}).get("history") or [] if isinstance(e, dict)]
    if not meta or meta.get("finished") is not True or not isinstance(meta.get(VAL_CENTRED_COSINE), (int, float)):
        return history
    if any(e.get("step") == meta.get("step") and VAL_CENTRED_COSINE in e for e in history):
        return history
    return [*history, {"step": meta["step"], **{key: meta.get(key) for key in END_SCORES}}]


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
    Runs list (lib/runs/listing.py, `gguf-trainer runs`) and the studio's last-run line (studio/last_run.py). The
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


def _adapter_state(stage: Stage, chain: Chain) -> StageState:
    """Current (with how it ended when a lowered training.steps ended it); else why not: never trained, trained
    part way (a checkpoint of this run is kept), its record or final weights damaged, or trained under other
    settings or shards."""
    paths, settings, adapter_fp = chain.paths, chain.settings, chain.fingerprint("adapter")
    if adapter_is_current(paths, adapter_fp):
        return StageState("adapter", State.CURRENT, _how_it_ended(paths))
    step = last_checkpoint_step(paths, adapter_fp)
    if step and parent_of(paths, adapter_fp) and not paths.checkpoints_dir(adapter_fp).is_dir():
        # training.steps raised after a finished or stopped run: it goes on from that run's newest checkpoint
        why = why_stale(chain, stage, paths.adapter_manifest, "training.steps changed") \
            if paths.adapter_manifest.is_file() else "training.steps changed"
        fact = f"{why}: goes on from step {step} to {settings.training.steps}"
        return StageState("adapter", State.PARTIAL, f"{fact} (`gguf-trainer run` continues the run from its newest "
                          "checkpoint)", by_edit=True, fact=fact)
    trained = f"trained to step {step} of {settings.training.steps}"
    partial = StageState("adapter", State.PARTIAL, f"{trained} (checkpoint kept; `gguf-trainer run` resumes from it)",
                         fact=trained) if step else None
    if not paths.adapter_manifest.is_file():
        return partial or StageState("adapter", State.MISSING)
    if damage := record_damage(paths, paths.adapter_manifest):
        return StageState("adapter", State.DAMAGED, damage)
    if recorded_fingerprint(paths.adapter_manifest) == adapter_fp:
        return StageState("adapter", State.DAMAGED, f"{final_weights_stored(paths)} changed on disk since training "
                          "wrote it (`gguf-trainer run` trains again)")
    if older := older_format(paths.adapter_manifest, "adapter"):
        return partial or StageState("adapter", State.STALE, f"the finished adapter was {older}")
    return partial or StageState("adapter", State.STALE, why_stale(
        chain, stage, paths.adapter_manifest, "its train or val shards changed since it was trained"))


def _how_it_ended(paths: ProjectPaths) -> str:
    """The current adapter's end when a lowered training.steps ended it ("ended at step 1740 (training.steps
    lowered to 1600)"), else ""."""
    try:
        return ended_early(finished_meta(final_run_dir(paths))) or ""
    except (OSError, ValueError, KeyError, TypeError):  # RecordPathError included: adapter_is_current read it
        return ""


def _training_blocker(settings: Settings) -> str:
    mode = settings.precompute.mode
    return "" if mode == "teacher+student" else f"precompute.mode is {mode!r}; training needs teacher+student"


ADAPTER_STAGE = Stage(
    "adapter", "Adapter (training)", record=lambda paths, settings: paths.adapter_manifest,
    settings=adapter_stage_settings, state=_adapter_state, blocked_by=_training_blocker,
    # The training run these settings and the shards as planned now make (run_fingerprint).
    fingerprint=lambda chain: run_fingerprint(chain.paths, chain.settings, chain_shard_fingerprints(chain, "train"),
                                              chain_shard_fingerprints(chain, "val")))
