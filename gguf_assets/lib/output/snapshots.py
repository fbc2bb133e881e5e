"""Snapshots: a usable GGUF of the adapter at any step, while training runs or after it stopped or finished.

`gguf-trainer snapshot DIR [--step N | --best] [--eval]` (and the studio's Snapshot button) take:
- **newest** (the default): while the run trains, the trainer keeps its current step at once (validated and
  checkpointed, a few seconds; the run goes on unchanged, lib/training/kept_steps.py); after a stop, the newest
  checkpoint; after the end, the final weights;
- **best**: the best validated weights so far (best/);
- **step N**: a kept step (training.keep_steps_*), or a checkpoint still on disk; anything else is refused with the
  steps that are kept.

Every source but best goes through a kept step (the judged weights, validated at that step) and is exported from
it, so a GGUF made later from a kept step is byte-identical to the snapshot taken at that step. The file is
``<output>/<adapter name>-step<N>.gguf`` (``-best-step<N>`` for best) in ggk's format, its provenance naming the
trained and planned steps, the weights it holds (``step<N>`` or ``best``) and their val scores; ``--eval`` scores it
on the val shards as the export's evaluation does (on the CPU: the torch-free evaluator). The run's snapshots are
listed in ``checkpoints/<run>/snapshots.json`` (`runs` and the studio show them).
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.metrics import EMPTY_PROMPT_COSINE, VAL_CENTRED_COSINE, VAL_LOSS
from gguf_assets.lib.output.snapshot_names import remove_dead_snapshot_temps, snapshot_path  # noqa: F401
from gguf_assets.lib.project.layout import BEST_DIR, FINAL_DIR, META_FILE, STATE_FILE, WEIGHTS_FILE, ProjectPaths
from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.training import kept_steps as kept
from gguf_assets.lib.training.training_run import RunOutcome, read_session, session_alive

log = logging.getLogger(__name__)

SNAPSHOTS_FILE = "snapshots.json"
NEWEST, BEST = "newest", "best"
# How long a snapshot waits for the running trainer to reach the end of its step (a step of a big adapter on a
# small GPU takes seconds; validation of a large val set, a minute).
ANSWER_TIMEOUT_S = 600.0


class SnapshotError(UserError, RuntimeError):
    """A snapshot that cannot be taken; the message says why and what to do."""


@dataclass(frozen=True)
class Source:
    """Where a snapshot's weights come from: a kept step, or best/."""

    folder: Path
    step: int
    weights_name: str  # what the GGUF's provenance calls them: step<N> or best
    asked: str  # what the user asked for: newest, best, step<N>


def read_snapshots(run_dir: Path) -> list[dict]:
    try:
        doc = atomic.read_json(run_dir / SNAPSHOTS_FILE)
    except (OSError, ValueError):
        return []
    return doc.get("snapshots", []) if isinstance(doc, dict) else []


def _write_snapshots(run_dir: Path, entries: list[dict]) -> None:
    atomic.write_json(run_dir / SNAPSHOTS_FILE, {"snapshots": sorted(entries, key=lambda e: (e["step"], e["file"]))})


def training_is_running(run_dir: Path) -> bool:
    session = read_session(run_dir)
    return bool(session) and session.get("state") == RunOutcome.RUNNING and session_alive(session) is not False


def _checkpoint_steps(run_dir: Path) -> dict[int, Path]:
    from gguf_assets.lib.training.checkpoints import list_checkpoints

    return {int(atomic.read_json(p / META_FILE)["step"]): p for p in list_checkpoints(run_dir)}


def _final_step(run_dir: Path) -> int | None:
    try:
        return int(atomic.read_json(run_dir / FINAL_DIR / META_FILE)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def available_steps(run_dir: Path) -> list[int]:
    """The steps a snapshot can be taken at now: kept steps, checkpoints on disk and the final step."""
    steps = set(kept.kept_steps(run_dir)) | set(_checkpoint_steps(run_dir))
    if (final := _final_step(run_dir)) is not None:
        steps.add(final)
    return sorted(steps)


def _keep_from(run_dir: Path, step: int, settings: Settings, val_folders: list[Path]) -> None:
    """Make a kept step of ``step`` from a checkpoint or final/ (its judged weights, validated as the trainer
    validates: the same figures, so the GGUF is the one a snapshot at that step gives)."""
    import torch
    from safetensors.torch import load as safetensors_load

    from gguf_assets.lib.training.adapter import Adapter, AdapterShape
    from gguf_assets.lib.training.checkpoints import read_recorded, save_weights
    from gguf_assets.lib.training.input_peaks import INPUT_PEAKS
    from gguf_assets.lib.training.train import evaluate

    final = _final_step(run_dir)
    folder = run_dir / FINAL_DIR if final == step else _checkpoint_steps(run_dir)[step]
    meta = atomic.read_json(folder / META_FILE)
    weights = safetensors_load(read_recorded(folder, WEIGHTS_FILE, meta))
    if folder.name != FINAL_DIR and meta.get("training", {}).get("ema_decay"):
        # A checkpoint holds the raw weights; the judged ones (the average) travel in its trainer state.
        state = torch.load(io.BytesIO(read_recorded(folder, STATE_FILE, meta)), weights_only=True, map_location="cpu")
        weights = state["ema"]
    model = Adapter(AdapterShape(**meta["shape"]))
    model.load_state_dict(weights)
    t = settings.training
    scores = evaluate(model, val_folders, device=torch.device("cpu"), cosine_weight=t.cosine_weight,
                      relational_weight=t.relational_weight)
    base = {k: v for k, v in meta.items() if k not in ("history", "sha256", "best", "per_shard", "verdict", "advice")}
    save_weights(kept.kept_step_dir(run_dir, step), model=model, step=step,
                 meta={**base, "step": step, "planned_steps": meta.get("planned_steps", t.steps),
                       "kept_by": kept.BY_REQUEST, VAL_CENTRED_COSINE: scores[VAL_CENTRED_COSINE],
                       EMPTY_PROMPT_COSINE: scores[EMPTY_PROMPT_COSINE], VAL_LOSS: scores[VAL_LOSS],
                       INPUT_PEAKS: scores[INPUT_PEAKS]})


def resolve_source(run_dir: Path, settings: Settings, val_folders: list[Path], *, step: int | None = None,
                   best: bool = False, wait_s: float = ANSWER_TIMEOUT_S, say=log.info) -> Source:
    """The weights a snapshot takes (the module's docstring), kept first where they are not yet."""
    if best:
        if not (run_dir / BEST_DIR / META_FILE).is_file():
            raise SnapshotError("no validated weights yet (best/ is written at the first validation): take the "
                                "newest step instead, or wait for training.validate_every")
        meta = atomic.read_json(run_dir / BEST_DIR / META_FILE)
        return Source(run_dir / BEST_DIR, int(meta["step"]), BEST, BEST)
    asked = NEWEST if step is None else f"step{step}"
    if step is None and training_is_running(run_dir):
        request = kept.ask(run_dir)
        say("asked the running trainer to keep its current step (it validates and checkpoints, then goes on)")
        step = kept.wait_for_answer(run_dir, request, still_training=lambda: training_is_running(run_dir),
                                    timeout_s=wait_s)
        if step is None:
            if training_is_running(run_dir):
                raise SnapshotError(f"the trainer did not answer within {wait_s:.0f} s (a step or a validation "
                                    "takes that long?); try again, or take --best")
            return resolve_source(run_dir, settings, val_folders, step=None, wait_s=wait_s, say=say)
        return Source(kept.kept_step_dir(run_dir, step), step, f"step{step}", asked)
    if step is None:
        steps = available_steps(run_dir)
        if not steps:
            raise SnapshotError("this training run has no checkpoint yet: wait for training.checkpoint_every, or "
                                "for the run to start")
        step = steps[-1]
    if step not in kept.kept_steps(run_dir):
        if step not in available_steps(run_dir):
            listed = ", ".join(map(str, available_steps(run_dir))) or "none"
            raise SnapshotError(f"step {step} is not kept: the steps a snapshot can take are {listed}. Keep more "
                                "with training.keep_steps_every (and _from, _to, _last) before the run")
        _keep_from(run_dir, step, settings, val_folders)
    return Source(kept.kept_step_dir(run_dir, step), step, f"step{step}", asked)


def take_snapshot(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, run_dir: Path, *,
                  val_folders: list[Path], step: int | None = None, best: bool = False, evaluate: bool = False,
                  wait_s: float = ANSWER_TIMEOUT_S, say=log.info) -> dict:
    """Export a snapshot GGUF (and score it with ``evaluate``); returns its entry in the run's snapshots.json."""
    from gguf_assets.lib.output.export import check_file_name, peaks_device, provenance, write_adapter_file
    from gguf_assets.lib.training.adapter import Adapter, AdapterShape
    from gguf_assets.lib.training.checkpoints import read_recorded

    name = check_file_name(settings.output.adapter_name)
    source = resolve_source(run_dir, settings, val_folders, step=step, best=best, wait_s=wait_s, say=say)
    meta = atomic.read_json(source.folder / META_FILE)
    from safetensors.torch import load as safetensors_load

    model = Adapter(AdapterShape(**meta["shape"]))
    model.load_state_dict(safetensors_load(read_recorded(source.folder, WEIGHTS_FILE, meta)))
    model.eval()
    target = snapshot_path(paths.output_dir(settings), name, source.step, best=source.weights_name == BEST)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(target.parent, of=[target.name])
    summary = write_adapter_file(target, model, meta, name=f"{name}-step{source.step}", val_folders=val_folders,
                                 provenance=provenance(settings, materials, meta, checkpoint=source.weights_name),
                                 device=peaks_device(settings))
    entry = {"file": paths.stored(target), "step": source.step,
             "planned_steps": meta.get("planned_steps", settings.training.steps), "weights": source.weights_name,
             "asked": source.asked, VAL_CENTRED_COSINE: meta.get(VAL_CENTRED_COSINE),
             EMPTY_PROMPT_COSINE: meta.get(EMPTY_PROMPT_COSINE), VAL_LOSS: meta.get(VAL_LOSS),
             **verify.record(target, summary.sha256), "at": round(time.time(), 1)}
    if evaluate:
        entry["eval"] = evaluate_snapshot(target, val_folders, source.folder / WEIGHTS_FILE)
    entries = [e for e in read_snapshots(run_dir) if e["file"] != entry["file"] or e["weights"] != entry["weights"]]
    _write_snapshots(run_dir, [*entries, entry])
    return entry


def evaluate_snapshot(gguf: Path, val_folders: list[Path], weights: Path) -> dict:
    """The GGUF scored on the val shards as the export's evaluation scores it (torch-free, on the CPU), centred on
    the run's target centre (``weights``: any of the run's weights files carries it)."""
    from gguf_assets.lib.output.gguf_eval import evaluate_gguf, training_centre

    result = evaluate_gguf(gguf, val_folders, training_centre(weights))
    return {k: v for k, v in result.items() if isinstance(v, int | float) or v is None}


def snapshot_file(paths: ProjectPaths, run_dir: Path, entry: dict, output_dir: Path) -> Path:
    """The GGUF a snapshots.json entry names, confined to the output folder (RecordPathError otherwise: the record
    may come with a received project)."""
    return paths.inside(entry.get("file"), record=run_dir / SNAPSHOTS_FILE, under=output_dir)


def delete_snapshot(paths: ProjectPaths, run_dir: Path, step: int, *, output_dir: Path) -> list[str]:
    """Delete the snapshot GGUF(s) of ``step`` and their entries; returns the files removed. Every file is checked
    to be in ``output_dir`` before any is deleted."""
    entries = read_snapshots(run_dir)
    chosen = [e for e in entries if e["step"] == step]
    if not chosen:
        raise SnapshotError(f"no snapshot of step {step} in this run (snapshots: "
                            f"{', '.join(str(e['step']) for e in entries) or 'none'})")
    files = [snapshot_file(paths, run_dir, e, output_dir) for e in chosen]  # all confined, or nothing is deleted
    for file in files:
        file.unlink(missing_ok=True)
    _write_snapshots(run_dir, [e for e in entries if e["step"] != step])
    return [e["file"] for e in chosen]
