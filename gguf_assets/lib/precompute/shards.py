"""Shards: teacher targets and student states, one folder per shard, each half on its own.

    shards/<split>/<key>/prompts.jsonl         the shard's prompts (from the corpus)
    shards/<split>/<key>/teacher.safetensors   targets [n, Q, D]
    shards/<split>/<key>/teacher.json          fingerprint, sha256, bytes, timings, the device that computed it
    shards/<split>/<key>/student.safetensors   hidden [tokens, Ds], offsets [n+1], token_ids [tokens]
    shards/<split>/<key>/student.json          also dim (Ds) and the shard format

The student's rows are its final-norm states at every position of the prompt as ggk renders it, and token_ids
ggk's ids for it (lib/precompute/student.py).

A half is reused only if its fingerprint (everything it depends on) matches and its file
still has the recorded size and sha256; otherwise it is recomputed. The fingerprints, the plan and each half's
state are lib/precompute/shards_run.py's (torch-free, for `status` and the readers); this module computes and
writes the halves.

Shards are computed one at a time and each is written before the next starts, so peak
memory is one shard's targets and states, whatever the corpus size.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gguf_assets.lib.core import atomic, faults, verify
from gguf_assets.lib.core.f16 import F16_MAX
from gguf_assets.lib.materials.teacher.layout import LLADA_IMAGE_PIPELINE, QUERY_ROWS, TEACHER_FORWARDS
from gguf_assets.lib.precompute.half_state import HalfState
from gguf_assets.lib.precompute.shards_run import (
    ShardError,
    ShardPlan,
    data_file,
    halves_for_mode,
    plan_shards,
    shard_status,
)
from gguf_assets.lib.project import formats, settings_history
from gguf_assets.lib.project.layout import PROMPTS_FILE, ProjectPaths
from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.teacher_choice import teacher_choice
from gguf_assets.lib.telemetry.hardware import CUDA_VISIBLE_DEVICES
from gguf_assets.lib.telemetry.progress import Progress

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _write_half(folder: Path, half: str, tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    data_path = data_file(folder, half)
    with atomic.atomic_path(data_path) as tmp:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"fingerprint": meta["fingerprint"]})
        faults.point("shard-write", tmp)
    # finished_at (with started_at): when the half was busy, so the measured rate counts parallel workers once.
    meta = {**meta, **verify.record(data_path), "finished_at": round(time.time(), 3)}
    # The sidecar goes last: a shard half counts as done only once its sidecar exists.
    atomic.write_json(folder / f"{half}.json", meta)
    if half == "teacher" and "targets" in tensors:  # training's target statistics, ready for its first step
        from gguf_assets.lib.precompute.target_sums import store_target_sums  # torch: imported where it is needed

        store_target_sums(folder, tensors["targets"], meta["sha256"])
    return meta


class ShardBuilder:
    """Computes missing halves; loads each model only when some shard needs it."""

    def __init__(self, paths: ProjectPaths, settings: Settings, materials: MaterialsManifest) -> None:
        from gguf_assets.lib.telemetry.hardware import device_label, resolve_device

        self.paths, self.settings, self.materials = paths, settings, materials
        self._settings_hash = settings_history.remember(paths.root, settings)
        self.device = resolve_device(settings.precompute.device)
        # Which device computes, recorded in each half it writes: "cuda:1 (NVIDIA H200)" or "cpu", and the GPUs
        # this process was allowed to see (a worker of `run --workers auto` is pinned to one).
        self.where = {"device": device_label(self.device),
                      **({"cuda_visible_devices": os.environ[CUDA_VISIBLE_DEVICES]}
                         if CUDA_VISIBLE_DEVICES in os.environ else {})}
        self.choice = teacher_choice(settings)
        self._teacher = None
        self._student = None
        self.gpu_budget_gib: float | None = None  # the teacher's current GPU budget (CUDA only)

    def teacher(self, *, gpu_budget_gib: float | None = None):
        """The teacher, (re)loaded when a different GPU budget is asked for."""
        if self._teacher is not None and (gpu_budget_gib is None or gpu_budget_gib == self.gpu_budget_gib):
            return self._teacher
        if self._teacher is not None:
            import torch

            self._teacher = None  # free the old placement before loading the new one
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        from gguf_assets.lib.precompute.teacher_loader import load_teacher

        folder = Path(self.materials.teacher["path"]) if self.choice.loads_teacher_model else None
        rows = None
        if folder is not None and self.settings.materials.query_rows:
            from gguf_assets.lib.materials.query_rows import rows_location

            rows = rows_location(self.settings, self.materials, folder)
        self._teacher = load_teacher(self.choice, self.settings, teacher_folder=folder, student=self.student,
                                     device=self.device, gpu_budget_gib=gpu_budget_gib, rows=rows,
                                     kind=(self.materials.teacher or {}).get("kind"))
        self.gpu_budget_gib = gpu_budget_gib if gpu_budget_gib is not None else self._teacher.placement.gpu_budget_gib
        return self._teacher

    def student(self):
        if self._student is None:
            from gguf_assets.lib.precompute.student import Student

            self._student = Student(Path(self.materials.student["path"]), self.settings, self.device)
        return self._student

    def targets(self, prompts: list[str], *, on_batch=None):
        """The teacher's targets for ``prompts``, retrying CUDA out-of-memory with a lower GPU budget."""
        import torch

        from gguf_assets.lib.precompute.teacher import (
            auto_gpu_budget_gib,
            lower_budget_on_oom,
            oom_advice,
        )

        p = self.settings.precompute
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[p.target_dtype]
        if not self.choice.loads_teacher_model or self.device.type != "cuda":
            return self.teacher().encode(prompts, dtype=dtype, on_batch=on_batch)
        if self.gpu_budget_gib is None:
            self.gpu_budget_gib = auto_gpu_budget_gib(self.settings, self.device)
        result, _ = lower_budget_on_oom(
            lambda budget: self.teacher(gpu_budget_gib=budget).encode(prompts, dtype=dtype, on_batch=on_batch),
            budget_gib=self.gpu_budget_gib, placement=p.teacher_placement,
            advice=lambda budget: oom_advice(self.settings, gpu_budget_gib=budget))
        return result

    def compute(self, half: str, prompts: list[str], *, on_batch=None):
        """One half's results; running out of memory ends with what to lower."""
        from gguf_assets.lib.precompute.teacher import (
            PrecomputeOutOfMemory,
            TeacherError,
            is_out_of_memory,
            oom_advice,
        )

        try:
            if half == "teacher":
                return self.targets(prompts, on_batch=on_batch)
            return self.student().encode(prompts, on_batch=on_batch)
        except (TeacherError, PrecomputeOutOfMemory):
            raise
        except (MemoryError, RuntimeError) as exc:
            if is_out_of_memory(exc):
                raise PrecomputeOutOfMemory(f"the {half} ran out of memory on {self.device}: "
                                            f"{oom_advice(self.settings, half=half)}") from exc
            raise

    def _compute_half(self, plan: ShardPlan, half: str, *, on_batch=None) -> tuple[dict[str, torch.Tensor], dict]:
        """The tensors of one half and its sidecar fields (without sizes and checksum)."""
        meta = {"fingerprint": plan.fingerprints[half], "prompts": len(plan.prompts), "format": formats.SHARD_HALF,
                "settings_hash": self._settings_hash, **self.where}
        if half == "teacher":
            result = self.compute(half, plan.prompts, on_batch=on_batch)
            if not result.peak_abs <= F16_MAX:
                raise ShardError(f"shard {plan.split}/{plan.key}: teacher targets are non-finite or exceed the f16 "
                                 f"range (max |x| = {result.peak_abs:.3g}); check materials.teacher_layer.")
            kind = (self.materials.teacher or {}).get("kind") if self.choice.loads_teacher_model else None
            meta.update(query_rows=result.targets.shape[1], dim=result.targets.shape[2],
                        dtype=self.settings.precompute.target_dtype, text_tokens=result.text_tokens,
                        truncated=result.truncated, placement=self._teacher.placement.summary,
                        # what made them (the fingerprint holds both; here for people reading the shard)
                        teacher_kind=kind or ("mock" if self.choice.mock else QUERY_ROWS),
                        teacher_forward=TEACHER_FORWARDS.get(kind or QUERY_ROWS) if not self.choice.mock else None)
            if kind == LLADA_IMAGE_PIPELINE:  # every file of the code that ran, with its sha256 (in the fingerprint)
                meta["teacher_code"] = self.materials.teacher["remote_code"]
            return {"targets": result.targets}, meta
        states = self.compute(half, plan.prompts, on_batch=on_batch)
        meta.update(dim=states.hidden.shape[1], tokens=states.tokens,
                    truncated=states.truncated, dtype=self.settings.precompute.student_dtype)
        return {"hidden": states.hidden, "offsets": states.offsets, "token_ids": states.token_ids}, meta

    def build(self, plan: ShardPlan, *, progress: dict[str, Progress] | None = None) -> ShardReport:
        """Make the shard current; returns what was done per half, with counts and timings (no hardware)."""
        progress = progress or {}
        folder = plan.folder(self.paths)
        folder.mkdir(parents=True, exist_ok=True)
        atomic.remove_stale_temps(folder)
        prompts_body = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in plan.prompts)
        prompts_file = folder / PROMPTS_FILE
        if not prompts_file.is_file() or prompts_file.read_text(encoding="utf-8") != prompts_body:
            atomic.write_text(prompts_file, prompts_body)
        halves: dict[str, HalfReport] = {}
        placement, device_map = {}, None
        for half, status in shard_status(self.paths, self.settings, plan).items():
            meter = progress.get(half)
            if status == HalfState.CURRENT:
                halves[half] = HalfReport(status)
                if meter:
                    meter.skip(len(plan.prompts))
                continue
            if status == HalfState.CORRUPT:
                log.warning("shard %s/%s: %s half failed verification; recomputing it", plan.split, plan.key, half)
            # Until the new half is written, nothing may take the old bytes for current.
            (folder / f"{half}.json").unlink(missing_ok=True)
            start, started_at = time.perf_counter(), time.time()
            tensors, meta = self._compute_half(plan, half, on_batch=meter.advance if meter else None)
            meta["seconds"] = round(time.perf_counter() - start, 3)
            meta["started_at"] = round(started_at, 3)
            _write_half(folder, half, tensors, meta)
            del tensors  # one shard's results at most are alive at any time
            if half == "teacher":
                placement, device_map = self._teacher.placement.metadata(), meta["placement"]
            halves[half] = HalfReport(
                status, seconds=meta["seconds"], truncated=meta["truncated"],
                tokens=int(meta.get("text_tokens", meta.get("tokens", 0))),
                prompts_per_s=round(len(plan.prompts) / meta["seconds"], 3) if meta["seconds"] else 0.0)
        return ShardReport(plan.split, plan.key, len(plan.prompts), halves, placement=placement,
                           device_map=device_map, device=self.where["device"])


@dataclass(frozen=True)
class HalfReport:
    """One half of one shard in a precompute run: its state as the run found it and, when the run computed it
    (it was not current), how long that took, the prompts cut at the length limit and the tokens read."""

    status: HalfState
    seconds: float = 0.0
    truncated: int = 0
    tokens: int = 0
    prompts_per_s: float = 0.0

    @property
    def computed(self) -> bool:
        return self.status != HalfState.CURRENT


@dataclass(frozen=True)
class ShardReport:
    """What a precompute run did to one shard (``on_shard_done``, ``ShardRun.reports``): each half of the mode,
    in its order; where the teacher's layers went when the teacher half was computed; the hardware summary of
    the shard's time (``precompute_split`` adds it)."""

    split: str
    key: str
    prompts: int
    halves: Mapping[str, HalfReport]
    placement: Mapping[str, float | str] = field(default_factory=dict)  # Placement.metadata(): teacher_* figures
    device_map: Mapping[str, Mapping[str, float]] | None = None  # {device: {layers, gib}} when the teacher ran
    hardware: Mapping[str, float] = field(default_factory=dict)  # HardwareSampler.summary() of this shard
    device: str = ""  # which device computed its halves: "cuda:1 (NVIDIA H200)" or "cpu"

    def figures(self) -> dict[str, float | int | str]:
        """The shard's figures as flat Dagster metadata (the keys every version recorded): split, key, prompts;
        per half <half>_status and, when computed, the teacher's placement, <half>_seconds, _truncated, _tokens,
        _prompts_per_s; then the hardware summary. A half's state goes in as its plain str."""
        out: dict = {"split": self.split, "key": self.key, "prompts": self.prompts,
                     **({"device": self.device} if self.device else {})}
        for half, done in self.halves.items():
            out[f"{half}_status"] = done.status.value  # Dagster's serializer refuses enums it does not know
            if not done.computed:
                continue
            if half == "teacher":
                out.update(self.placement)
            out.update({f"{half}_seconds": done.seconds, f"{half}_truncated": done.truncated,
                        f"{half}_tokens": done.tokens, f"{half}_prompts_per_s": done.prompts_per_s})
        return {**out, **self.hardware}


@dataclass(frozen=True)
class HalfFigures:
    """One half's figures over a precompute run."""

    computed: int  # halves written (the rest were current)
    prompts_per_s: float
    tokens_per_s: float
    truncated: int  # prompts cut at the length limit


@dataclass(frozen=True)
class ShardRun:
    """What one precompute run did: a report per shard, and its totals."""

    reports: list[ShardReport]
    shards: int
    prompts: int
    seconds: float
    halves: dict[str, HalfFigures]
    placement: dict = field(default_factory=dict)  # where the teacher's layers went (teacher_*), if it loaded
    hardware: dict = field(default_factory=dict)  # the run's hardware summary (lib/telemetry/hardware.py)

    def computed(self, half: str) -> int:
        return self.halves[half].computed if half in self.halves else 0

    def metadata(self) -> dict:
        """The run's figures as flat metadata: shards, prompts, seconds, <half>_<figure>, placement, hardware."""
        out: dict = {"shards": self.shards, "prompts": self.prompts, "seconds": self.seconds}
        for half, figures in self.halves.items():
            out[f"{half}_halves_computed"] = figures.computed
            out.update({f"{half}_{k}": getattr(figures, k) for k in ("prompts_per_s", "tokens_per_s", "truncated")})
        return {**out, **self.placement, **self.hardware}


def precompute_split(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str, keys: list[str],
                     *, on_shard_done: Callable[[ShardReport], None] | None = None,
                     on_progress: Callable[[dict], None] | None = None,
                     sample_interval_s: float | None = None) -> ShardRun:
    """Make the given shards current, one at a time, with live progress and hardware figures.

    ``on_shard_done(report)`` runs as each shard is written; the report carries that shard's own
    figures and hardware summary. ``on_progress(figures)`` runs with each progress line (every
    PROGRESS_LOG_INTERVAL_S): the shard, the half, its rate and ETA and a hardware sample taken then.
    """
    plans = {p.key: p for p in plan_shards(paths, settings, materials, split)}
    unknown = [k for k in keys if k not in plans]
    if unknown:
        raise ShardError(f"{split} shards {unknown} do not exist in the current corpus "
                         f"({len(plans)} shards); rematerialize the corpus.")
    from gguf_assets.lib.telemetry.hardware import HardwareSampler

    builder = ShardBuilder(paths, settings, materials)
    total = sum(len(plans[k].prompts) for k in keys)
    sampler_kwargs = {} if sample_interval_s is None else {"interval_s": sample_interval_s}
    sampler = HardwareSampler(**sampler_kwargs)
    current = {"key": None}

    def progress_line(half: str):
        def emit(line: str) -> None:
            log.info("%s", line)
            if on_progress is not None:
                on_progress({"shard": current["key"], "half": half, **progress[half].figures(), **sampler.sample()})
        return emit

    progress = {half: Progress(f"{split} {half}", total, emit=progress_line(half))
                for half in halves_for_mode(settings.precompute.mode)}
    reports = []
    start = time.perf_counter()
    with sampler:
        for done, key in enumerate(keys, 1):
            current["key"] = key
            shard_start = sampler.clock()
            report = dataclasses.replace(builder.build(plans[key], progress=progress),
                                         hardware=sampler.summary(since=shard_start))
            reports.append(report)
            elapsed = time.perf_counter() - start
            eta = elapsed / done * (len(keys) - done)
            log.info("%s shard %s done (%d/%d shards, %.1fs elapsed, ETA %.1fs)", split, key, done, len(keys),
                     elapsed, eta)
            if on_shard_done:
                on_shard_done(report)
    seconds = time.perf_counter() - start
    halves = {}
    for half, meter in progress.items():
        figures = meter.figures()
        halves[half] = HalfFigures(computed=sum(1 for r in reports if r.halves[half].computed),
                                   prompts_per_s=figures["prompts_per_s"], tokens_per_s=figures["tokens_per_s"],
                                   truncated=sum(r.halves[half].truncated for r in reports))
    placement = builder._teacher.placement.metadata() if builder._teacher is not None else {}
    return ShardRun(reports, shards=len(keys), prompts=total, seconds=round(seconds, 3), halves=halves,
                    placement=placement, hardware=sampler.summary())


def build_shards(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str, keys: list[str],
                 *, on_shard_done: Callable[[ShardReport], None] | None = None) -> list[ShardReport]:
    """The per-shard reports of `precompute_split`."""
    return precompute_split(paths, settings, materials, split, keys, on_shard_done=on_shard_done).reports
