"""The measured speed and ETA of the precompute and of training, read from what they record (lib/telemetry/eta.py
does the arithmetic): `status`, the studio and the shard step's console line show these.

Precompute: each current shard half's sidecar holds when it was computed (started_at, finished_at) and its
prompts; the halves not current are the work left, over both splits. Training: the running session records the
step and this process's steps/s at each log step; a stopped run's newest checkpoint holds its last log step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.precompute.half_state import HalfState
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.status.stages import SHARD_STAGES
from gguf_assets.lib.status.states import ProjectView, StageState, State, planned_view
from gguf_assets.lib.telemetry.eta import BusySpan, Pace, pace, rates_by_kind, work_pace
from gguf_assets.lib.training.training_run import (
    SESSION_RUNNING,
    last_checkpoint_step,
    newest_meta,
    read_session,
    session_alive,
)

PACE_NOT_YET = (OSError, ValueError, KeyError, TypeError, UserError)  # no materials or corpus yet: nothing to measure


def pace_view(paths: ProjectPaths, settings: Settings, view: ProjectView | None = None) -> ProjectView | None:
    """What the paces are measured from: ``view`` when it planned the shards (status_view's, or the shard step's),
    else the shards planned now (a project blocked before them is measured as its corpus is); None without
    materials or corpus."""
    if view is not None and view.splits is not None:
        return view
    try:
        return planned_view(paths, settings)
    except PACE_NOT_YET:
        return None


def precompute_pace(paths: ProjectPaths, settings: Settings, view: ProjectView | None = None) -> Pace | None:
    """Prompts/s and the ETA of the whole precompute (every split, every half the mode makes), from the first
    computed shard half on; None before it, or when nothing is left. ``view``: this question's status_view, whose
    shard plans and half states are used instead of reading them again."""
    planned = pace_view(paths, settings, view)
    return None if planned is None else _precompute_pace(paths, planned)


def _precompute_pace(paths: ProjectPaths, view: ProjectView) -> Pace | None:
    spans, left, done, total = [], {}, 0, 0
    for split in view.splits.values():
        for plan in split.plans:
            prompts = len(plan.prompts)
            total += prompts
            states = split.halves[plan.key]
            for half, state in states.items():
                if state != HalfState.CURRENT:
                    left[half] = left.get(half, 0) + prompts
                elif (span := _busy_span(plan.folder(paths) / f"{half}.json", half)) is not None:
                    spans.append(span)
            done += prompts if set(states.values()) == {HalfState.CURRENT} else 0
    if not left:
        return None
    return work_pace("precompute", "prompts", spans, left, done=done, total=total)


def _busy_span(sidecar, half: str) -> BusySpan | None:
    """When a half was computed, from its sidecar (halves written before sidecars recorded it have no span)."""
    try:
        meta = atomic.read_json(sidecar)
        return BusySpan(half, int(meta["prompts"]), float(meta["started_at"]), float(meta["finished_at"]))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class MeasuredRate:
    """Units per second this machine managed, and what it was measured on, in words."""

    per_second: float
    source: str


def precompute_rate(paths: ProjectPaths, view: ProjectView) -> MeasuredRate | None:
    """This machine's prompts/s through the whole precompute (every half the mode makes, one after the other), from
    the sidecars of the shard halves this project computed, current or not (a stale half still timed this machine);
    None while a half the mode makes has no timed shard."""
    spans, kinds = [], set()
    for split in view.splits.values():
        for plan in split.plans:
            for half in split.halves[plan.key]:
                kinds.add(half)
                if (span := _busy_span(plan.folder(paths) / f"{half}.json", half)) is not None:
                    spans.append(span)
    rates = rates_by_kind(spans)
    if not kinds or set(rates) != kinds:
        return None
    return MeasuredRate(1 / sum(1 / rate for rate in rates.values()),
                        f"{len(spans)} shard halves it computed in this project")


def training_pace(paths: ProjectPaths, settings: Settings, view: ProjectView | None = None) -> Pace | None:
    """Steps/s and the ETA of the training these settings make, from its first log step on: the running session's
    last log step while its process trains, else the newest checkpoint's step at the rate of the last log step it
    holds; None before any, or once it finished.
    ``view``: this question's status_view, whose adapter fingerprint is used instead of planning the shards again."""
    planned = pace_view(paths, settings, view)
    return None if planned is None else _training_pace(paths, settings, planned.adapter_fp)


def _training_pace(paths: ProjectPaths, settings: Settings, adapter_fp: str) -> Pace | None:
    run_dir = paths.checkpoints_dir(adapter_fp)
    steps = settings.training.steps
    session = read_session(run_dir) or {}
    # A session whose process is gone (a kill -9, a reboot) still reads "running": the next run resumes from its
    # checkpoint, which is what is told then, not the step the dead process had reached.
    if session.get("state") == SESSION_RUNNING and "steps_per_s" in session and session_alive(session) is not False:
        return pace("training", "steps", int(session["step"]), steps, float(session["steps_per_s"]))
    meta = newest_meta(run_dir) or {}
    if meta.get("finished") is True:
        return None
    logged = [e for e in meta.get("history") or [] if "steps_per_s" in e]
    if not logged:
        return None
    return pace("training", "steps", last_checkpoint_step(paths, run_dir.name), steps,
                float(logged[-1]["steps_per_s"]))


def stage_paces(paths: ProjectPaths, settings: Settings, stages: list[StageState],
                view: ProjectView | None = None) -> list[Pace]:
    """The paces `status` and the studio show under the stages: the precompute's while shards are left to make, and
    training's while the adapter is trained part way or trains now. ``view``: the status_view ``stages`` came from
    (its plans are used; without it, or when it stopped before the shards, they are planned here, once)."""
    state = {s.stage: s.state for s in stages}
    wants_precompute = any(state.get(stage) not in (None, State.CURRENT, State.BLOCKED) for stage in SHARD_STAGES)
    wants_training = state.get("adapter") in (State.PARTIAL, State.RUNNING)
    planned = pace_view(paths, settings, view) if wants_precompute or wants_training else None
    if planned is None:
        return []
    paces = [_precompute_pace(paths, planned) if wants_precompute else None,
             _training_pace(paths, settings, planned.adapter_fp) if wants_training else None]
    return [p for p in paces if p is not None]


def pace_lines(paths: ProjectPaths, settings: Settings, stages: list[StageState],
               view: ProjectView | None = None) -> list[str]:
    """stage_paces as `status` prints them, a line each."""
    return [p.text() for p in stage_paces(paths, settings, stages, view)]
