"""Adapter training: streamed shards, the trainer8 loss and schedule, exact resume.

The data order is a pure function of (seed, step): epoch e visits the shards in a seeded
order and each shard in a seeded permutation, so the batch at any step can be found
without replaying the ones before it. A checkpoint therefore needs only the step,
weights, optimizer and RNG state to continue bit-identically.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import re
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gguf_assets.lib import atomic
from gguf_assets.lib.adapter import Adapter, AdapterShape, adapter_loss, centred_cosine_rows, lr_at, standardize
from gguf_assets.lib.hardware import resolve_device
from gguf_assets.lib.layout import PROMPTS_FILE, STUDENT_FILE, TEACHER_FILE, ProjectPaths
from gguf_assets.lib.settings import Settings

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{8})$")
WEIGHTS_FILE = "adapter.safetensors"
STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"
# Settings that change speed or bookkeeping, not the trained weights.
NON_RESULT_KEYS = ("device", "grad_checkpoint", "log_every", "validate_every", "checkpoint_every", "keep_checkpoints")


class TrainingError(RuntimeError):
    pass


# -- data ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardData:
    targets: torch.Tensor   # [n, Q, D] stored dtype
    hidden: torch.Tensor    # [tokens, Ds]
    offsets: torch.Tensor   # [n + 1]
    texts: list[str]

    def states(self, i: int) -> torch.Tensor:
        return self.hidden[self.offsets[i]:self.offsets[i + 1]]


def load_shard(folder: Path) -> ShardData:
    t = load_file(str(folder / TEACHER_FILE))
    s = load_file(str(folder / STUDENT_FILE))
    texts = [json.loads(line)["text"] for line in (folder / PROMPTS_FILE).read_text(encoding="utf-8").splitlines()]
    return ShardData(t["targets"], s["hidden"], s["offsets"], texts)


def shard_size(folder: Path) -> int:
    return int(atomic.read_json(folder / "teacher.json")["prompts"])


class SampleOrder:
    """Global sample index → (shard position, row), epoch by epoch, from the seed alone."""

    def __init__(self, sizes: list[int], seed: int) -> None:
        self.sizes, self.seed, self.total = sizes, seed, sum(sizes)
        if self.total == 0:
            raise TrainingError("no training prompts in the train shards")
        self._epoch = -1

    def _prepare(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        self.shard_order = torch.randperm(len(self.sizes), generator=g).tolist()
        self.cumulative = []
        acc = 0
        for k in self.shard_order:
            acc += self.sizes[k]
            self.cumulative.append(acc)
        self.row_perms = {}
        self._epoch = epoch

    def locate(self, index: int) -> tuple[int, int]:
        epoch, r = divmod(index, self.total)
        self._prepare(epoch)
        pos = bisect.bisect_right(self.cumulative, r)
        shard = self.shard_order[pos]
        offset = r - (self.cumulative[pos - 1] if pos else 0)
        if shard not in self.row_perms:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 7919 + shard)
            self.row_perms[shard] = torch.randperm(self.sizes[shard], generator=g).tolist()
        return shard, self.row_perms[shard][offset]


class ShardCache:
    """Keeps at most ``capacity`` shards in memory, so memory does not grow with the dataset."""

    def __init__(self, folders: list[Path], capacity: int = 2) -> None:
        self.folders, self.capacity = folders, capacity
        self._cache: OrderedDict[int, ShardData] = OrderedDict()

    def get(self, index: int) -> ShardData:
        if index in self._cache:
            self._cache.move_to_end(index)
        else:
            self._cache[index] = load_shard(self.folders[index])
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return self._cache[index]


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
    """Per-(query row, dim) mean and floored std over all train targets, one shard at a time."""
    total, s1, s2 = 0, None, None
    for folder in folders:
        t = load_file(str(folder / TEACHER_FILE))["targets"].double()
        s1 = t.sum(0) if s1 is None else s1 + t.sum(0)
        s2 = (t * t).sum(0) if s2 is None else s2 + (t * t).sum(0)
        total += t.shape[0]
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
        per_shard.append({"shard": folder.name, "n": len(shard_cos), "val_centred_cosine": sum(shard_cos) / len(shard_cos)})
    model.train(was_training)
    n = len(cosines)
    return {"val_centred_cosine": sum(cosines) / n, "empty_prompt_cosine": (sum(empty) / len(empty)) if empty else None,
            "val_loss": sum(losses) / n, "per_shard": per_shard, "n": n}


# -- checkpoints --------------------------------------------------------------------------

def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(folder: Path, *, model: Adapter, optimizer: torch.optim.Optimizer, step: int, meta: dict) -> None:
    for name, p in model.state_dict().items():
        if not torch.isfinite(p).all():
            raise TrainingError(f"step {step}: parameter {name} is not finite; the checkpoint was not written.")
    with atomic.atomic_dir(folder) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / WEIGHTS_FILE))
        torch.save({"optimizer": optimizer.state_dict(), "rng": _rng_state(), "step": step}, tmp / STATE_FILE)
        (tmp / META_FILE).write_text(json.dumps({**meta, "step": step}, indent=2, sort_keys=True))


def latest_checkpoint(run_dir: Path) -> Path | None:
    steps = sorted(p for p in run_dir.glob("step-*") if STEP_DIR.match(p.name) and (p / META_FILE).is_file())
    return steps[-1] if steps else None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    steps = sorted(p for p in run_dir.glob("step-*") if STEP_DIR.match(p.name))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# -- training -----------------------------------------------------------------------------

def training_fingerprint(settings: Settings, train_fps: list[str], val_fps: list[str]) -> str:
    t = {k: v for k, v in settings.section_dict("training").items() if k not in NON_RESULT_KEYS}
    return atomic.fingerprint({"training": t, "train": train_fps, "val": val_fps, "format": 1})


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


def train_adapter(paths: ProjectPaths, settings: Settings, *, train_folders: list[Path], val_folders: list[Path],
                  fingerprint: str, on_event: Callable[[str, dict], None] | None = None,
                  stop_after: int | None = None) -> dict:
    """Train (or resume) the run ``fingerprint``; returns the final summary.

    ``stop_after`` ends the call after that many steps without finishing (tests, pausing).
    """
    t = settings.training
    emit = on_event or (lambda kind, data: None)
    device = resolve_device(t.device)
    run_dir = paths.checkpoints_dir(fingerprint)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(run_dir)
    final_dir = run_dir / "final"
    if (final_dir / META_FILE).is_file():
        log.info("training run %s already finished; reusing %s", fingerprint, final_dir)
        return atomic.read_json(final_dir / META_FILE)

    shape = adapter_shape(settings, train_folders)
    model = build_model(shape, seed=t.seed, grad_checkpoint=t.grad_checkpoint)
    mean, std, n_train = target_stats(train_folders, sigma_floor=t.sigma_floor)
    model.target_mean.copy_(mean)
    model.target_std.copy_(std)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
    base_meta = {"fingerprint": fingerprint, "shape": shape.to_dict(), "training": settings.section_dict("training"),
                 "train_prompts": n_train}

    step, history, best = 0, [], None
    untrained = None
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        model.load_state_dict(load_file(str(ckpt / WEIGHTS_FILE), device=str(device)))
        state = torch.load(ckpt / STATE_FILE, weights_only=True, map_location=device)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        meta = atomic.read_json(ckpt / META_FILE)
        step, history, best, untrained = meta["step"], meta.get("history", []), meta.get("best"), meta.get("untrained")
        log.info("resuming training run %s from %s (step %d of %d)", fingerprint, ckpt.name, step, t.steps)
        emit("resume", {"step": step})
    else:
        metrics = evaluate(model, val_folders, device=device, cosine_weight=t.cosine_weight)
        untrained = metrics["val_centred_cosine"]
        log.info("untrained adapter: val centred cosine %.4f", untrained)

    order = SampleOrder([shard_size(f) for f in train_folders], t.seed)
    cache = ShardCache(train_folders)
    model.train()
    use_autocast = device.type == "cuda"
    window_start, window_steps = time.perf_counter(), 0
    stop_at = t.steps if stop_after is None else min(t.steps, step + stop_after)
    while step < stop_at:
        lr = lr_at(step, peak=t.learning_rate, warmup=t.warmup_steps, total=t.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        samples = []
        for i in range(step * t.batch_size, (step + 1) * t.batch_size):
            shard_index, row = order.locate(i)
            shard = cache.get(shard_index)
            samples.append((shard.states(row), shard.targets[row]))
        states, mask, targets = collate(samples, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            pred = model(states, mask)
        z = standardize(targets, model.target_mean, model.target_std)
        loss = adapter_loss(pred.float(), z, cosine_weight=t.cosine_weight)
        if not torch.isfinite(loss):
            raise TrainingError(f"step {step}: the loss is {float(loss)}. Likely causes: learning_rate "
                                f"({t.learning_rate}) too high, or non-finite targets; lower the learning rate "
                                "or check the shards. The last good checkpoint is kept.")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
        if not torch.isfinite(grad_norm):
            raise TrainingError(f"step {step}: the gradient norm is {float(grad_norm)}. Lower training.learning_rate "
                                "or set training.grad_clip; the last good checkpoint is kept.")
        optimizer.step()
        step += 1
        window_steps += 1

        if step % t.log_every == 0 or step == t.steps:
            elapsed = time.perf_counter() - window_start
            entry = {"step": step, "loss": float(loss.detach()), "lr": lr, "grad_norm": float(grad_norm),
                     "steps_per_s": window_steps / elapsed, "samples_per_s": window_steps * t.batch_size / elapsed}
            history.append(entry)
            log.info("step %d/%d loss %.4f lr %.2e grad %.3f %.1f samples/s", step, t.steps, entry["loss"], lr,
                     entry["grad_norm"], entry["samples_per_s"])
            emit("log", entry)
            window_start, window_steps = time.perf_counter(), 0
        if step % t.validate_every == 0 or step == t.steps:
            metrics = evaluate(model, val_folders, device=device, cosine_weight=t.cosine_weight)
            entry = {"step": step, **{k: metrics[k] for k in ("val_centred_cosine", "empty_prompt_cosine", "val_loss")}}
            history.append(entry)
            log.info("step %d: val centred cosine %.4f (empty prompt %s)", step, metrics["val_centred_cosine"],
                     metrics["empty_prompt_cosine"])
            emit("validate", entry)
            if best is None or metrics["val_centred_cosine"] > best["val_centred_cosine"]:
                best = {"step": step, "val_centred_cosine": metrics["val_centred_cosine"]}
        if step % t.checkpoint_every == 0 or step == t.steps:
            meta = {**base_meta, "history": history, "best": best, "untrained": untrained}
            save_checkpoint(run_dir / f"step-{step:08d}", model=model, optimizer=optimizer, step=step, meta=meta)
            prune_checkpoints(run_dir, t.keep_checkpoints)
            emit("checkpoint", {"step": step})

    if step < t.steps:
        return {"finished": False, "step": step}
    final = evaluate(model, val_folders, device=device, cosine_weight=t.cosine_weight)
    summary = {**base_meta, "finished": True, "step": step, "history": history, "best": best,
               "untrained_val_centred_cosine": untrained, **{k: final[k] for k in
               ("val_centred_cosine", "empty_prompt_cosine", "val_loss", "per_shard")}}
    with atomic.atomic_dir(final_dir) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / WEIGHTS_FILE))
        (tmp / META_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def load_final(run_dir: Path) -> tuple[Adapter, dict]:
    meta = atomic.read_json(run_dir / "final" / META_FILE)
    model = Adapter(AdapterShape(**meta["shape"]))
    model.load_state_dict(load_file(str(run_dir / "final" / WEIGHTS_FILE)))
    return model.eval(), meta
