"""How fast and how long: the measured rate of a stage and the time its remaining work takes at that rate.

One place for it: `status`, the studio and the console (the shard step's log, the trainer's log line) all show a
``Pace``. Pure arithmetic on what the pipeline already records (lib/status/pace.py reads those records):
each shard half's busy time (its sidecar's started_at and finished_at) and the trainer's log steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gguf_assets.lib.telemetry.progress import format_seconds, seconds_left


@dataclass(frozen=True)
class Pace:
    """``done`` of ``total`` units (prompts, steps) at a measured ``rate`` (units/s); ``seconds_left``: the time
    the rest takes (its own when the work is of several kinds, as the teacher and student halves are)."""

    what: str
    unit: str
    done: int
    total: int
    rate: float
    seconds_left: float

    def text(self) -> str:
        """e.g. "precompute: 240/600 prompts, 4.50 prompts/s measured, ETA 1m20s"."""
        eta = "done" if self.done >= self.total else format_seconds(self.seconds_left)
        return f"{self.what}: {self.done}/{self.total} {self.unit}, {self.rate:.2f} {self.unit}/s measured, ETA {eta}"


def pace(what: str, unit: str, done: int, total: int, rate: float) -> Pace:
    """The work left at ``rate``: inf while nothing is measured (rate 0), 0 once all is done."""
    return Pace(what, unit, done, total, rate, seconds_left(total - done, rate))


@dataclass(frozen=True)
class BusySpan:
    """One piece of work that was timed: its kind (a shard half: teacher or student), its units and when it ran."""

    kind: str
    units: int
    started_at: float
    finished_at: float

    @property
    def seconds(self) -> float:
        return max(self.finished_at - self.started_at, 0.0)


def busy_seconds(spans: Iterable[BusySpan]) -> float:
    """The time at least one span was running (overlaps count once, gaps between sessions not at all)."""
    total, end = 0.0, -math.inf
    for span in sorted(spans, key=lambda s: s.started_at):
        if span.finished_at > end:
            total += span.finished_at - max(span.started_at, end)
            end = span.finished_at
    return total


def rates_by_kind(spans: list[BusySpan]) -> dict[str, float]:
    """Units per wall second for each kind. Workers running side by side (overlapping spans) each add their speed:
    a kind's rate is its units over its share of the busy time, its spans' seconds divided by how many ran at once
    on average (their seconds over the busy time)."""
    busy = busy_seconds(spans)
    if busy <= 0:
        return {}
    side_by_side = sum(s.seconds for s in spans) / busy
    rates = {}
    for kind in dict.fromkeys(s.kind for s in spans):
        mine = [s for s in spans if s.kind == kind]
        seconds = sum(s.seconds for s in mine)
        if seconds > 0:
            rates[kind] = sum(s.units for s in mine) * side_by_side / seconds
    return rates


def work_pace(what: str, unit: str, spans: list[BusySpan], left: Mapping[str, int], *, done: int,
              total: int) -> Pace | None:
    """The pace of work of several kinds (``left``: units left per kind), from the ``spans`` done so far; None before
    the first span. The rate shown is of whole units (all kinds one after the other: a shard's prompts through the
    teacher, then the student); a kind left with no span of its own makes the ETA unknown."""
    rates = rates_by_kind(spans)
    if not rates:
        return None
    unit_seconds = sum(1 / rate for rate in rates.values())
    seconds = sum(n / rates[kind] if kind in rates else math.inf for kind, n in left.items() if n > 0)
    return Pace(what, unit, done, total, 1 / unit_seconds, seconds)
