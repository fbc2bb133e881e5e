"""What a training run is: the settings its result depends on, its fingerprint and whether the adapter on disk
is current. No torch here: `status` and the planner compute the fingerprint too (lib/status/)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.precompute.shards import shard_fingerprints
from gguf_assets.lib.project import formats
from gguf_assets.lib.project.layout import FINAL_DIR, STEP_DIR, WEIGHTS_FILE, ProjectPaths
from gguf_assets.lib.project.manifests import MaterialsManifest, recorded
from gguf_assets.lib.project.settings import Settings

# Shards shuffled together (lib/training/train_data.py). Part of the data order, hence of the run fingerprint.
SHUFFLE_WINDOW_SHARDS = 4
# Settings that change speed or bookkeeping, not the trained weights.
NON_RESULT_KEYS = ("device", "grad_checkpoint", "log_every", "validate_every", "checkpoint_every", "keep_checkpoints")
# Result settings added after runs existed, with the value that means "as before": they enter the
# fingerprint only when set otherwise, so a new key never retrains an existing project.
OFF_VALUES = {"ema_decay": 0.0, "target_standardization": "per_row_dim", "relational_weight": 0.0}


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
    planned from the corpus: callers that planned them already call training_fingerprint)."""
    return training_fingerprint(settings, shard_fingerprints(paths, settings, materials, "train"),
                                shard_fingerprints(paths, settings, materials, "val"))


def adapter_is_current(paths: ProjectPaths, adapter_fp: str) -> bool:
    """The adapter manifest names this fingerprint, and the finished weights are still as written."""
    try:
        manifest = atomic.read_json(paths.adapter_manifest)
    except (OSError, ValueError):
        return False
    if manifest.get("fingerprint") != adapter_fp:
        return False
    weights = paths.root / manifest["run_dir"] / FINAL_DIR / WEIGHTS_FILE
    recorded_weights = manifest.get("final_weights")
    return verify.unchanged(weights, recorded_weights) if recorded_weights else weights.is_file()


def last_checkpoint_step(paths: ProjectPaths, adapter_fp: str) -> int:
    """The step of the newest checkpoint of the training run ``adapter_fp`` (0: none)."""
    run_dir = paths.checkpoints_dir(adapter_fp)
    steps = [int(m.group(1)) for d in (run_dir.iterdir() if run_dir.is_dir() else []) if (m := STEP_DIR.match(d.name))]
    return max(steps, default=0)


def final_weights_stored(paths: ProjectPaths) -> str:
    """Where the adapter manifest says the finished weights are, as stored (relative to the project)."""
    run_dir = recorded(paths.adapter_manifest, "run_dir") or "checkpoints/<run>"
    return f"{run_dir}/{FINAL_DIR}/{WEIGHTS_FILE}"


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
