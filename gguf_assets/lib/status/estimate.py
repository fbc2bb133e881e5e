"""How much memory a project's pair needs, before anything loads: from the safetensors headers (before any
download, from config.json alone, the model built on the meta device) and the adapter's shape, not a guess
from the model's name.

Counted: the teacher's and the student's weights at the dtype they compute in on a GPU (bf16 for the
teacher, precompute.student_dtype for the student), and the adapter's training state (f32 weights
and gradients, AdamW's two moments, the weight average when training.ema_decay is on). Not counted:
activations, which grow with precompute.token_budget and training.batch_size and are usually a
small share of the teacher's weights; the precompute lowers its own GPU budget on an out-of-memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.safetensors_io import safetensors_header
from gguf_assets.lib.materials.materials import load_manifest
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings, student_layers

GIB = 2**30
BYTES = {"bf16": 2, "f16": 2, "f32": 4}
ADAM_BYTES_PER_PARAM = 16  # f32 weights, f32 gradients, two f32 AdamW moments


@dataclass(frozen=True)
class MemoryLine:
    part: str  # teacher, student, adapter training
    gib: float | None  # None: not known yet (a hub repo not downloaded)
    how: str  # what was counted


def _folder(paths: ProjectPaths, role: str, value: str) -> Path | None:
    """A model's folder: a local one as configured, or a hub repo where the materials step downloaded it."""
    folder = paths.resolve_local(value) if value else None
    if folder is not None and (folder / "config.json").is_file():
        return folder
    try:
        entry = getattr(load_manifest(paths), role)
    except (OSError, ValueError, TypeError, UserError):
        return None
    if entry and entry.get("source") == value and (Path(entry["path"]) / "config.json").is_file():
        return Path(entry["path"])
    return None


def _teacher_shape(paths: ProjectPaths, settings: Settings, teacher: Path) -> tuple[int, int] | None:
    """(Q, D) of the teacher's targets; None while materials.query_rows is set but not fetched yet."""
    from gguf_assets.lib.precompute.teacher import teacher_shape

    rows = None
    if settings.materials.query_rows:
        from gguf_assets.lib.materials.query_rows import rows_location

        try:
            rows = rows_location(settings, load_manifest(paths), teacher)
        except (OSError, ValueError, TypeError, UserError):
            return None
    return teacher_shape(teacher, settings, rows)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n:,}"


def weight_params(folder: Path, *, skip: str = "") -> int:
    """Parameters in a model folder's *.safetensors (headers only), the ``skip`` file left out."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        if file.name == skip:
            continue
        header, _, _ = safetensors_header(file)
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


def config_params(folder: Path, settings: Settings) -> int:
    """Parameters of the model a folder's config.json describes, built on the meta device (no weights, no
    download): the same module tree the precompute's placement planner sizes (lib/precompute/teacher.py)."""
    import torch

    from gguf_assets.lib.precompute.teacher import empty_model

    return sum(p.numel() for p in empty_model(folder, settings, torch.bfloat16).parameters())


def model_params(folder: Path, settings: Settings, *, skip: str = "") -> tuple[int, str]:
    """(parameters, from where): the safetensors headers when the weights are there, else config.json alone."""
    n = weight_params(folder, skip=skip)
    if n:
        return n, ""
    return config_params(folder, settings), " (from config.json on the meta device: no weights here yet)"


def teacher_placements(folder: Path, settings: Settings, *, free_gpu_bytes: dict[int, int],
                       available_cpu_bytes: int) -> dict[str, dict[str, dict[str, float]]]:
    """Where the teacher would go, per device (layers, GiB), for sequential and balanced placement under the
    settings' budgets (precompute.teacher_gpu_memory_gib / teacher_cpu_memory_gib), planned on the meta device
    for the GPUs given: sequential by the precompute's own planner, balanced by transformers' even split."""
    import torch

    # Private, on purpose: it is what from_pretrained(device_map="balanced") calls, so the estimate is the real
    # placement's; accelerate's public pieces would be a second, slightly different planner.
    from transformers.integrations.accelerate import _get_device_map

    from gguf_assets.lib.precompute.teacher import (
        device_map_summary,
        empty_model,
        memory_budgets,
        sequential_device_map,
    )

    setting = settings.precompute.device
    device = torch.device(setting if setting.startswith("cuda:") else "cuda:0")
    max_memory = memory_budgets(settings, device, free_gpu_bytes=free_gpu_bytes,
                                available_cpu_bytes=available_cpu_bytes)
    model = empty_model(folder, settings, torch.bfloat16)
    natural = {k: max_memory[k] for k in sorted(k for k in max_memory if isinstance(k, int))} | {
        "cpu": max_memory["cpu"]}  # balanced splits over the GPUs in their own order, as transformers does
    return {"sequential": device_map_summary(model, sequential_device_map(model, max_memory)),
            "balanced": device_map_summary(model, _get_device_map(model, "balanced", natural, None))}


def adapter_params(student_dim: int, query_rows: int, target_dim: int, width: int, depth: int) -> int:
    """The adapter's parameter count (lib/training/adapter.py's layout: docs/gguf_layout.md's tensor table)."""
    mlp = 4 * width
    block = 3 * 2 * width + 8 * (width * width + width) + (width * mlp + mlp) + (mlp * width + width)
    return (query_rows * width + width + 2 * student_dim + student_dim * width + width + depth * block
            + 2 * width + width * target_dim + target_dim + 2 * query_rows * target_dim)


def estimate(paths: ProjectPaths, settings: Settings) -> list[MemoryLine]:
    m, p, t = settings.materials, settings.precompute, settings.training
    lines = []
    teacher, student = _folder(paths, "teacher", m.teacher), _folder(paths, "student", m.student)
    if p.mock_teacher:
        lines.append(MemoryLine("teacher", 0.0, "precompute.mock_teacher: no teacher is loaded"))
    elif teacher is None:
        lines.append(MemoryLine("teacher", None, f"{m.teacher or '(not set)'}: known once the materials are there"))
    else:
        n, source = model_params(teacher, settings, skip=m.query_rows_file)
        lines.append(MemoryLine("teacher", n * BYTES["bf16"] / GIB, f"{_count(n)} parameters in bf16 (GPU){source}; "
                                "on a CPU it computes in f32, twice that, in RAM"))
    if student is None:
        lines.append(MemoryLine("student", None, f"{m.student or '(not set)'}: known once the materials are there"))
    else:
        n, source = model_params(student, settings)
        lines.append(MemoryLine("student", n * BYTES[p.student_dtype] / GIB,
                                f"{_count(n)} parameters in {p.student_dtype} (precompute.student_dtype){source}"))
    shape = None
    if student is not None and p.mock_teacher:
        from gguf_assets.lib.precompute.teacher import MOCK_DIM, MOCK_QUERY_ROWS

        shape = MOCK_QUERY_ROWS, MOCK_DIM
    elif student is not None and teacher is not None:
        shape = _teacher_shape(paths, settings, teacher)
    if shape is not None:
        student_dim = json.loads((student / "config.json").read_text(encoding="utf-8"))["hidden_size"]
        query_rows, target_dim = shape
        if t.layer_fusion == "concat":  # several layers side by side: in_norm and in_proj k times as wide
            student_dim *= len(student_layers(m))
        n = adapter_params(student_dim, query_rows, target_dim, t.width, t.depth)
        per_param = ADAM_BYTES_PER_PARAM + (4 if t.ema_decay else 0)
        lines.append(MemoryLine("adapter training", n * per_param / GIB,
                                f"{_count(n)} parameters ({t.width} x {t.depth}, {query_rows} x {target_dim} "
                                f"out) x {per_param} bytes (weights, gradients, AdamW"
                                + (", weight average" if t.ema_decay else "") + "), plus activations"))
    else:
        lines.append(MemoryLine("adapter training", None, "known once the teacher and student are there"))
    return lines


def peak_gib(lines: list[MemoryLine]) -> float | None:
    """The most one GPU holds at once: precompute loads teacher and student together; training the adapter alone."""
    by_part = {line.part: line.gib for line in lines}
    if any(v is None for v in by_part.values()):
        return None
    return max(by_part["teacher"] + by_part["student"], by_part["adapter training"])


def size_text(gib: float | None) -> str:
    if gib is None:
        return "?"
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"


def placement_lines(paths: ProjectPaths, settings: Settings, gpus: list[dict]) -> list[str]:
    """Where the teacher would go on these GPUs (gpu_snapshot's: index, mem_total_gib, mem_used_gib), per device,
    under sequential and balanced placement; none when there is no GPU, the precompute runs on the CPU, or the
    teacher is not there yet (or is the mock one)."""
    import psutil

    folder = _folder(paths, "teacher", settings.materials.teacher)
    if not gpus or settings.precompute.device == "cpu" or settings.precompute.mock_teacher or folder is None:
        return []
    free = {int(g["index"]): int((g["mem_total_gib"] - g["mem_used_gib"]) * GIB) for g in gpus}
    try:
        placements = teacher_placements(folder, settings, free_gpu_bytes=free,
                                        available_cpu_bytes=psutil.virtual_memory().available)
    except (UserError, ValueError, OSError) as exc:  # e.g. precompute.device names a GPU this machine lacks
        return [f"teacher placement: {exc}"]
    chosen = settings.precompute.teacher_placement
    return [f"teacher placement {strategy}{' (precompute.teacher_placement)' if strategy == chosen else ''}: "
            f"{placement_text(summary)}" for strategy, summary in placements.items()]


def placement_text(summary: dict[str, dict[str, float]]) -> str:
    """A placement per device in one line: "cuda:0 24 layers 28.44 GiB, cuda:1 24 layers 27.86 GiB"."""
    return ", ".join(f"{device} {v['layers']} layers {v['gib']:.2f} GiB" for device, v in summary.items())


def estimate_lines(paths: ProjectPaths, settings: Settings, *, gpus: list[dict] | None = None) -> list[str]:
    """The estimate as console lines, with the GPUs this machine has (``gpus``: gpu_snapshot's, read when not
    given) and where the teacher would go on them (the studio shows the same)."""
    from gguf_assets.lib.telemetry.hardware import gpu_snapshot

    lines = estimate(paths, settings)
    out = [f"  {line.part:<17} {size_text(line.gib):>10}  {line.how}" for line in lines]
    peak = peak_gib(lines)
    gpus = gpu_snapshot() if gpus is None else gpus
    where = ", ".join(f"GPU {g['index']} {g['mem_total_gib']:.0f} GiB" for g in gpus) or "no NVIDIA GPU here"
    out.append(f"  peak on one GPU   {size_text(peak):>10}  teacher + student while the "
               f"shards are computed, or the adapter's training; this machine: {where}")
    return out + [f"  {line}" for line in placement_lines(paths, settings, gpus)]
