"""What a training run is: the settings its result depends on and its fingerprint. No torch here:
`status` and the planner compute the fingerprint too (lib/project/pipeline.py)."""

from __future__ import annotations

from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.project import formats
from gguf_assets.lib.project.settings import Settings

# Shards shuffled together (lib/training/train_data.py). Part of the data order, hence of the run fingerprint.
SHUFFLE_WINDOW_SHARDS = 4
# Settings that change speed or bookkeeping, not the trained weights.
NON_RESULT_KEYS = ("device", "grad_checkpoint", "log_every", "validate_every", "checkpoint_every", "keep_checkpoints")
# Result settings added after runs existed, with the value that means "as before": they enter the
# fingerprint only when set otherwise, so a new key never retrains an existing project.
OFF_VALUES = {"ema_decay": 0.0}


def training_settings(settings: Settings) -> dict:
    """The training settings the result depends on (cadence and device settings change nothing).

    A key of OFF_VALUES at its off value is left out: the result is what it was before the key existed.
    """
    return {k: v for k, v in settings.section_dict("training").items()
            if k not in NON_RESULT_KEYS and not (k in OFF_VALUES and v == OFF_VALUES[k])}


def training_fingerprint(settings: Settings, train_fps: list[str], val_fps: list[str]) -> str:
    return atomic.fingerprint({"training": training_settings(settings), "train": train_fps, "val": val_fps,
                               "shuffle_window_shards": SHUFFLE_WINDOW_SHARDS, "format": formats.TRAINING_RUN})


def shards_identity(folders: list[Path]) -> str:
    """What the shards hold (their recorded half fingerprints), to tell a data change from a settings change."""
    parts = []
    for folder in folders:
        parts.append([folder.name] + [atomic.read_json(folder / f"{half}.json").get("fingerprint")
                                      for half in ("teacher", "student") if (folder / f"{half}.json").is_file()])
    return atomic.fingerprint(parts)
