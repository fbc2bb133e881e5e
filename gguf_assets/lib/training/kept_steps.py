"""Kept steps and snapshot requests: the adapter as it was at a step, kept for a GGUF later. No torch here:
`gguf-trainer snapshot`, `runs` and the studio read it.

    checkpoints/<run>/steps/step-XXXXXXXX/    adapter.safetensors (the judged weights: the average when
                                              training.ema_decay is on) and meta.json (step, planned steps, the
                                              val scores measured at that step, why it was kept)
    checkpoints/<run>/snapshot-request.<id>.json   a snapshot asked of the running trainer (one file per asker)
    checkpoints/<run>/snapshot-answer.<id>.json    the trainer's answer: the step it kept for that request
                                                   (read, then removed, by its asker)

Requests queue: two askers at once (the studio's Snapshot and a `gguf-trainer snapshot`) each write their own file,
and the trainer answers every request pending at the end of a step with that step.

A kept step is written by the trainer (lib/training/train.py) on the training.keep_steps_* schedule, and at each
snapshot request, in one format, so a GGUF exported later from a kept step is byte-identical to the snapshot taken
at that step (lib/output/snapshots.py). Keeping a step validates the judged weights without touching the run's
history, best weights or data order: the run's result is the same with or without it.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.project.layout import META_FILE, STEP_DIR, WEIGHTS_FILE

KEPT_STEPS_DIR = "steps"
REQUEST_PREFIX, ANSWER_PREFIX = "snapshot-request.", "snapshot-answer."
REQUEST_FILE = "snapshot-request.json"  # a request written before they queued: still answered
BY_SCHEDULE, BY_REQUEST = "schedule", "snapshot"


def kept_step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / KEPT_STEPS_DIR / f"step-{step:08d}"


def kept_steps(run_dir: Path) -> list[int]:
    """The steps kept on disk (whole: their meta written last), oldest first."""
    folder = run_dir / KEPT_STEPS_DIR
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir()
                  if (m := STEP_DIR.match(p.name)) and (p / META_FILE).is_file() and (p / WEIGHTS_FILE).is_file())


def kept_step_meta(run_dir: Path, step: int) -> dict:
    return atomic.read_json(kept_step_dir(run_dir, step) / META_FILE)


def is_scheduled(step: int, *, every: int, first: int, last: int, planned: int) -> bool:
    """Whether the training.keep_steps_* schedule keeps ``step`` (every N steps inside [from, to or the end])."""
    return bool(every) and step % every == 0 and step >= max(first, 1) and step <= (last or planned)


def scheduled_steps(*, every: int, first: int, last: int, planned: int, newest: int = 0) -> list[int]:
    """The steps the schedule keeps over a run of ``planned`` steps, the newest ``newest`` of them (0: all)."""
    if not every:
        return []
    steps = [s for s in range(every, planned + 1, every) if is_scheduled(s, every=every, first=first, last=last,
                                                                         planned=planned)]
    return steps[-newest:] if newest else steps


def prune_scheduled(run_dir: Path, keep: int) -> list[int]:
    """Hold only the newest ``keep`` steps the schedule kept (0: all); steps kept for a snapshot stay. Returns
    the steps removed."""
    if not keep:
        return []
    scheduled = [s for s in kept_steps(run_dir) if kept_step_meta(run_dir, s).get("kept_by") == BY_SCHEDULE]
    removed = scheduled[:-keep]
    for step in removed:
        remove_kept_step(run_dir, step)
    return removed


def remove_kept_step(run_dir: Path, step: int) -> None:
    """Renamed to a temp name first (a kill mid-way leaves a temp folder the next write clears, never half a
    kept step), then deleted."""
    folder = kept_step_dir(run_dir, step)
    doomed = folder.with_name(atomic.TEMP_PREFIX + folder.name)
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# -- asking the running trainer ------------------------------------------------------------------------------

def _request_file(run_dir: Path, request: str) -> Path:
    return run_dir / f"{REQUEST_PREFIX}{request}.json"


def _answer_file(run_dir: Path, request: str) -> Path:
    return run_dir / f"{ANSWER_PREFIX}{request}.json"


def ask(run_dir: Path) -> str:
    """Ask the trainer of ``run_dir`` to keep its current step; returns the request's id."""
    request = uuid.uuid4().hex
    atomic.write_json(_request_file(run_dir, request), {"id": request, "at": round(time.time(), 3)})
    return request


def asked(run_dir: Path) -> list[str]:
    """The pending requests' ids (the trainer checks at every step: one listing of the run's folder)."""
    try:
        names = [entry.name for entry in os.scandir(run_dir)]
    except OSError:
        return []
    pending = [n[len(REQUEST_PREFIX):-len(".json")] for n in names
               if n.startswith(REQUEST_PREFIX) and n.endswith(".json") and n != REQUEST_FILE]
    if REQUEST_FILE in names:
        try:
            pending.append(str(atomic.read_json(run_dir / REQUEST_FILE)["id"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # being written: the next step reads it
    return sorted(pending)


def answer(run_dir: Path, requests: list[str], step: int) -> None:
    """The trainer kept ``step`` for ``requests``: each answer first, then its request goes."""
    for request in requests:
        atomic.write_json(_answer_file(run_dir, request), {"id": request, "step": step, "at": round(time.time(), 3)})
        _request_file(run_dir, request).unlink(missing_ok=True)
    legacy = run_dir / REQUEST_FILE
    if legacy.exists():
        legacy.unlink(missing_ok=True)


def wait_for_answer(run_dir: Path, request: str, *, still_training: Callable[[], bool], timeout_s: float,
                    poll_s: float = 0.2) -> int | None:
    """The step the trainer kept for ``request``; None when training ended first or ``timeout_s`` passed (the
    request is then withdrawn, so a later run does not act on it)."""
    deadline = time.monotonic() + timeout_s
    answer_file = _answer_file(run_dir, request)
    while time.monotonic() < deadline:
        try:
            step = int(atomic.read_json(answer_file)["step"])
            answer_file.unlink(missing_ok=True)
            return step
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if not still_training():
            break
        time.sleep(poll_s)
    _request_file(run_dir, request).unlink(missing_ok=True)
    return None
