"""Shards: teacher targets and student states, one folder per shard, each half on its own.

    shards/<split>/<key>/prompts.jsonl         the shard's prompts (from the corpus)
    shards/<split>/<key>/teacher.safetensors   targets [n, Q, D]
    shards/<split>/<key>/teacher.json          fingerprint, sha256, bytes, timings
    shards/<split>/<key>/student.safetensors   hidden [tokens, Ds], offsets [n+1], token_ids [tokens]
    shards/<split>/<key>/student.json

A half is reused only if its fingerprint (everything it depends on) matches and its file
still has the recorded size and sha256; otherwise it is recomputed. The teacher half's
fingerprint has nothing of the student in it, so a student change never touches targets.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from gguf_assets.lib import atomic
from gguf_assets.lib.corpus import read_split, shard_prompts
from gguf_assets.lib.hardware import resolve_device
from gguf_assets.lib.layout import PROMPTS_FILE, STUDENT_FILE, TEACHER_FILE, ProjectPaths, shard_key
from gguf_assets.lib.materials import pins
from gguf_assets.lib.settings import Settings

log = logging.getLogger(__name__)

HALVES = ("teacher", "student")
TARGET_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
F16_MAX = 65504.0


class ShardError(RuntimeError):
    pass


def prompts_hash(prompts: list[str]) -> str:
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()


def half_fingerprint(half: str, settings: Settings, materials: dict, shard_prompts_hash: str) -> str:
    """Everything a half depends on. Batch sizes and devices are left out: they change speed, not results."""
    m, p = settings.materials, settings.precompute
    if half == "teacher":
        source = {"mock": True, "student": pins(materials, "student"), "student_layer": m.student_layer,
                  "student_dtype": p.student_dtype} if p.mock_teacher else {
            "teacher": pins(materials, "teacher"), "query_rows": [m.query_rows_file, m.query_rows_tensor],
            "layer": m.teacher_layer}
        deps = {**source, "dtype": p.target_dtype}
    else:
        deps = {"student": pins(materials, "student"), "layer": m.student_layer, "dtype": p.student_dtype}
    return atomic.fingerprint({"half": half, "template": p.prompt_template, "prompts": shard_prompts_hash, **deps,
                               "format": 1})


def halves_for_mode(mode: str) -> tuple[str, ...]:
    return {"teacher+student": HALVES, "teacher": ("teacher",), "student": ("student",)}[mode]


def half_status(folder: Path, half: str, fingerprint: str, *, verify: bool = True) -> str:
    """'current', 'missing', 'stale' (settings changed) or 'corrupt' (bytes changed)."""
    meta_path, data_path = folder / f"{half}.json", folder / (TEACHER_FILE if half == "teacher" else STUDENT_FILE)
    if not meta_path.is_file() or not data_path.is_file():
        return "missing"
    try:
        meta = atomic.read_json(meta_path)
    except (OSError, json.JSONDecodeError):
        return "corrupt"
    if meta.get("fingerprint") != fingerprint:
        return "stale"
    if data_path.stat().st_size != meta.get("bytes"):
        return "corrupt"
    if verify and atomic.sha256_file(data_path) != meta.get("sha256"):
        return "corrupt"
    return "current"


@dataclass
class ShardPlan:
    split: str
    key: str
    prompts: list[str]
    fingerprints: dict[str, str]

    def folder(self, paths: ProjectPaths) -> Path:
        return paths.shard_dir(self.split, self.key)


def plan_shards(paths: ProjectPaths, settings: Settings, materials: dict, split: str) -> list[ShardPlan]:
    size = settings.precompute.shard_size if split == "train" else settings.precompute.val_shard_size
    plans = []
    for index, prompts in enumerate(shard_prompts(read_split(paths, split), size)):
        h = prompts_hash(prompts)
        plans.append(ShardPlan(split, shard_key(index), prompts,
                               {half: half_fingerprint(half, settings, materials, h) for half in HALVES}))
    return plans


def shard_status(paths: ProjectPaths, settings: Settings, plan: ShardPlan, *, verify: bool = True) -> dict[str, str]:
    return {half: half_status(plan.folder(paths), half, plan.fingerprints[half], verify=verify)
            for half in halves_for_mode(settings.precompute.mode)}


def _write_half(folder: Path, half: str, tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    data_path = folder / (TEACHER_FILE if half == "teacher" else STUDENT_FILE)
    with atomic.atomic_path(data_path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"fingerprint": meta["fingerprint"]})
    meta = {**meta, "bytes": data_path.stat().st_size, "sha256": atomic.sha256_file(data_path)}
    # The sidecar goes last: a shard half counts as done only once its sidecar exists.
    atomic.write_json(folder / f"{half}.json", meta)
    return meta


class ShardBuilder:
    """Computes missing halves; loads each model only when some shard needs it."""

    def __init__(self, paths: ProjectPaths, settings: Settings, materials: dict) -> None:
        self.paths, self.settings, self.materials = paths, settings, materials
        self.device = resolve_device(settings.precompute.device)
        self._teacher = None
        self._student = None

    def teacher(self):
        if self._teacher is None:
            from gguf_assets.lib.teacher import HFTeacher, MockTeacher

            p = self.settings.precompute
            if p.mock_teacher:
                self._teacher = MockTeacher(self.student())
            else:
                self._teacher = HFTeacher(Path(self.materials["teacher"]["path"]), self.settings, self.device)
        return self._teacher

    def student(self):
        if self._student is None:
            from gguf_assets.lib.student import Student

            self._student = Student(Path(self.materials["student"]["path"]), self.settings, self.device)
        return self._student

    def build(self, plan: ShardPlan) -> dict:
        """Make the shard current; returns what was done per half and timings."""
        folder = plan.folder(self.paths)
        folder.mkdir(parents=True, exist_ok=True)
        atomic.remove_stale_temps(folder)
        prompts_body = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in plan.prompts)
        prompts_file = folder / PROMPTS_FILE
        if not prompts_file.is_file() or prompts_file.read_text(encoding="utf-8") != prompts_body:
            atomic.write_text(prompts_file, prompts_body)
        report: dict = {"split": plan.split, "key": plan.key, "prompts": len(plan.prompts)}
        for half, status in shard_status(self.paths, self.settings, plan).items():
            report[f"{half}_status"] = status
            if status == "current":
                continue
            if status == "corrupt":
                log.warning("shard %s/%s: %s half failed verification; recomputing it", plan.split, plan.key, half)
            start = time.perf_counter()
            meta = {"fingerprint": plan.fingerprints[half], "prompts": len(plan.prompts)}
            if half == "teacher":
                targets = self.teacher().encode(plan.prompts)
                peak = float(targets.abs().max()) if targets.numel() else 0.0
                if not torch.isfinite(targets).all() or peak > F16_MAX:
                    raise ShardError(f"shard {plan.split}/{plan.key}: teacher targets are non-finite or exceed the f16 "
                                     f"range (max |x| = {peak:.3g}); check materials.teacher_layer.")
                target_dtype = self.settings.precompute.target_dtype
                tensors = {"targets": targets.to(TARGET_DTYPES[target_dtype])}
                meta.update(query_rows=targets.shape[1], dim=targets.shape[2], dtype=target_dtype)
            else:
                states, tokens = self.student().encode(plan.prompts)
                lengths = torch.tensor([0] + [s.shape[0] for s in states], dtype=torch.int64)
                tensors = {"hidden": torch.cat(states) if states else torch.empty(0, self.student().dim),
                           "offsets": lengths.cumsum(0),
                           "token_ids": torch.tensor([t for row in tokens for t in row], dtype=torch.int32)}
                meta.update(dim=tensors["hidden"].shape[1], tokens=int(lengths.sum()),
                            dtype=self.settings.precompute.student_dtype)
            meta["seconds"] = round(time.perf_counter() - start, 3)
            _write_half(folder, half, tensors, meta)
            report[f"{half}_seconds"] = meta["seconds"]
        return report


def build_shards(paths: ProjectPaths, settings: Settings, materials: dict, split: str, keys: list[str],
                 *, on_shard_done: Callable[[dict], None] | None = None) -> list[dict]:
    plans = {p.key: p for p in plan_shards(paths, settings, materials, split)}
    unknown = [k for k in keys if k not in plans]
    if unknown:
        raise ShardError(f"{split} shards {unknown} do not exist in the current corpus "
                         f"({len(plans)} shards); rematerialize the corpus.")
    builder = ShardBuilder(paths, settings, materials)
    reports = []
    start = time.perf_counter()
    for done, key in enumerate(keys, 1):
        report = builder.build(plans[key])
        reports.append(report)
        elapsed = time.perf_counter() - start
        eta = elapsed / done * (len(keys) - done)
        log.info("%s shard %s done (%d/%d, %.1fs elapsed, ETA %.1fs)", split, key, done, len(keys), elapsed, eta)
        if on_shard_done:
            on_shard_done(report)
    return reports
