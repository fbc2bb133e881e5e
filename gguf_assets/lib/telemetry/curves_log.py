"""Training curves for TensorBoard: one folder per training run, every scalar against the step.

`gguf-trainer ui` serves <project>/tensorboard beside Dagster. Event files are TensorBoard's
own append-only log (CRC-checked records): a kill -9 can leave a torn last record, which its
reader skips, and a resumed run purges the steps after its checkpoint (``purge_step``), so the
curve shows each step once, as in an uninterrupted run.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from gguf_assets.lib.core.metrics import VAL_CENTRED_COSINE

TENSORBOARD_DIR = "tensorboard"
# TensorBoard's address, set by `gguf-trainer ui` for the webserver, the daemon and the runs they launch.
TENSORBOARD_URL_ENV = "GGUF_ASSETS_TENSORBOARD_URL"


# The cards the link pins on top: the Time Series dashboard lists the rest by tag, alphabetically, so it would open
# on the "hardware/" group (CurvesLog's groups: hardware, train, val) with the loss out of sight below it.
PINNED_TAGS = ("train/loss", f"val/{VAL_CENTRED_COSINE}")


def tensorboard_timeseries_url(base: str, *, run: str | None = None) -> str:
    """TensorBoard's Time Series dashboard, unsmoothed, opening on the loss: its default smoothing (0.6) would show a
    handful of validation points as one smoothed value (0.86 for a real 0.922). TensorBoard 2.x reads ``smoothing``
    and ``pinnedCards`` from the page's query (its webfiles' deserializeQueryParams), and ``runFilter`` selects one
    run."""
    import json
    from urllib.parse import urlencode

    pinned = json.dumps([{"plugin": "scalars", "tag": tag} for tag in PINNED_TAGS], separators=(",", ":"))
    query = urlencode({"smoothing": 0, "pinnedCards": pinned, **({"runFilter": run} if run else {})})
    return f"{base.rstrip('/')}/?{query}#timeseries"


def run_name(training, fingerprint: str) -> str:
    """A training run's name in TensorBoard: its shape, length and peak lr, which a user compares runs by, and
    the fingerprint's start, which tells two runs of the same shape apart (``training``: Settings.training)."""
    return f"{training.width}x{training.depth}-{training.steps}steps-lr{training.learning_rate:g}-{fingerprint[:8]}"


def run_folder(root: Path, training, fingerprint: str) -> Path:
    """<project>/tensorboard/<run_name>; a run's folder from before runs had names (the bare fingerprint) is
    renamed to it, so its curves stay one run."""
    folder = Path(root) / TENSORBOARD_DIR / run_name(training, fingerprint)
    old = Path(root) / TENSORBOARD_DIR / fingerprint
    if old.is_dir() and not folder.exists():
        old.rename(folder)
    return folder


class CurvesLog:
    """``scalars(step, values, group)`` writes ``group/name`` for every finite number in ``values``."""

    def __init__(self, folder: Path, *, resumed_at_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder.mkdir(parents=True, exist_ok=True)
        if resumed_at_step:
            _start_after_earlier_files(folder)
        # The checkpoint at step N was saved after step N's log and validation, so those stay; the
        # events after it, written by the run a kill cut off, are hidden (they are redone).
        self._writer = SummaryWriter(str(folder), purge_step=resumed_at_step + 1 if resumed_at_step else None,
                                     flush_secs=10)

    def scalars(self, step: int, values: dict, group: str) -> None:
        for name, value in values.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                self._writer.add_scalar(f"{group}/{name}", value, step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def _start_after_earlier_files(folder: Path) -> None:
    """Wait, if needed, until the new event file's name sorts after every earlier one's.

    TensorBoard reads a run's event files in name order, and a purge only hides what came before it in that
    order. A name is "events.out.tfevents.<whole seconds>.<host>.<pid>.<counter>", so a resume within the same
    second as the stopped session's start (seen in the suite, in one process) could sort first, by its counter
    ("10" before "9") or pid, and show the stopped session's steps after the resumed ones. Costs at most a second,
    only then."""
    started = [int(part) for name in (p.name for p in folder.glob("events.out.tfevents.*"))
               if (part := name.split(".")[3]).isdigit()]
    while started and time.time() < max(started) + 1:
        time.sleep(0.05)
