"""What a snapshot GGUF is called in the output folder, and the cleanup of the temps a killed one leaves: apart from
snapshots.py (which exports through export.py) so the export can clean them without importing it back."""

from __future__ import annotations

import re
from pathlib import Path

from gguf_assets.lib.core import atomic


def remove_dead_snapshot_temps(output_dir: Path, adapter_name: str) -> int:
    """The temp files of snapshot GGUFs whose writer was killed (a snapshot is written beside a run, at any step,
    so the run's own cleanup of its names does not reach them); a snapshot still being written is left alone."""
    pattern = re.compile(rf"{re.escape(adapter_name)}(?:-best)?-step\d+\.gguf")
    return atomic.remove_stale_temps(output_dir, like=pattern.fullmatch)


def snapshot_path(output_dir: Path, adapter_name: str, step: int, *, best: bool = False) -> Path:
    """``<adapter>-step<N>.gguf``; the best weights' ``<adapter>-best-step<N>.gguf`` (their provenance differs)."""
    return output_dir / f"{adapter_name}{'-best' if best else ''}-step{step}.gguf"
