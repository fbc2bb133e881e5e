"""Adapter training: streamed shards, the trainer8 loss and schedule, exact resume.

Data order. The sample at global index i is a pure function of (seed, i): epoch e visits
the shards in a seeded order, grouped into windows of ``SHUFFLE_WINDOW_SHARDS`` shards,
and the rows of a window are shuffled together (a shuffle buffer as large as a window).
Step s trains on indices [s*B, (s+1)*B), so a checkpoint needs only the step, weights,
optimizer and RNG state to continue bit-identically, and no data cursor can drift.

Memory. Only the windows the current batch touches plus the next one (read ahead on a
background thread) are in memory, whatever the number of shards. Each shard file is read
whole, front to back, in large chunks: at 1 MB of targets per prompt that is the
sequential pattern a disk can sustain at the reference pace (about 200 MB/s).

Layout of a run (docs/adapter.md):

    checkpoints/<fingerprint>/step-XXXXXXXX/   the last ``keep_checkpoints`` checkpoints
    checkpoints/<fingerprint>/best/            the best validated weights
    checkpoints/<fingerprint>/final/           the finished adapter (what export reads)
    checkpoints/<fingerprint>/curves.svg       loss and val-cosine curves, kept current
"""

from __future__ import annotations

import base64
import bisect
import copy
import io
import json
import logging
import math
import os
import re
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save_file

from gguf_assets.lib import atomic, faults, verify
from gguf_assets.lib.adapter import (
    Adapter,
    AdapterShape,
    adapter_loss,
    centred_cosine_rows,
    lr_at,
    standardize,
)
from gguf_assets.lib.curves_log import TENSORBOARD_DIR, CurvesLog
from gguf_assets.lib.errors import UserError
from gguf_assets.lib.hardware import resolve_device
from gguf_assets.lib.layout import (
    PROMPTS_FILE,
    TEACHER_FILE,
    ProjectPaths,
)
from gguf_assets.lib.safetensors_io import ReadStats, read_torch
from gguf_assets.lib.settings import Settings
from gguf_assets.lib.verdict import verdict

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{8})$")
BEST_DIR = "best"
FINAL_DIR = "final"
DAMAGED_FINAL_DIR = "final.damaged"  # finished weights whose bytes changed, kept for a look
WEIGHTS_FILE = "adapter.safetensors"
STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"
CURVES_FILE = "curves.svg"
# Settings that change speed or bookkeeping, not the trained weights.
NON_RESULT_KEYS = ("device", "grad_checkpoint", "log_every", "validate_every", "checkpoint_every", "keep_checkpoints")
# Result settings added after runs existed, with the value that means "as before": they enter the
# fingerprint only when set otherwise, so a new key never retrains an existing project.
OFF_VALUES = {"ema_decay": 0.0}
# Shards shuffled together. Part of the data order, hence of the run fingerprint.
SHUFFLE_WINDOW_SHARDS = 4
# Prompts per chunk when streaming target statistics: a 1000-prompt shard of 256x4096
# targets would be 8 GB in float64 at once.
STATS_CHUNK_PROMPTS = 32
FORMAT = 2


class TrainingError(UserError, RuntimeError):
    pass


# -- reading shards -----------------------------------------------------------------------

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
    from gguf_assets.lib.shards import data_file, forget_half

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


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device):
    """[(states [L, Ds], target [Q, D])] → padded states [B, Lmax, Ds], mask [B, Lmax], targets [B, Q, D]."""
    longest = max(1, max(s.shape[0] for s, _ in samples))
    dim = samples[0][0].shape[1]
    states = torch.zeros(len(samples), longest, dim)
    mask = torch.zeros(len(samples), longest, dtype=torch.bool)
    for i, (s, _) in enumerate(samples):
        states[i, : s.shape[0]] = s.float()
        mask[i, : s.shape[0]] = True
    targets = torch.stack([t.float() for _, t in samples])
    return states.to(device), mask.to(device), targets.to(device)


def target_stats(folders: list[Path], *, sigma_floor: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-(query row, dim) mean and floored std over all train targets, streamed shard by shard."""
    total, s1, s2 = 0, None, None
    for folder in folders:
        targets = read_half(folder, "teacher")["targets"]
        for begin in range(0, targets.shape[0], STATS_CHUNK_PROMPTS):
            chunk = targets[begin:begin + STATS_CHUNK_PROMPTS].double()
            if not torch.isfinite(chunk).all():
                bad = begin + int((~torch.isfinite(chunk)).flatten(1).any(1).nonzero()[0])
                raise TrainingError(f"{folder / TEACHER_FILE}: target of prompt {bad} is not finite; recompute this "
                                    "shard (delete its teacher.json) or check materials.teacher_layer.")
            s1 = chunk.sum(0) if s1 is None else s1 + chunk.sum(0)
            s2 = (chunk * chunk).sum(0) if s2 is None else s2 + (chunk * chunk).sum(0)
            total += chunk.shape[0]
    if not total:
        raise TrainingError("no training prompts in the train shards")
    mean = s1 / total
    var = (s2 / total - mean * mean).clamp_min(0)
    return mean.float(), var.sqrt().clamp_min(sigma_floor).float(), total


# -- validation ---------------------------------------------------------------------------

@torch.inference_mode()
def evaluate(model: Adapter, folders: list[Path], *, device: torch.device, cosine_weight: float,
             batch_size: int = 64) -> dict:
    """Val centred cosine (overall, per shard, empty prompt) and val loss of the torch model."""
    was_training = model.training
    model.eval()
    cosines, empty, losses, per_shard = [], [], [], []
    for folder in folders:
        shard = load_shard(folder)
        shard_cos = []
        for start in range(0, len(shard.texts), batch_size):
            rows = range(start, min(start + batch_size, len(shard.texts)))
            states, mask, targets = collate([(shard.states(i), shard.targets[i]) for i in rows], device)
            pred = model(states, mask)
            z = standardize(targets, model.target_mean, model.target_std)
            losses.append(float(adapter_loss(pred, z, cosine_weight=cosine_weight)) * len(rows))
            cos = centred_cosine_rows(pred, targets, model.target_mean, model.target_std).cpu()
            shard_cos += cos.tolist()
            empty += [c for c, i in zip(cos.tolist(), rows) if shard.texts[i] == ""]
        cosines += shard_cos
        per_shard.append({"shard": folder.name, "n": len(shard_cos),
                          "val_centred_cosine": sum(shard_cos) / len(shard_cos)})
    model.train(was_training)
    n = len(cosines)
    return {"val_centred_cosine": sum(cosines) / n, "empty_prompt_cosine": (sum(empty) / len(empty)) if empty else None,
            "val_loss": sum(losses) / n, "per_shard": per_shard, "n": n}


# -- curves -------------------------------------------------------------------------------

def curves_svg(history: list[dict], *, panel_width: int = 320, panel_height: int = 180) -> str:
    """Two small line charts as SVG text: training loss (log scale, plus val loss) and val cosines."""
    pad = 34
    panels = [("loss (log10)", [("loss", "#1f77b4", True), ("val_loss", "#ff7f0e", True)]),
              ("val centred cosine", [("val_centred_cosine", "#2ca02c", False),
                                      ("empty_prompt_cosine", "#9467bd", False)])]
    width = panel_width * len(panels)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{panel_height}" '
           f'viewBox="0 0 {width} {panel_height}" font-family="sans-serif" font-size="10">',
           f'<rect width="{width}" height="{panel_height}" fill="white"/>']
    for p, (title, series) in enumerate(panels):
        x0 = p * panel_width
        points = {key: [(e["step"], math.log10(e[key]) if log_y else e[key]) for e in history
                        if isinstance(e.get(key), (int, float)) and math.isfinite(e[key]) and (not log_y or e[key] > 0)]
                  for key, _, log_y in series}
        every = [xy for pts in points.values() for xy in pts]
        out.append(f'<text x="{x0 + pad}" y="12">{title}</text>')
        out.append(f'<rect x="{x0 + pad}" y="18" width="{panel_width - pad - 8}" height="{panel_height - 36}" '
                   'fill="none" stroke="#999"/>')
        if not every:
            continue
        sx0, sx1 = min(x for x, _ in every), max(x for x, _ in every)
        sy0, sy1 = min(y for _, y in every), max(y for _, y in every)
        if sy1 - sy0 < 1e-9:
            sy0, sy1 = sy0 - 0.5, sy1 + 0.5

        def xy(x: float, y: float) -> str:
            px = x0 + pad + (x - sx0) / max(1e-9, sx1 - sx0) * (panel_width - pad - 8)
            py = 18 + (1 - (y - sy0) / (sy1 - sy0)) * (panel_height - 36)
            return f"{px:.1f},{py:.1f}"

        out.append(f'<text x="{x0 + 2}" y="24">{sy1:.3g}</text>'
                   f'<text x="{x0 + 2}" y="{panel_height - 18}">{sy0:.3g}</text>')
        out.append(f'<text x="{x0 + pad}" y="{panel_height - 6}">step {sx0}</text>'
                   f'<text x="{x0 + panel_width - 8}" y="{panel_height - 6}" text-anchor="end">{sx1}</text>')
        for i, (key, colour, _) in enumerate(series):
            pts = points[key]
            if len(pts) > 400:  # keep the embedded image small
                pts = pts[:: math.ceil(len(pts) / 400)] + [pts[-1]]
            if pts:
                out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" '
                           f'points="{" ".join(xy(x, y) for x, y in pts)}"/>')
                out.append(f'<text x="{x0 + panel_width - 10}" y="{30 + 12 * i}" text-anchor="end" '
                           f'fill="{colour}">{key}</text>')
    out.append("</svg>")
    return "\n".join(out)


def curves_markdown(svg: str) -> str:
    """The SVG as a Markdown image with a data: URI.

    Dagster's UI renders Markdown metadata with react-markdown and a rehype-sanitize schema
    that allows the ``data`` protocol for image sources; a file path would be resolved
    against the web server and not found.
    """
    encoded = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return f"![loss and val centred cosine](data:image/svg+xml;base64,{encoded})"


# -- checkpoints --------------------------------------------------------------------------

def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _check_finite(model: Adapter, step: int) -> None:
    for name, p in model.state_dict().items():
        if not torch.isfinite(p).all():
            raise TrainingError(f"step {step}: parameter {name} is not finite; no checkpoint was written.")


def _weights(model: Adapter) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}


def save_checkpoint(folder: Path, *, model: Adapter, optimizer: torch.optim.Optimizer, step: int, meta: dict,
                    ema: Adapter | None = None) -> None:
    """Weights, optimizer, RNG, step (which fixes the data position and the lr), settings; all or nothing.

    ``adapter.safetensors`` holds the raw weights, the ones training continues from; the weight
    average, when on, travels in ``trainer_state.pt`` (key "ema"). The meta, written last,
    records each file's sha256, so a resume can tell a damaged checkpoint.
    """
    _check_finite(model, step)
    state = {"optimizer": optimizer.state_dict(), "rng": _rng_state(), "step": step}
    if ema is not None:  # absent when off, so such checkpoints are byte for byte what they were
        _check_finite(ema, step)
        state["ema"] = _weights(ema)
    with atomic.atomic_dir(folder) as tmp:
        save_file(_weights(model), str(tmp / WEIGHTS_FILE))
        torch.save(state, tmp / STATE_FILE)
        faults.point("checkpoint-save", tmp / STATE_FILE)
        (tmp / META_FILE).write_text(json.dumps({**meta, "step": step, **_file_hashes(tmp, WEIGHTS_FILE, STATE_FILE)},
                                                indent=2, sort_keys=True))


def save_weights(folder: Path, *, model: Adapter, step: int, meta: dict, extra: dict[str, str] | None = None) -> None:
    """Weights and meta only (best/ and final/), all or nothing; the meta records the weights' sha256."""
    _check_finite(model, step)
    with atomic.atomic_dir(folder) as tmp:
        save_file(_weights(model), str(tmp / WEIGHTS_FILE))
        (tmp / META_FILE).write_text(json.dumps({**meta, **_file_hashes(tmp, WEIGHTS_FILE)}, indent=2, sort_keys=True))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")


def _file_hashes(folder: Path, *names: str) -> dict:
    return {"sha256": {name: atomic.sha256_file(folder / name) for name in names}}


def read_recorded(folder: Path, name: str, meta: dict) -> bytes:
    """A checkpoint file's bytes, checked against the sha256 its meta recorded (older checkpoints have none)."""
    return verify.read_checked(folder / name, (meta.get("sha256") or {}).get(name), what_to_do="")


def list_checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("step-*") if STEP_DIR.match(p.name) and (p / META_FILE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    steps = list_checkpoints(run_dir)
    return steps[-1] if steps else None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    steps = sorted(p for p in run_dir.glob("step-*") if STEP_DIR.match(p.name))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class _Resumed:
    step: int = 0
    history: list = field(default_factory=list)
    best: dict | None = None
    untrained: float | None = None
    started: dict = field(default_factory=dict)
    checkpoint: str | None = None
    ema: dict | None = None


def _restore(run_dir: Path, model: Adapter, optimizer: torch.optim.Optimizer, device: torch.device,
             shape: AdapterShape, *, ema: bool = False) -> _Resumed | None:
    """Load the newest intact checkpoint; a damaged or unreadable one is skipped with a warning.

    Intact means each file's bytes match the sha256 its meta recorded. Falling back costs only
    the steps since the older checkpoint: the data order and RNG resume exactly from it, so
    the final weights are the same.
    """
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            meta = atomic.read_json(ckpt / META_FILE)
            if meta.get("shape") != shape.to_dict():
                raise TrainingError(f"{ckpt}: adapter shape {meta.get('shape')} differs from {shape.to_dict()}")
            weights = {k: v.to(device) for k, v in safetensors_load(read_recorded(ckpt, WEIGHTS_FILE, meta)).items()}
            state = torch.load(io.BytesIO(read_recorded(ckpt, STATE_FILE, meta)), weights_only=True,
                               map_location=device)
            if ema and "ema" not in state:
                raise TrainingError(f"{ckpt}: no weight average in {STATE_FILE}, though training.ema_decay is on")
        except Exception as exc:  # any damaged or unreadable file: fall back to the previous checkpoint
            log.warning("checkpoint %s is damaged, so it is not used (%s); trying an older one", ckpt.name, exc)
            continue
        model.load_state_dict(weights)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["rng"]["cuda"]])
        return _Resumed(step=meta["step"], history=meta.get("history", []), best=meta.get("best"),
                        untrained=meta.get("untrained"), started=meta.get("started", {}), checkpoint=ckpt.name,
                        ema=state.get("ema") if ema else None)
    return None


# -- runs and settings changes ------------------------------------------------------------

def training_settings(settings: Settings) -> dict:
    """The training settings the result depends on (cadence and device settings change nothing).

    A key of OFF_VALUES at its off value is left out: the result is what it was before the key existed.
    """
    return {k: v for k, v in settings.section_dict("training").items()
            if k not in NON_RESULT_KEYS and not (k in OFF_VALUES and v == OFF_VALUES[k])}


def training_fingerprint(settings: Settings, train_fps: list[str], val_fps: list[str]) -> str:
    return atomic.fingerprint({"training": training_settings(settings), "train": train_fps, "val": val_fps,
                               "shuffle_window_shards": SHUFFLE_WINDOW_SHARDS, "format": FORMAT})


def shards_identity(folders: list[Path]) -> str:
    """What the shards hold (their recorded half fingerprints), to tell a data change from a settings change."""
    parts = []
    for folder in folders:
        parts.append([folder.name] + [atomic.read_json(folder / f"{half}.json").get("fingerprint")
                                      for half in ("teacher", "student") if (folder / f"{half}.json").is_file()])
    return atomic.fingerprint(parts)


def _run_meta(run_dir: Path) -> dict | None:
    for candidate in [run_dir / FINAL_DIR] + list(reversed(list_checkpoints(run_dir))):
        try:
            return atomic.read_json(candidate / META_FILE)
        except (OSError, ValueError):
            continue
    return None


def why_new_run(paths: ProjectPaths, fingerprint: str, training: dict, train_id: str, val_id: str) -> dict:
    """Compare with the most recently active other run: which settings or inputs changed."""
    runs = []
    for run in paths.checkpoints_dir(fingerprint).parent.glob("*"):
        if run.is_dir() and run.name != fingerprint:
            meta = _run_meta(run)
            if meta is not None:
                runs.append((max(p.stat().st_mtime for p in [run, *run.iterdir()]), run.name, meta))
    if not runs:
        return {"previous_run": None, "message": f"starting training run {fingerprint} (no earlier run)"}
    _, name, meta = max(runs)
    old = {**OFF_VALUES, **meta.get("training", {})}  # a run from before a key existed ran with it off
    changed = {k: [old.get(k), v] for k, v in training.items() if k not in NON_RESULT_KEYS and old.get(k) != v}
    reasons = [f"training.{k}: {a!r} → {b!r}" for k, (a, b) in sorted(changed.items())]
    if meta.get("train_shards") not in (None, train_id):
        reasons.append("the train shards changed")
    if meta.get("val_shards") not in (None, val_id):
        reasons.append("the val shards changed")
    if not reasons:
        reasons.append("the trainer's data order or format changed")
    return {"previous_run": name, "changed": changed, "reasons": reasons,
            "message": f"{'settings' if changed else 'inputs'} changed since run {name} ({'; '.join(reasons)}); "
                       f"starting a new run {fingerprint} "
                       f"from step 0. The old run's checkpoints stay in checkpoints/{name} and are used again "
                       "if you change the settings back."}


# -- training -----------------------------------------------------------------------------

def adapter_shape(settings: Settings, folders: list[Path]) -> AdapterShape:
    teacher = atomic.read_json(folders[0] / "teacher.json")
    student = atomic.read_json(folders[0] / "student.json")
    t = settings.training
    return AdapterShape(student_dim=int(student["dim"]), query_rows=int(teacher["query_rows"]),
                        target_dim=int(teacher["dim"]), width=t.width, depth=t.depth, heads=t.heads)


def build_model(shape: AdapterShape, *, seed: int, grad_checkpoint: bool = False) -> Adapter:
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return Adapter(shape, grad_checkpoint=grad_checkpoint)


class WeightAverage:
    """An exponential moving average of the weights (``training.ema_decay``), a second Adapter.

    The decay after n updates is min(ema_decay, (1 + n) / (10 + n)): early, mostly random weights
    fade within tens of steps whatever the decay, so short runs profit too. It depends on the step
    alone, and the average is saved in each checkpoint, so a resumed run averages exactly as an
    uninterrupted one. The target statistics (buffers) are copied once; they never change.
    """

    def __init__(self, model: Adapter, decay: float) -> None:
        self.decay = decay
        self.model = copy.deepcopy(model)
        self.model.grad_checkpoint = False
        self.model.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: Adapter, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        for average, weight in zip(self.model.parameters(), model.parameters()):
            average.lerp_(weight.detach(), 1.0 - decay)


def _non_finite_cause(step: int, what: str, value: float, *, batch: Batch, folders: list[Path], model: Adapter,
                      learning_rate: float) -> str:
    """A message naming the step and the most likely cause of a non-finite loss or gradient."""
    for i, (_, shard, row) in enumerate(batch.located):
        if not torch.isfinite(batch.states[i][batch.mask[i]]).all():
            return (f"step {step}: the {what} is {value}: the student states of prompt {row} in {folders[shard]} are "
                    "not finite. Recompute that shard's student half (delete its student.json) and rerun.")
        if not torch.isfinite(batch.targets[i]).all():
            return (f"step {step}: the {what} is {value}: the target of prompt {row} in {folders[shard]} is not "
                    "finite. "
                    "Recompute that shard's teacher half (delete its teacher.json) and rerun.")
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    where = f" (non-finite weights: {', '.join(bad[:3])})" if bad else ""
    return (f"step {step}: the {what} is {value}; the batch is finite, so training diverged{where}. Likely cause: "
            f"training.learning_rate ({learning_rate}) is too high; lower it, keep training.grad_clip on, or lengthen "
            "training.warmup_steps. No checkpoint was written for this step; the last good one is kept.")


def train_adapter(paths: ProjectPaths, settings: Settings, *, train_folders: list[Path], val_folders: list[Path],
                  fingerprint: str, on_event: Callable[[str, dict], None] | None = None,
                  stop_after: int | None = None, sample_hardware: Callable[[], dict] | None = None) -> dict:
    """Train (or resume) the run ``fingerprint``; returns the final summary.

    ``on_event(kind, data)`` receives "note" (a message), "log", "validate", "best",
    "checkpoint" and "finished" events. ``stop_after`` ends the call after that many steps
    without finishing (tests, pausing); the next call resumes from the last checkpoint.
    ``sample_hardware()`` (GPU/CPU/RAM figures) is called at each log step; its figures go to
    the "log" event and to TensorBoard (<project>/tensorboard/<fingerprint>, lib/curves_log.py).
    """
    t = settings.training
    emit = on_event or (lambda kind, data: None)

    def note(message: str, *, warning: bool = False) -> None:
        (log.warning if warning else log.info)("%s", message)
        emit("note", {"message": message, "warning": warning})

    device = resolve_device(t.device)
    run_dir = paths.checkpoints_dir(fingerprint)
    final_dir = run_dir / FINAL_DIR
    if (final_dir / META_FILE).is_file():
        if final_is_intact(run_dir):
            note(f"training run {fingerprint} already finished; reusing {final_dir}")
            return atomic.read_json(final_dir / META_FILE)
        set_aside_final(run_dir)
        note(f"the finished weights in {final_dir} are damaged (their bytes differ from the recorded sha256); "
             f"moved them to {DAMAGED_FINAL_DIR} and training the last steps again from the newest intact checkpoint",
             warning=True)
    if not train_folders or not val_folders:
        raise TrainingError("training needs at least one train shard and one val shard")

    run_dir.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(run_dir)
    shape = adapter_shape(settings, train_folders)
    model = build_model(shape, seed=t.seed, grad_checkpoint=t.grad_checkpoint).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
    sizes = [shard_size(f) for f in train_folders]
    train_id, val_id = shards_identity(train_folders), shards_identity(val_folders)
    base_meta = {"fingerprint": fingerprint, "shape": shape.to_dict(), "training": settings.section_dict("training"),
                 "train_prompts": sum(sizes), "train_shards": train_id, "val_shards": val_id, "format": FORMAT}

    resumed = _restore(run_dir, model, optimizer, device, shape, ema=t.ema_decay > 0)
    if resumed is not None:
        note(f"resuming training run {fingerprint} from {resumed.checkpoint} (step {resumed.step} of {t.steps})")
    else:
        resumed = _Resumed()
        resumed.started = why_new_run(paths, fingerprint, base_meta["training"], train_id, val_id)
        note(resumed.started["message"], warning=bool(resumed.started.get("previous_run")))
        # Statistics travel in every checkpoint's weights, so a resume never rereads the whole train set.
        mean, std, _ = target_stats(train_folders, sigma_floor=t.sigma_floor)
        model.target_mean.copy_(mean)
        model.target_std.copy_(std)
        untrained = evaluate(model, val_folders, device=device, cosine_weight=t.cosine_weight)
        resumed.untrained = untrained["val_centred_cosine"]
        note(f"untrained adapter: val centred cosine {resumed.untrained:.4f}")
    step, history, best = resumed.step, resumed.history, resumed.best
    base_meta["started"] = resumed.started
    # With the average on, it is what is validated and kept (best/, final/); training steps the raw weights.
    average = WeightAverage(model, t.ema_decay) if t.ema_decay > 0 else None
    if average is not None and resumed.ema is not None:
        average.model.load_state_dict(resumed.ema)
    judged = average.model if average is not None else model

    def write_curves() -> str:
        svg = curves_svg(history)
        atomic.write_text(run_dir / CURVES_FILE, svg)
        return svg

    order = SampleOrder(sizes, t.seed)
    stop_at = t.steps if stop_after is None else min(t.steps, step + stop_after)
    curves = CurvesLog(paths.root / TENSORBOARD_DIR / fingerprint, resumed_at_step=step)
    if resumed.untrained is not None and step == 0:
        curves.scalars(0, {"val_centred_cosine": resumed.untrained}, "val")
    stream = ShardStream(train_folders, order, batch_size=t.batch_size, end_step=stop_at)
    model.train()
    use_autocast = device.type == "cuda"
    window_start, window_steps = time.perf_counter(), 0
    window_wait, window_bytes = stream.wait_seconds, stream.stats.bytes
    try:
        while step < stop_at:
            lr = lr_at(step, peak=t.learning_rate, warmup=t.warmup_steps, total=t.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = stream.batch(step)
            states, mask, targets = batch.states.to(device), batch.mask.to(device), batch.targets.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                pred = model(states, mask)
            z = standardize(targets, model.target_mean, model.target_std)
            loss = adapter_loss(pred.float(), z, cosine_weight=t.cosine_weight)
            optimizer.zero_grad(set_to_none=True)
            if torch.isfinite(loss):
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                           t.grad_clip if t.grad_clip > 0 else math.inf)
            if not torch.isfinite(loss) or not torch.isfinite(grad_norm):
                what, value = (("loss", float(loss.detach())) if not torch.isfinite(loss)
                               else ("gradient norm", float(grad_norm)))
                raise TrainingError(_non_finite_cause(step, what, value, batch=batch, folders=train_folders,
                                                      model=model, learning_rate=t.learning_rate))
            optimizer.step()
            step += 1
            if average is not None:
                average.update(model, step)
            faults.point("train-step")
            window_steps += 1

            if step % t.log_every == 0 or step == t.steps:
                elapsed = time.perf_counter() - window_start
                entry = {"step": step, "loss": float(loss.detach()), "lr": lr, "grad_norm": float(grad_norm),
                         "steps_per_s": window_steps / elapsed, "samples_per_s": window_steps * t.batch_size / elapsed,
                         "data_wait_fraction": (stream.wait_seconds - window_wait) / elapsed,
                         "read_mb_per_s": (stream.stats.bytes - window_bytes) / 1e6 / elapsed}
                history.append(entry)
                log.info("step %d/%d loss %.4f lr %.2e grad %.3f %.2f steps/s %.1f samples/s", step, t.steps,
                         entry["loss"], lr, entry["grad_norm"], entry["steps_per_s"], entry["samples_per_s"])
                hardware = sample_hardware() if sample_hardware else {}
                curves.scalars(step, entry, "train")
                curves.scalars(step, hardware, "hardware")
                emit("log", {**entry, **hardware})
                window_start, window_steps = time.perf_counter(), 0
                window_wait, window_bytes = stream.wait_seconds, stream.stats.bytes
            if step % t.validate_every == 0 or step == t.steps:
                metrics = evaluate(judged, val_folders, device=device, cosine_weight=t.cosine_weight)
                entry = {"step": step,
                         **{k: metrics[k] for k in ("val_centred_cosine", "empty_prompt_cosine", "val_loss")}}
                history.append(entry)
                curves.scalars(step, entry, "val")
                empty = metrics["empty_prompt_cosine"]
                log.info("step %d: val centred cosine %.4f (empty prompt %s), val loss %.4f", step,
                         metrics["val_centred_cosine"], "n/a" if empty is None else f"{empty:.4f}",
                         metrics["val_loss"])
                emit("validate", entry)
                if best is None or metrics["val_centred_cosine"] > best["val_centred_cosine"]:
                    best = {"step": step, "val_centred_cosine": metrics["val_centred_cosine"],
                            "empty_prompt_cosine": metrics["empty_prompt_cosine"], "val_loss": metrics["val_loss"]}
                    save_weights(run_dir / BEST_DIR, model=judged, step=step, meta={**base_meta, **best})
                    emit("best", best)
                # A checkpoint's time may not come for a while; keep the picture current for the UI.
                write_curves()
            if step % t.checkpoint_every == 0 or step == t.steps:
                meta = {**base_meta, "history": history, "best": best, "untrained": resumed.untrained,
                        "samples_seen": step * t.batch_size, "lr_next": lr_at(step, peak=t.learning_rate,
                                                                              warmup=t.warmup_steps, total=t.steps)}
                save_checkpoint(run_dir / f"step-{step:08d}", model=model, optimizer=optimizer, step=step, meta=meta,
                                ema=average.model if average is not None else None)
                prune_checkpoints(run_dir, t.keep_checkpoints)
                emit("checkpoint", {"step": step})
    finally:
        stream.close()
        curves.close()

    if step < t.steps:
        return {"finished": False, "step": step, "fingerprint": fingerprint}
    final = evaluate(judged, val_folders, device=device, cosine_weight=t.cosine_weight)
    text, advice = verdict(final["val_centred_cosine"])
    summary = {**base_meta, "finished": True, "step": step, "history": history, "best": best,
               "untrained_val_centred_cosine": resumed.untrained, "verdict": text, "advice": advice,
               "read_mb_per_s": stream.stats.mb_per_s,
               **{k: final[k] for k in ("val_centred_cosine", "empty_prompt_cosine", "val_loss", "per_shard")}}
    save_weights(final_dir, model=judged, step=step, meta=summary, extra={CURVES_FILE: write_curves()})
    note(f"training finished: {text} {advice}")
    emit("finished", {"step": step, "val_centred_cosine": final["val_centred_cosine"]})
    return summary


def load_final(run_dir: Path) -> tuple[Adapter, dict]:
    """The finished adapter, its weights checked against the sha256 recorded when training ended.

    Damaged weights are moved aside (final.damaged), so the adapter counts as unfinished and the
    next run trains the last steps again from the newest intact checkpoint.
    """
    meta = atomic.read_json(run_dir / FINAL_DIR / META_FILE)
    try:
        weights = safetensors_load(read_recorded(run_dir / FINAL_DIR, WEIGHTS_FILE, meta))
    except verify.CorruptFile as exc:
        set_aside_final(run_dir)
        raise TrainingError(f"{exc} It was moved to {run_dir / DAMAGED_FINAL_DIR}; `gguf-trainer run` trains "
                            "the last steps again from the newest intact checkpoint: same weights.") from exc
    model = Adapter(AdapterShape(**meta["shape"]))
    model.load_state_dict(weights)
    return model.eval(), meta


def set_aside_final(run_dir: Path) -> None:
    damaged = run_dir / DAMAGED_FINAL_DIR
    if damaged.exists():
        shutil.rmtree(damaged)
    os.replace(run_dir / FINAL_DIR, damaged)
    atomic.fsync_dir(run_dir)


def final_is_intact(run_dir: Path) -> bool:
    """Whether final/ holds finished weights whose bytes match their recorded sha256 (they are small)."""
    try:
        meta = atomic.read_json(run_dir / FINAL_DIR / META_FILE)
        read_recorded(run_dir / FINAL_DIR, WEIGHTS_FILE, meta)
    except (OSError, ValueError):
        return False
    return True
