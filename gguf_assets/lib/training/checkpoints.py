"""Checkpoints of a training run: all-or-nothing folders whose meta records each file's sha256.

    checkpoints/<fingerprint>/step-XXXXXXXX/   the last ``keep_checkpoints`` checkpoints
    checkpoints/<fingerprint>/best/            the best validated weights
    checkpoints/<fingerprint>/final/           the finished adapter (what export reads)
    checkpoints/<fingerprint>/curves.svg       loss and val-cosine curves, kept current

A resume takes the newest intact checkpoint (``restore``); a damaged one is skipped, and the
data order and RNG continue exactly from the older one, so the final weights are the same.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file

from gguf_assets.lib.core import atomic, faults, verify
from gguf_assets.lib.project.layout import DAMAGED_FINAL_DIR, FINAL_DIR, META_FILE, STATE_FILE, STEP_DIR, WEIGHTS_FILE
from gguf_assets.lib.training.adapter import (
    Adapter,
    AdapterShape,
)
from gguf_assets.lib.training.train_data import TrainingError

log = logging.getLogger(__name__)



def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _check_finite(model: Adapter, step: int) -> None:
    for name, p in model.state_dict().items():
        if not torch.isfinite(p).all():
            raise TrainingError(f"step {step}: parameter {name} is not finite; no checkpoint was written.")


def _weights(model: Adapter) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def save_checkpoint(folder: Path, *, model: Adapter, optimizer: torch.optim.Optimizer, step: int, meta: dict,
                    ema: Adapter | None = None) -> None:
    """Weights, optimizer, RNG, step (which fixes the data position and the lr), settings; all or nothing.

    ``adapter.safetensors`` holds the raw weights, the ones training continues from; the weight
    average, when on, travels in ``trainer_state.pt`` (key "ema"). The meta, written last,
    records each file's sha256, so a resume can tell a damaged checkpoint.
    """
    _check_finite(model, step)
    state = {"optimizer": optimizer.state_dict(), "rng": _rng_state(), "step": step}
    if ema is not None:  # absent when off, so such checkpoints are byte for byte what they were
        _check_finite(ema, step)
        state["ema"] = _weights(ema)
    with atomic.atomic_dir(folder) as tmp:
        save_file(_weights(model), str(tmp / WEIGHTS_FILE))
        torch.save(state, tmp / STATE_FILE)
        faults.point("checkpoint-save", tmp / STATE_FILE)
        (tmp / META_FILE).write_text(json.dumps({**meta, "step": step, **_file_hashes(tmp, WEIGHTS_FILE, STATE_FILE)},
                                                indent=2, sort_keys=True))


def save_weights(folder: Path, *, model: Adapter, step: int, meta: dict, extra: dict[str, str] | None = None) -> None:
    """Weights and meta only (best/ and final/), all or nothing; the meta records the weights' sha256."""
    _check_finite(model, step)
    with atomic.atomic_dir(folder) as tmp:
        save_file(_weights(model), str(tmp / WEIGHTS_FILE))
        (tmp / META_FILE).write_text(json.dumps({**meta, **_file_hashes(tmp, WEIGHTS_FILE)}, indent=2, sort_keys=True))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")


def _file_hashes(folder: Path, *names: str) -> dict:
    return {"sha256": {name: atomic.sha256_file(folder / name) for name in names}}


def read_recorded(folder: Path, name: str, meta: dict) -> bytes:
    """A checkpoint file's bytes, checked against the sha256 its meta recorded (older checkpoints have none)."""
    return verify.read_checked(folder / name, (meta.get("sha256") or {}).get(name), what_to_do="")


def list_checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("step-*") if STEP_DIR.match(p.name) and (p / META_FILE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    steps = list_checkpoints(run_dir)
    return steps[-1] if steps else None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    steps = sorted(p for p in run_dir.glob("step-*") if STEP_DIR.match(p.name))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class Resumed:
    step: int = 0
    history: list = field(default_factory=list)
    best: dict | None = None
    untrained: float | None = None
    started: dict = field(default_factory=dict)
    checkpoint: str | None = None
    ema: dict | None = None
    train_seconds: float = 0.0  # the wall time of the sessions before, up to this checkpoint
    started_at: float | None = None  # when step 0 began (unix time)


def restore(run_dir: Path, model: Adapter, optimizer: torch.optim.Optimizer, device: torch.device,
             shape: AdapterShape, *, ema: bool = False) -> Resumed | None:
    """Load the newest intact checkpoint; a damaged or unreadable one is skipped with a warning.

    Intact means each file's bytes match the sha256 its meta recorded. Falling back costs only
    the steps since the older checkpoint: the data order and RNG resume exactly from it, so
    the final weights are the same.
    """
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            meta = atomic.read_json(ckpt / META_FILE)
            if meta.get("shape") != shape.to_dict():
                raise TrainingError(f"{ckpt}: adapter shape {meta.get('shape')} differs from {shape.to_dict()}")
            weights = {k: v.to(device) for k, v in safetensors_load(read_recorded(ckpt, WEIGHTS_FILE, meta)).items()}
            state = torch.load(io.BytesIO(read_recorded(ckpt, STATE_FILE, meta)), weights_only=True,
                               map_location=device)
            if ema and "ema" not in state:
                raise TrainingError(f"{ckpt}: no weight average in {STATE_FILE}, though training.ema_decay is on")
        except Exception as exc:  # any damaged or unreadable file: fall back to the previous checkpoint
            log.warning("checkpoint %s is damaged, so it is not used (%s); trying an older one", ckpt.name, exc)
            continue
        model.load_state_dict(weights)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["rng"]["cuda"]])
        return Resumed(step=meta["step"], history=meta.get("history", []), best=meta.get("best"),
                        untrained=meta.get("untrained"), started=meta.get("started", {}), checkpoint=ckpt.name,
                        ema=state.get("ema") if ema else None, train_seconds=float(meta.get("train_seconds") or 0.0),
                        started_at=meta.get("started_at"))
    return None


def load_final(run_dir: Path) -> tuple[Adapter, dict]:
    """The finished adapter, its weights checked against the sha256 recorded when training ended.

    Damaged weights are moved aside (final.damaged), so the adapter counts as unfinished and the
    next run trains the last steps again from the newest intact checkpoint.
    """
    meta = atomic.read_json(run_dir / FINAL_DIR / META_FILE)
    try:
        weights = safetensors_load(read_recorded(run_dir / FINAL_DIR, WEIGHTS_FILE, meta))
    except verify.CorruptFile as exc:
        set_aside_final(run_dir)
        raise TrainingError(f"{exc} It was moved to {run_dir / DAMAGED_FINAL_DIR}; `gguf-trainer run` trains "
                            "the last steps again from the newest intact checkpoint: same weights.") from exc
    model = Adapter(AdapterShape(**meta["shape"]))
    model.load_state_dict(weights)
    return model.eval(), meta


def set_aside_final(run_dir: Path) -> None:
    damaged = run_dir / DAMAGED_FINAL_DIR
    if damaged.exists():
        shutil.rmtree(damaged)
    os.replace(run_dir / FINAL_DIR, damaged)
    atomic.fsync_dir(run_dir)


def final_is_intact(run_dir: Path) -> bool:
    """Whether final/ holds finished weights whose bytes match their recorded sha256 (they are small)."""
    try:
        meta = atomic.read_json(run_dir / FINAL_DIR / META_FILE)
        read_recorded(run_dir / FINAL_DIR, WEIGHTS_FILE, meta)
    except (OSError, ValueError):
        return False
    return True
