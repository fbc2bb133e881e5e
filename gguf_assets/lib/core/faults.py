"""Named fault points: kill a real run, or fill its disk, at an exact moment.

Random kills rarely land inside a checkpoint save or a GGUF export, which take milliseconds,
so the places where a torn write would do harm call :func:`point`. Normally it does nothing
(one environment lookup). With

    GGUF_ASSETS_FAULT=<point>[@<nth>][:<action>[:<fraction>]]

the ``nth`` time (default 1) this process reaches ``<point>`` it acts. Several faults, separated by
commas, each act at their own moment (``train-step@11:stall:5,gguf-export:stall:5``):

- ``kill`` (default): SIGKILL to the whole process group, as a power cut would do to the
  pipeline, its download child and its shard workers. Start the pipeline in its own session.
- ``enospc``: raise ``OSError(ENOSPC)``, as a full disk would.
- ``stall``: sleep for ``<fraction>`` seconds (default 60), as a slow disk or GPU would: a stop
  (Ctrl-C, SIGTERM, Terminate in the UI) then lands at a known moment, whatever the machine's speed.

For ``kill`` and ``enospc`` the file being written is first cut to ``fraction`` (default 0.5)
of its length, so what is left behind is a torn write, not a complete temp file.

With ``GGUF_ASSETS_FAULT_REACHED=<folder>`` each fault first creates ``<folder>/<point>.<pid>``: a test that stalls
a process it did not start itself (a Dagster code server) learns that it is there, and stops it at that moment.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core.errors import UserError

ENV = "GGUF_ASSETS_FAULT"
REACHED_ENV = "GGUF_ASSETS_FAULT_REACHED"
# Where each point sits: the moments a kill or a full disk would otherwise be left to chance.
POINTS = {
    "download": "a hub download has a whole chunk of a file on disk (mid-file) and is still running",
    "shard-write": "a shard half is written to its temp file, before the rename",
    "train-step": "an optimizer step has been taken",
    "checkpoint-save": "a checkpoint's weights and optimizer state are in its temp folder, before the rename",
    "gguf-export": "a GGUF is written to its temp file, before it is verified and renamed",
    "pipeline-load": "the process that runs the pipeline has started and loads it, before it handles a stop",
    "definitions-import": "a process (a Dagster code server, a run) is importing gguf_assets.definitions",
}
ACTIONS = ("kill", "enospc", "stall")
STALL_S = 60.0


class FaultSpecError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    point: str
    nth: int = 1
    action: str = "kill"
    fraction: float = 0.5

    def render(self) -> str:
        return f"{self.point}@{self.nth}:{self.action}:{self.fraction}"


def parse(spec: str) -> Fault:
    """``<point>[@<nth>][:<action>[:<fraction>]]`` → :class:`Fault`, or a clear error."""
    usage = (f"{ENV}={spec!r} is not <point>[@<nth>][:<action>[:<fraction>]] (several separated by commas); "
             f"points: {', '.join(POINTS)}; actions: {', '.join(ACTIONS)}. Unset {ENV} for a normal run.")
    head, *rest = spec.strip().split(":")
    point, _, nth_text = head.partition("@")
    if point not in POINTS or len(rest) > 2:
        raise FaultSpecError(usage)
    try:
        nth = int(nth_text) if nth_text else 1
        fraction = float(rest[1]) if len(rest) > 1 else 0.5
    except ValueError:
        raise FaultSpecError(usage) from None
    action = rest[0] if rest else "kill"
    if action == "stall" and len(rest) < 2:
        fraction = STALL_S
    if action not in ACTIONS or nth < 1 or not 0.0 <= fraction <= (STALL_S * 10 if action == "stall" else 1.0):
        raise FaultSpecError(usage)
    return Fault(point, nth, action, fraction)


def parse_all(spec: str) -> list[Fault]:
    """A comma-separated list of faults, each as :func:`parse` reads it."""
    return [parse(one) for one in spec.split(",")]


_reached: dict[str, int] = {}


def reset() -> None:
    """Forget how often each point was reached (a test running several pipelines in one process)."""
    _reached.clear()


def armed(name: str) -> bool:
    """Whether ``GGUF_ASSETS_FAULT`` names this point: for points that cost something to find."""
    spec = os.environ.get(ENV)
    return bool(spec) and any(fault.point == name for fault in parse_all(spec))


def point(name: str, torn: Path | None = None) -> None:
    """Mark a named moment; act if ``GGUF_ASSETS_FAULT`` names it and this is the nth time."""
    if name not in POINTS:
        raise KeyError(f"unknown fault point {name!r}; add it to faults.POINTS")
    if not armed(name):
        return
    spec = os.environ[ENV]
    _reached[name] = _reached.get(name, 0) + 1
    for fault in parse_all(spec):
        if fault.point == name and _reached[name] == fault.nth:
            _act(fault, spec, torn)


def _act(fault: Fault, spec: str, torn: Path | None) -> None:
    reached = os.environ.get(REACHED_ENV)
    if reached:
        Path(reached, f"{fault.point}.{os.getpid()}").touch()
    if fault.action == "stall":
        import time

        time.sleep(fault.fraction)
        return
    if torn is not None and Path(torn).is_file():
        with open(torn, "r+b") as fh:
            fh.truncate(int(Path(torn).stat().st_size * fault.fraction))
    if fault.action == "kill":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV}={spec})", str(torn or fault.point))
