"""Per-shard target sums, kept beside the teacher half so a new training run does not read every teacher byte again
before its first step. One row per STATS_CHUNK_PROMPTS chunk (not one per shard), so that folding the rows in order
repeats exactly the float64 additions of a single stream over all targets: the statistics, and so the trained
weights, are bit-identical whether the sums come from here or from the targets (lib/training/train_data.py folds
them). Written by the precompute right after a teacher half, from the targets still in memory."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.safetensors_io import read_torch

log = logging.getLogger(__name__)

# Prompts per chunk of the statistics' float64 additions (a 1000-prompt shard of 256x4096 targets would be 8 GB in
# float64 at once). The chunking fixes the order of the additions, so it is part of the trained result.
STATS_CHUNK_PROMPTS = 32
STATS_FILE = "teacher.sums"  # safetensors bytes; not *.safetensors, which globs take for a shard half
STATS_RECORD = "teacher.sums.json"


class NonFiniteTarget(ValueError):
    def __init__(self, prompt: int) -> None:
        super().__init__(f"target of prompt {prompt} is not finite")
        self.prompt = prompt


def cached_sums(folder: Path, teacher_sha256: str) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """The stored chunk sums of the teacher half whose recorded sha256 is ``teacher_sha256``, checked against the
    sha256 of the stats file itself; None when absent, made for other bytes or another chunking, or damaged."""
    record_file = folder / STATS_RECORD
    if not record_file.is_file():
        return None
    try:
        record = atomic.read_json(record_file)
        if record.get("teacher_sha256") != teacher_sha256 or record.get("chunk_prompts") != STATS_CHUNK_PROMPTS:
            return None
        sums = read_torch(folder / STATS_FILE, expected_sha256=record["sha256"])
        return sums["s1"], sums["s2"], int(record["prompts"])
    except (OSError, ValueError, KeyError, verify.CorruptFile) as exc:  # recomputed by the caller, and stored again
        log.info("%s: target sums not reused (%s); computing them from the teacher half", folder, exc)
        return None


def store_sums(folder: Path, teacher_sha256: str, s1: torch.Tensor, s2: torch.Tensor, prompts: int) -> None:
    from safetensors.torch import save_file

    path = folder / STATS_FILE
    try:
        with atomic.atomic_path(path) as tmp:
            save_file({"s1": s1.contiguous(), "s2": s2.contiguous()}, str(tmp))
        # The record goes last and names the teacher bytes the sums are of: a changed half never reuses them.
        atomic.write_json(folder / STATS_RECORD, {"teacher_sha256": teacher_sha256, "prompts": prompts,
                                                  "chunk_prompts": STATS_CHUNK_PROMPTS, **verify.record(path)})
    except OSError as exc:  # a read-only shard folder: training goes on, the next run computes them again
        log.info("%s: target sums not stored (%s)", folder, exc)


def chunk_sums(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """float64 sums of the targets and of their squares, one row per STATS_CHUNK_PROMPTS prompts; NonFiniteTarget
    names the first prompt whose target is not finite."""
    s1, s2 = [], []
    for begin in range(0, targets.shape[0], STATS_CHUNK_PROMPTS):
        chunk = targets[begin:begin + STATS_CHUNK_PROMPTS].double()
        if not torch.isfinite(chunk).all():
            raise NonFiniteTarget(begin + int((~torch.isfinite(chunk)).flatten(1).any(1).nonzero()[0]))
        s1.append(chunk.sum(0))
        s2.append((chunk * chunk).sum(0))
    if not s1:
        empty = torch.zeros(0, *targets.shape[1:], dtype=torch.float64)
        return empty, empty, 0
    return torch.stack(s1), torch.stack(s2), int(targets.shape[0])


def store_target_sums(folder: Path, targets: torch.Tensor, teacher_sha256: str) -> None:
    """The precompute's call, right after it wrote a teacher half: its sums from the targets still in memory (the
    same values as the file's), so the first training run reads no teacher byte before its first step. Targets
    that are not finite store nothing: training names the prompt."""
    try:
        sums = chunk_sums(targets)
    except NonFiniteTarget:
        return
    if sums[2]:
        store_sums(folder, teacher_sha256, *sums)
