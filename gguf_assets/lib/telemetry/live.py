"""What the studio's live panels show, from the figures the pipeline already records (no Dagster import here:
the studio reads the records and passes their metadata in).

Training: the trainer's own numbers. Each log step it emits step, loss, steps/s and the console's ETA
(``eta_s``: the steps left at the rate of this process's steps so far, validations and checkpoints
included), which the adapter asset records as an observation; its validations likewise. The curves are
the training run's history: what its newest checkpoint holds, then the live observations after it.
Precompute: the progress figures each shard half's meter emits (lib/telemetry/progress.py), which
the shard assets record as observations per partition.
"""

from __future__ import annotations

import math

from gguf_assets.lib.telemetry.eta import pace
from gguf_assets.lib.telemetry.progress import format_seconds


def training_progress(latest: dict | None, steps: int, *, saved_step: int = 0, running: bool = True,
                      ended: str | None = None, continues: bool = False) -> dict:
    """The progress bar's figures: the latest log step of the running training (``latest``: its figures), or,
    before its first log step or while nothing trains, ``saved_step`` (the step its newest checkpoint holds).
    ``ended``: how a finished run ended when a lowered training.steps ended it (training_run.ended_early), said
    instead of "finished". ``continues``: the run is a continuation not started yet (training.steps raised after
    a run ended): ``saved_step`` is where the run it continues ended, not a stop."""
    step = int(latest["step"]) if latest else saved_step
    rate = float(latest.get("steps_per_s", 0.0)) if latest else 0.0
    eta_s = latest.get("eta_s") if latest else None
    if eta_s is None and rate > 0:  # a log step recorded before the trainer sent its ETA
        eta_s = pace("training", "steps", step, steps, rate).seconds_left
    eta = format_seconds(float(eta_s)) if eta_s is not None and math.isfinite(float(eta_s)) else "?"
    percent = 100.0 * min(step, steps) / steps if steps else 0.0
    loss = float(latest["loss"]) if latest and "loss" in latest else None
    if latest is not None:
        text = f"step {step}/{steps}, loss {loss:.4f}, {rate:.2f} steps/s, ETA {eta}"
    elif running:
        text = f"step {step}/{steps}: starting (no log step yet)"
    elif ended:
        text, percent = ended, 100.0
    elif step >= steps:
        text = f"finished: {steps}/{steps} steps"
    elif continues:
        text = f"goes on from step {step} to {steps} (training.steps raised): Run continues the run that ended there"
    elif step:
        text = f"stopped at step {step}/{steps} (its checkpoint is kept: Run resumes from it)"
    else:
        text = f"not trained yet with these settings (0/{steps} steps)"
    return {"step": step, "steps": steps, "percent": round(percent, 2), "steps_per_s": round(rate, 3),
            "eta": eta, "loss": loss, "text": text}


def merged_history(saved: list[dict], live: list[dict]) -> list[dict]:
    """The training run's history: ``saved`` (its newest checkpoint's, or final/'s), then the ``live`` entries
    (the running run's observations, oldest first) after its last step. A resumed run repeats no step."""
    last = max((int(e["step"]) for e in saved if "step" in e), default=-1)
    return [*saved, *(e for e in live if "step" in e and int(e["step"]) > last)]


def precompute_progress(observations: list[tuple[str, dict]]) -> list[dict]:
    """One row per split and half, from its newest progress figures (``observations``: (split, figures),
    oldest first): prompts done of total, prompts/s and the ETA."""
    latest: dict[tuple[str, str], dict] = {}
    for split, figures in observations:
        if "half" in figures and "done" in figures and "total" in figures:
            latest[(split, str(figures["half"]))] = figures
    rows = []
    for (split, half), f in latest.items():
        done, total, rate = int(f["done"]), int(f["total"]), float(f.get("prompts_per_s", 0.0))
        eta_s = f.get("eta_s")
        eta = format_seconds(float(eta_s)) if isinstance(eta_s, (int, float)) else "?"
        if done >= total:
            eta = "done"
        rows.append({"split": split, "half": half, "done": done, "total": total,
                     "percent": round(100.0 * done / total, 2) if total else 100.0,
                     "prompts_per_s": round(rate, 3), "eta": eta,
                     "text": f"{split} {half}: {done}/{total} prompts, {rate:.2f} prompts/s, ETA {eta}"})
    return rows
