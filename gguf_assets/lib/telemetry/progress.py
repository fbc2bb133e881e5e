"""Progress of a long step: done/total, prompts/s, tokens/s and an ETA that reused work does not fool."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PROGRESS_LOG_INTERVAL_S = 15.0


def format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def seconds_left(left: float, rate: float) -> float:
    """The time ``left`` units take at ``rate`` units/s: 0 when none are left, inf while no rate is measured."""
    if left <= 0:
        return 0.0
    return left / rate if rate > 0 else math.inf


class Progress:
    """Progress, prompts/s, tokens/s and ETA of a long step, logged at most every `log_every_s`.

    `advance` counts computed work (it sets the rate); `skip` counts work found already
    done (it moves the progress but not the rate, so the ETA is not fooled by reused shards).
    The rate is measured from the end of the first computed batch, so the time spent loading a
    model before it does not make the first ETAs hours long.
    """

    def __init__(self, label: str, total: int, *, log_every_s: float = PROGRESS_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, emit: Callable[[str], None] | None = None) -> None:
        self.label, self.total = label, total
        self.log_every_s, self.clock = log_every_s, clock
        self.emit = emit or log.info
        self.done = self.computed = self.tokens = 0
        self.start = clock()
        self._last_log = self.start
        self._first: tuple[float, int, int] | None = None  # (when, prompts, tokens) of the first batch

    def figures(self) -> dict[str, float]:
        now = self.clock()
        elapsed = max(now - self.start, 1e-9)
        left = self.total - self.done
        rate = token_rate = 0.0
        if self._first is not None and now > self._first[0]:
            span = now - self._first[0]
            rate, token_rate = (self.computed - self._first[1]) / span, (self.tokens - self._first[2]) / span
        return {"done": self.done, "total": self.total, "seconds": round(elapsed, 3),
                "prompts_per_s": round(rate, 3), "tokens_per_s": round(token_rate, 1),
                "eta_s": round(seconds_left(left, rate), 1)}

    def line(self) -> str:
        f = self.figures()
        pct = 100 * self.done / self.total if self.total else 100.0
        head = f"{self.label}: {self.done}/{self.total} prompts ({pct:.0f}%)"
        if self.computed == 0:
            return f"{head}, already current"
        if f["prompts_per_s"] <= 0:
            return f"{head}, measuring speed" if self.done < self.total else head
        return (f"{head}, {f['prompts_per_s']:.2f} prompts/s, {f['tokens_per_s']:.0f} tokens/s, "
                f"ETA {format_seconds(f['eta_s'])}")

    def _maybe_log(self) -> None:
        now = self.clock()
        if now - self._last_log >= self.log_every_s or self.done >= self.total:
            self._last_log = now
            self.emit(self.line())

    def advance(self, prompts: int, tokens: int = 0) -> None:
        self.done += prompts
        self.computed += prompts
        self.tokens += tokens
        if self._first is None:
            self._first = (self.clock(), self.computed, self.tokens)
        self._maybe_log()

    def skip(self, prompts: int) -> None:
        self.done += prompts
        self._maybe_log()
