"""Shards: teacher targets and student states, one folder per shard, each half on its own.

    shards/<split>/<key>/prompts.jsonl         the shard's prompts (from the corpus)
    shards/<split>/<key>/teacher.safetensors   targets [n, Q, D]
    shards/<split>/<key>/teacher.json          fingerprint, sha256, bytes, timings, the device that computed it
    shards/<split>/<key>/student.safetensors   hidden [tokens, Ds], offsets [n+1], token_ids [tokens]
    shards/<split>/<key>/student.json          also dim (Ds) and the shard format

The student's rows are its final-norm states at every position of the prompt as ggk renders it, and token_ids
ggk's ids for it (lib/precompute/student.py).

A half is reused only if its fingerprint (everything it depends on) matches and its file
still has the recorded size and sha256; otherwise it is recomputed. The teacher half's
fingerprint has nothing of the student in it, so a student change never touches targets.

Shards are computed one at a time and each is written before the next starts, so peak
memory is one shard's targets and states, whatever the corpus size.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gguf_assets.lib.core import atomic, faults, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.f16 import F16_MAX
from gguf_assets.lib.corpus.corpus import read_split, shard_prompts
from gguf_assets.lib.materials.materials_run import chain_materials
from gguf_assets.lib.materials.teacher.layout import LLADA_IMAGE_PIPELINE, QUERY_ROWS, TEACHER_FORWARDS
from gguf_assets.lib.precompute.half_state import HalfState
from gguf_assets.lib.project import formats, settings_history
from gguf_assets.lib.project.layout import (
    PROMPTS_FILE,
    STUDENT_FILE,
    TEACHER_FILE,
    ProjectPaths,
    shard_key,
)
from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.stage import Chain, Stage, StageState, State, older_format, why_stale
from gguf_assets.lib.project.teacher_choice import teacher_choice
from gguf_assets.lib.telemetry.hardware import CUDA_VISIBLE_DEVICES
from gguf_assets.lib.telemetry.progress import Progress

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

HALVES = ("teacher", "student")


class ShardError(UserError, RuntimeError):
    pass


def prompts_hash(prompts: list[str]) -> str:
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()


def half_settings(half: str, settings: Settings) -> dict:
    """The settings a shard half is computed from. Batch sizes and devices are left out: they
    change speed, not results. Part of the half's fingerprint, and what Dagster observes."""
    p = settings.precompute
    if half == "teacher":
        return {**teacher_choice(settings).targets_settings(settings), "dtype": p.target_dtype,
                "template": p.prompt_template}
    return {"conditioning": p.conditioning, "dtype": p.student_dtype}


def half_fingerprint(half: str, settings: Settings, materials: MaterialsManifest, shard_prompts_hash: str) -> str:
    """Everything a half depends on: its settings, the pinned models it runs, and its prompts."""
    model = "student" if half == "student" else teacher_choice(settings).targets_model
    extra = {}
    kind = (materials.teacher or {}).get("kind") if half == "teacher" and model == "teacher" else None
    if kind == LLADA_IMAGE_PIPELINE:
        # The pipeline's own forward: its version, and the modeling code it ran (a changed file recomputes).
        # Query rows, their layer and the template are the kind's own, so those settings do not enter.
        p = settings.precompute
        return atomic.fingerprint({"half": half, "prompts": shard_prompts_hash, "kind": kind,
                                   "forward": TEACHER_FORWARDS[kind], "remote_code": materials.teacher["remote_code"],
                                   "dtype": p.target_dtype, model: materials.pin(model), "format": formats.SHARD_HALF})
    if half == "teacher" and model == "teacher" and settings.materials.query_rows:
        # The rows' content (the tensor's sha256): a moved branch of their repo makes the targets stale.
        extra["query_rows_sha256"] = (materials.query_rows or {}).get("tensor_sha256")
    return atomic.fingerprint({"half": half, "prompts": shard_prompts_hash, **half_settings(half, settings),
                               model: materials.pin(model), "format": formats.SHARD_HALF, **extra})


def halves_for_mode(mode: str) -> tuple[str, ...]:
    return {"teacher+student": HALVES, "teacher": ("teacher",), "student": ("student",)}[mode]


def half_status(folder: Path, half: str, fingerprint: str) -> HalfState:
    """Current, missing, stale (settings changed) or corrupt (bytes changed).

    The data file is checked by its recorded size, mtime and inode (lib/core/verify.py): no byte is
    read unless its stamp is unsure; then its content decides, and the new stamp is stored.
    Readers check the content as they read it (lib/core/safetensors_io.py: read_torch).
    """
    meta_path, data_path = folder / f"{half}.json", data_file(folder, half)
    if not meta_path.is_file() or not data_path.is_file():
        return HalfState.MISSING
    try:
        meta = atomic.read_json(meta_path)
    except (OSError, json.JSONDecodeError):
        return HalfState.CORRUPT
    if meta.get("fingerprint") != fingerprint:
        return HalfState.STALE
    now = verify.confirmed(data_path, meta)
    if now is None:
        return HalfState.CORRUPT
    verify.store_refreshed(meta_path, meta, now)
    return HalfState.CURRENT


def forget_half(folder: Path, half: str) -> None:
    """Drop a half's record (its sidecar), so the planner computes the half again."""
    (folder / f"{half}.json").unlink(missing_ok=True)


@dataclass
class ShardPlan:
    split: str
    key: str
    prompts: list[str]
    fingerprints: dict[str, str]

    def folder(self, paths: ProjectPaths) -> Path:
        return paths.shard_dir(self.split, self.key)


def shard_size(settings: Settings, split: str) -> int:
    return settings.precompute.shard_size if split == "train" else settings.precompute.val_shard_size


def shards_stage_settings(settings: Settings, split: str) -> dict:
    """What a split's shards are computed from, as settings/<split>_shards shows it: each half's settings, the
    models the mode loads and the shard size (it places prompts in shards: a new one makes them missing).

    The fingerprints see a model through its pin (source and commit); the shards list the sources they
    load, so a new source marks them, and not the stages that never load it."""
    choice = teacher_choice(settings)
    m = settings.materials
    return {"halves": {half: half_settings(half, settings) for half in halves_for_mode(settings.precompute.mode)},
            "models": {"student": m.student if choice.loads_student_model else None,
                       "teacher": m.teacher if choice.loads_teacher_model else None},
            "shard_size": shard_size(settings, split)}


def plan_shards(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str) -> list[ShardPlan]:
    size = shard_size(settings, split)
    plans = []
    for index, prompts in enumerate(shard_prompts(read_split(paths, split), size)):
        h = prompts_hash(prompts)
        plans.append(ShardPlan(split, shard_key(index), prompts,
                               {half: half_fingerprint(half, settings, materials, h) for half in HALVES}))
    return plans


def shard_status(paths: ProjectPaths, settings: Settings, plan: ShardPlan) -> dict[str, HalfState]:
    return {half: half_status(plan.folder(paths), half, plan.fingerprints[half])
            for half in halves_for_mode(settings.precompute.mode)}


def planned_fingerprints(settings: Settings, plans: list[ShardPlan]) -> list[str]:
    """Per planned shard, the fingerprint of the halves the mode makes (what training and the report read)."""
    halves = halves_for_mode(settings.precompute.mode)
    return [":".join(plan.fingerprints[h] for h in halves) for plan in plans]


def shard_fingerprints(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str) -> list[str]:
    """A split's shard fingerprints, as they are when made now: what the adapter's and the report's fingerprints
    chain."""
    return planned_fingerprints(settings, plan_shards(paths, settings, materials, split))


@dataclass(frozen=True)
class SplitView:
    """One split's shards as planned from the corpus, each plan's half states (checked once) and the planned
    fingerprints (what training and the report chain)."""

    plans: list[ShardPlan]
    halves: Mapping[str, Mapping[str, HalfState]]  # shard key -> half -> state
    fingerprints: list[str]


def split_view(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str,
               plans: list[ShardPlan] | None = None) -> SplitView:
    """``split`` planned now (it reads the corpus split), or ``plans`` made earlier with their halves checked again."""
    plans = plan_shards(paths, settings, materials, split) if plans is None else plans
    return SplitView(plans, {p.key: shard_status(paths, settings, p) for p in plans},
                     planned_fingerprints(settings, plans))


def chain_split(chain: Chain, split: str) -> SplitView:
    """``split``'s view, planned once per status question."""
    return chain.once(f"split:{split}", lambda: split_view(chain.paths, chain.settings, chain_materials(chain), split))


def chain_shard_fingerprints(chain: Chain, split: str) -> list[str]:
    """``split``'s planned shard fingerprints: the question's split view's when it has one, else planned alone,
    once (their halves are not checked)."""
    if (view := chain.known.get(f"split:{split}")) is not None:
        return view.fingerprints
    return chain.once(f"shard_fingerprints:{split}", lambda: shard_fingerprints(chain.paths, chain.settings,
                                                                                chain_materials(chain), split))


def _split_state(stage: Stage, chain: Chain) -> StageState:
    """A split's state from its shards' half states, with how many are current and why the rest are not."""
    split = stage.name.removesuffix("_shards")
    view = chain_split(chain, split)
    states = {key: set(halves.values()) for key, halves in view.halves.items()}
    todo = [key for key, st in states.items() if st != {HalfState.CURRENT}]
    state = _shards_state(states, todo)
    detail = f"{len(view.plans) - len(todo)}/{len(view.plans)} shards current"
    if state in (State.STALE, State.DAMAGED):
        detail += f"; {_why_shards_stale(stage, chain, [p for p in view.plans if p.key in todo])}"
    return StageState(stage.name, state, detail)


def _shards_state(states: dict[str, set[HalfState]], todo: list[str]) -> State:
    """A split's state from its shards' half states: damaged when a half's bytes changed on disk; stale when
    one was made under other settings; partial when some shards are done and only unwritten halves are left
    (a run cut off); missing when none is done."""
    if not todo:
        return State.CURRENT
    left = set().union(*(states[key] for key in todo))
    if HalfState.CORRUPT in left:
        return State.DAMAGED
    if HalfState.STALE in left:
        return State.STALE
    return State.PARTIAL if len(todo) < len(states) or HalfState.CURRENT in left else State.MISSING


def _why_shards_stale(stage: Stage, chain: Chain, todo: list[ShardPlan]) -> str:
    """Why the first stale shard is stale: the settings its half was made under, or a changed file."""
    split = stage.name.removesuffix("_shards")
    for plan in todo:
        folder = plan.folder(chain.paths)
        for half in halves_for_mode(chain.settings.precompute.mode):
            state = half_status(folder, half, plan.fingerprints[half])
            if state == HalfState.CORRUPT:
                return f"shard {split}/{plan.key}: its {half} half changed on disk"
            if state == HalfState.STALE:
                if older := older_format(folder / f"{half}.json", "shard"):
                    return f"shard {split}/{plan.key}: its {half} half was {older}"
                return why_stale(chain, stage, folder / f"{half}.json",
                                 f"shard {split}/{plan.key}: its {half} half was made from other prompts or models")
    return "some shards were made under other settings"


def _shards_stage(split: str) -> Stage:
    """A split's shards as a stage: no one record (each half has its own), so its state is _split_state's."""
    return Stage(f"{split}_shards", f"{split.capitalize()} shards",
                 record=lambda paths, settings: paths.root / "shards" / split,
                 settings=lambda settings: shards_stage_settings(settings, split),
                 fingerprint=lambda chain: atomic.fingerprint(chain_shard_fingerprints(chain, split)),
                 state=_split_state)


TRAIN_SHARDS_STAGE, VAL_SHARDS_STAGE = _shards_stage("train"), _shards_stage("val")


def data_file(folder: Path, half: str) -> Path:
    return folder / (TEACHER_FILE if half == "teacher" else STUDENT_FILE)


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


def require_current(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str) -> list[Path]:
    """The split's shard folders, after checking every half the mode needs is current.

    Readers (training, evaluation) call this so a stale or changed half is never used; they check
    each file's content against its recorded sha256 as they read it.
    """
    plans = plan_shards(paths, settings, materials, split)
    bad = [f"{plan.key} {half} half is {state}" for plan in plans
           for half, state in shard_status(paths, settings, plan).items() if state != HalfState.CURRENT]
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ShardError(f"{split} shards are not current ({shown}). Materialize {split}_shards again: "
                         "exactly those halves are recomputed.")
    return [plan.folder(paths) for plan in plans]


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
