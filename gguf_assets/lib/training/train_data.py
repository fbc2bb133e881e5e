"""Training data: shard reading, the data order and the streamed batches.

Data order. The sample at global index i is a pure function of (seed, i): epoch e visits
the shards in a seeded order, grouped into windows of ``SHUFFLE_WINDOW_SHARDS`` shards,
and the rows of a window are shuffled together (a shuffle buffer as large as a window).
Step s trains on indices [s*B, (s+1)*B), so a checkpoint needs only the step, weights,
optimizer and RNG state to continue bit-identically, and no data cursor can drift.

Memory. Only the windows the current batch touches plus the next one (read ahead on a
background thread) are in memory, whatever the number of shards. Each shard file is read
whole, front to back, in large chunks (lib/core/safetensors_io.py: read_torch): at 1 MB of targets
per prompt that is the sequential pattern a disk can sustain at the reference pace (about 200 MB/s).
"""

from __future__ import annotations

import bisect
import json
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.safetensors_io import ReadStats, read_torch
from gguf_assets.lib.precompute.target_sums import NonFiniteTarget, cached_sums, chunk_sums, store_sums
from gguf_assets.lib.project.layout import (
    PROMPTS_FILE,
    TEACHER_FILE,
)
from gguf_assets.lib.training.training_run import SHUFFLE_WINDOW_SHARDS


class TrainingError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class ShardData:
    targets: torch.Tensor   # [n, Q, D] stored dtype
    hidden: torch.Tensor    # [tokens, Ds]
    offsets: list[int]      # [n + 1] token offsets; a list so slicing costs no tensor ops
    texts: list[str]

    def states(self, i: int) -> torch.Tensor:
        return self.hidden[self.offsets[i]:self.offsets[i + 1]]


class ShardCorrupt(TrainingError):
    """A shard half's bytes differ from its record; the record is dropped so the half is computed again."""


def read_half(folder: Path, half: str, *, stats: ReadStats | None = None) -> dict[str, torch.Tensor]:
    """A shard half's tensors, their content checked against the sha256 recorded when it was written."""
    from gguf_assets.lib.precompute.shards_run import data_file, forget_half

    path = data_file(folder, half)
    record_file = folder / f"{half}.json"  # required_current() made sure it is there; hand-made shards may lack it
    recorded = atomic.read_json(record_file) if record_file.is_file() else {}
    try:
        return read_torch(path, stats=stats, expected_sha256=recorded.get("sha256"))
    except (verify.CorruptFile, ValueError) as exc:  # ValueError: the file is shorter than its header says
        if not recorded:
            raise TrainingError(f"{exc}; recompute this shard.") from exc
        forget_half(folder, half)
        raise ShardCorrupt(f"{exc} Nothing was trained on it. Its record was dropped, so `gguf-trainer run` "
                           "computes this half again, and only it.") from exc


def load_shard(folder: Path, *, stats: ReadStats | None = None) -> ShardData:
    t = read_half(folder, "teacher", stats=stats)
    s = read_half(folder, "student", stats=stats)
    texts = [json.loads(line)["text"] for line in (folder / PROMPTS_FILE).read_text(encoding="utf-8").splitlines()]
    return ShardData(t["targets"], s["hidden"], s["offsets"].tolist(), texts)


def shard_size(folder: Path) -> int:
    return int(atomic.read_json(folder / "teacher.json")["prompts"])


def _seed_of(*parts: int) -> int:
    value = 0
    for p in parts:
        value = (value * 1_000_003 + p) % (1 << 63)
    return value


class SampleOrder:
    """Global sample index → (window, shard, row), from the seed and the shard sizes alone."""

    def __init__(self, sizes: list[int], seed: int, *, window_shards: int = SHUFFLE_WINDOW_SHARDS) -> None:
        self.sizes, self.seed, self.total = list(sizes), seed, sum(sizes)
        if self.total == 0:
            raise TrainingError("no training prompts in the train shards")
        self.window_shards = window_shards
        self.windows_per_epoch = -(-len(sizes) // window_shards)
        self._epochs: OrderedDict[int, tuple[list[list[int]], list[int]]] = OrderedDict()
        self._perms: OrderedDict[int, list[int]] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[list[list[int]], list[int]]:
        """(shards of each window, cumulative sample count at each window's end)."""
        if epoch not in self._epochs:
            order = torch.randperm(len(self.sizes), generator=torch.Generator().manual_seed(_seed_of(self.seed, epoch)))
            windows = [order[i:i + self.window_shards].tolist() for i in range(0, len(order), self.window_shards)]
            ends, acc = [], 0
            for shards in windows:
                acc += sum(self.sizes[k] for k in shards)
                ends.append(acc)
            self._epochs[epoch] = (windows, ends)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def window_shards_of(self, window: int) -> list[int]:
        epoch, j = divmod(window, self.windows_per_epoch)
        return self._epoch(epoch)[0][j]

    def _perm(self, window: int, rows: int) -> list[int]:
        if window not in self._perms:
            g = torch.Generator().manual_seed(_seed_of(self.seed, 7919, window))
            self._perms[window] = torch.randperm(rows, generator=g).tolist()
            while len(self._perms) > 4:
                self._perms.popitem(last=False)
        return self._perms[window]

    def locate(self, index: int) -> tuple[int, int, int]:
        epoch, r = divmod(index, self.total)
        windows, ends = self._epoch(epoch)
        j = bisect.bisect_right(ends, r)
        start = ends[j - 1] if j else 0
        window = epoch * self.windows_per_epoch + j
        position = self._perm(window, ends[j] - start)[r - start]
        for shard in windows[j]:
            if position < self.sizes[shard]:
                return window, shard, position
            position -= self.sizes[shard]
        raise AssertionError("unreachable: position beyond the window")


@dataclass
class Batch:
    states: torch.Tensor                          # [B, Lmax, Ds] float32, CPU
    mask: torch.Tensor                            # [B, Lmax] bool
    targets: torch.Tensor                         # [B, Q, D] float32
    located: list[tuple[int, int, int]]           # (window, shard, row) of each sample, for diagnostics


class ShardStream:
    """Serves training batches by step, holding only the windows in use plus one ahead.

    Two background threads: one reads the next window while the current one trains (disk
    time hides behind compute), one collates the next step's batch. What they read and build
    depends only on the order, so they cannot change what is trained on; only they touch
    the order and the window table once batches are requested.
    """

    def __init__(self, folders: list[Path], order: SampleOrder, *, batch_size: int = 1,
                 end_step: int | None = None) -> None:
        self.folders, self.order, self.batch_size, self.end_step = folders, order, batch_size, end_step
        self.last_window = None if end_step is None else order.locate(max(0, end_step * batch_size - 1))[0]
        self.stats = ReadStats()
        self.wait_seconds = 0.0
        self.peak_windows = 0
        self._windows: dict[int, Future] = {}
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-reader")
        self._collator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-collator")
        self._next: tuple[int, Future] | None = None

    def _read_window(self, window: int) -> dict[int, ShardData]:
        return {k: load_shard(self.folders[k], stats=self.stats) for k in self.order.window_shards_of(window)}

    def _request(self, window: int) -> Future:
        if window not in self._windows:
            self._windows[window] = self._reader.submit(self._read_window, window)
        return self._windows[window]

    def _gather(self, start: int, count: int) -> tuple[list, list[tuple[torch.Tensor, torch.Tensor]]]:
        located = [self.order.locate(i) for i in range(start, start + count)]
        needed = sorted({w for w, _, _ in located})
        ahead = needed[-1] + 1
        for w in [w for w in self._windows if w not in needed and w != ahead]:
            del self._windows[w]
        data = {w: self._request(w).result() for w in needed}
        if self.last_window is None or ahead <= self.last_window:
            self._request(ahead)
        self.peak_windows = max(self.peak_windows, len(self._windows))
        return located, [(data[w][k].states(row), data[w][k].targets[row]) for w, k, row in located]

    def samples(self, start: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(states, target) of global samples [start, start + count), read in the calling thread."""
        return self._gather(start, count)[1]

    def _build(self, step: int) -> Batch:
        located, samples = self._gather(step * self.batch_size, self.batch_size)
        return Batch(*collate(samples, torch.device("cpu")), located=located)

    def batch(self, step: int) -> Batch:
        """The collated batch of ``step``; the next step's is built in the background meanwhile."""
        if self._next is not None and self._next[0] == step:
            future = self._next[1]
        else:
            future = self._collator.submit(self._build, step)
        wait_start = time.perf_counter()
        batch = future.result()
        self.wait_seconds += time.perf_counter() - wait_start
        following = step + 1
        self._next = None
        if self.end_step is None or following < self.end_step:
            self._next = (following, self._collator.submit(self._build, following))
        return batch

    def close(self) -> None:
        self._collator.shutdown(wait=True, cancel_futures=True)
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._windows.clear()
        self._next = None


def shard_batches(folder: Path, *, device: torch.device, batch_size: int = 64):
    """One shard's prompts in order, in batches: (shard, rows, states, mask, targets). What validation reads."""
    shard = load_shard(folder)
    for start in range(0, len(shard.texts), batch_size):
        rows = range(start, min(start + batch_size, len(shard.texts)))
        yield shard, rows, *collate([(shard.states(i), shard.targets[i]) for i in rows], device)


def student_batches(folder: Path, *, device: torch.device, batch_size: int = 64):
    """One shard's prompts in order, in batches of (states, mask), read from its student half alone: what the
    export's f16 check measures when no validation recorded it (lib/training/input_peaks.py)."""
    student = read_half(folder, "student")
    hidden, offsets = student["hidden"], student["offsets"].tolist()
    for start in range(0, len(offsets) - 1, batch_size):
        rows = range(start, min(start + batch_size, len(offsets) - 1))
        yield pad_states([hidden[offsets[i]:offsets[i + 1]] for i in rows], device)


def pad_states(samples: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[states [L, Ds]] → padded states [B, Lmax, Ds] (f32), mask [B, Lmax] (True = a real token)."""
    longest = max(1, max(s.shape[0] for s in samples))
    states = torch.zeros(len(samples), longest, samples[0].shape[1])
    mask = torch.zeros(len(samples), longest, dtype=torch.bool)
    for i, s in enumerate(samples):
        states[i, : s.shape[0]] = s.float()
        mask[i, : s.shape[0]] = True
    return states.to(device), mask.to(device)


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device):
    """[(states [L, Ds], target [Q, D])] → padded states [B, Lmax, Ds], mask [B, Lmax], targets [B, Q, D]."""
    states, mask = pad_states([s for s, _ in samples], device)
    targets = torch.stack([t.float() for _, t in samples])
    return states, mask, targets.to(device)


def shard_target_sums(folder: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(s1, s2, prompts) of a shard's teacher half: float64 sums of the targets and of their squares, one row per
    chunk of prompts [chunks, Q, D]. Reused from the shard folder when stored there for the
    teacher half's recorded sha256 (lib/precompute/target_sums.py), else computed (checking every target is finite)
    and stored."""
    record_file = folder / "teacher.json"
    teacher_sha256 = (atomic.read_json(record_file).get("sha256") if record_file.is_file() else None)
    if teacher_sha256:
        cached = cached_sums(folder, teacher_sha256)
        if cached is not None:
            return cached
    targets = read_half(folder, "teacher")["targets"]
    try:
        sums = chunk_sums(targets)
    except NonFiniteTarget as exc:
        raise TrainingError(f"{folder / TEACHER_FILE}: target of prompt {exc.prompt} is not finite; recompute this "
                            "shard (delete its teacher.json) or check materials.teacher_layer.") from None
    # Stored only if the record still names the bytes just read (read_half checked them against it).
    if sums[2] and teacher_sha256 and atomic.read_json(record_file).get("sha256") == teacher_sha256:
        store_sums(folder, teacher_sha256, *sums)
    return sums


@dataclass(frozen=True)
class TargetStats:
    """The train targets' statistics (lib/training/adapter.py says where each goes)."""

    centre: torch.Tensor      # [Q, D]: each (row, dim)'s mean
    output_std: torch.Tensor  # [D]: the output's scale, shared by the rows (it folds into out_proj)
    loss_std: torch.Tensor    # [Q, D]: the loss's scale per (row, dim), as trainer8 standardizes
    prompts: int


def target_stats(folders: list[Path], *, sigma_floor: float, isotropic: bool = False) -> TargetStats:
    """The train targets' per-(query row, dim) mean and std, and the per-dim std the output is scaled by (the root
    of the rows' mean variance), each floored at ``sigma_floor``; from each shard's chunk sums.

    The chunk sums are added in shard order, chunk by chunk: the same float64 additions, in the same order, as
    streaming every target (test_train_data checks the two agree bit for bit).

    ``isotropic``: one std for every (row, dim), the root of their mean variance (as PHI-S scales its targets),
    for the loss and the output alike."""
    total, s1, s2 = 0, None, None
    for folder in folders:
        c1, c2, prompts = shard_target_sums(folder)
        for i in range(c1.shape[0]):
            s1 = c1[i] if s1 is None else s1 + c1[i]
            s2 = c2[i] if s2 is None else s2 + c2[i]
        total += prompts
    if not total:
        raise TrainingError("no training prompts in the train shards")
    mean = s1 / total
    var = (s2 / total - mean * mean).clamp_min(0)
    if isotropic:
        one = var.mean().sqrt().clamp_min(sigma_floor).float()
        return TargetStats(mean.float(), one.expand(var.shape[1]).contiguous(), one.expand_as(var).contiguous(), total)
    return TargetStats(mean.float(), var.mean(0).sqrt().clamp_min(sigma_floor).float(),
                       var.sqrt().clamp_min(sigma_floor).float(), total)
