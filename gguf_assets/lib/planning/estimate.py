"""How much memory a project's pair needs, before anything loads: from the safetensors headers (before any
download, from config.json alone, the model built on the meta device) and the adapter's shape, not a guess
from the model's name. A hub id not downloaded yet is answered from its config.json and weights index, read from
the hub (kilobytes; lib/materials/hub_shapes.py keeps them in the project's .cache); the query rows' Q from their
header, wherever they are. What cannot be known is one line that says what to add, never an exception.

Where the teacher goes on the GPUs (this machine's, or sizes the user names) is planned on the meta device by the
precompute's own planner, and its speed scaled from the seed's one measurement (see prompts_per_s).

Counted: the teacher's and the student's weights at the dtype they compute in on a GPU (bf16 for the
teacher, precompute.student_dtype for the student), and the adapter's training state (f32 weights
and gradients, AdamW's two moments, the weight average when training.ema_decay is on). Not counted:
activations, which grow with precompute.token_budget and training.batch_size and are usually a
small share of the teacher's weights; the precompute lowers its own GPU budget on an out-of-memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.safetensors_io import safetensors_header
from gguf_assets.lib.core.units import bytes_text
from gguf_assets.lib.materials import hub, hub_shapes
from gguf_assets.lib.materials import query_rows as qr
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.materials.student import from_gguf as gguf_student
from gguf_assets.lib.materials.teacher import layout
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.teacher_choice import MOCK_DIM, MOCK_QUERY_ROWS, blocks_for_layer
from gguf_assets.lib.training.kept_steps import scheduled_steps

GIB = 2**30
BYTES = {"bf16": 2, "f16": 2, "f32": 4}
ADAM_BYTES_PER_PARAM = 16  # f32 weights, f32 gradients, two f32 AdamW moments
USUAL_QUERY_ROWS = 256  # what text-to-image checkpoints ship (DESIGN.md §1); used only while the rows are unknown


@dataclass(frozen=True)
class MemoryLine:
    part: str  # teacher, student, adapter training
    gib: float | None  # None: not known yet (a hub repo not downloaded)
    how: str  # what was counted
    params: int | None = None  # the adapter's parameter count (on its "adapter training" line, when known)


def _folder(paths: ProjectPaths, role: str, value: str) -> Path | None:
    """A model's folder: a local one as configured, or a hub repo where the materials step downloaded it."""
    folder = paths.resolve_local(value) if value else None
    if folder is not None and _readable(folder):
        return folder
    try:
        entry = getattr(load_manifest(paths), role)
    except (OSError, ValueError, TypeError, UserError):
        return None
    if entry and entry.get("source") == value and _readable(Path(entry["path"])):
        return Path(entry["path"])
    return None


def _readable(folder: Path) -> bool:
    """A model folder with its config.json, or an LLaDA-Image pipeline with its text encoder's."""
    return (folder / "config.json").is_file() or layout.is_pipeline_folder(folder)


@dataclass(frozen=True)
class ModelConfig:
    """Where a model's config.json is (its folder, the materials' download, or the hub cache) and what that is,
    or, when it cannot be had, why (``folder`` None, ``why`` one line naming what to add)."""

    folder: Path | None
    why: str = ""  # with a folder: where it came from, for the "how" text; without: what is missing


def model_config(paths: ProjectPaths, settings: Settings, role: str, *, token: str | None = None,
                 options: hub.HubOptions | None = None, ask_hub: bool = True) -> ModelConfig:
    """materials.<role>'s config folder; a hub id not downloaded yet is read from the hub (config.json and the
    weights index, kilobytes; kept in the project's .cache), never its weights; ``ask_hub`` False: from the
    .cache only."""
    value = getattr(settings.materials, role)
    folder = _folder(paths, role, value)
    if folder is not None:
        return ModelConfig(folder)
    if not value:
        return ModelConfig(None, f"materials.{role} is not set: set it to a hub repo id or a local folder")
    local = paths.resolve_local(value)
    if role == "student" and gguf_student.is_gguf_source(value) and local.is_file():
        return _gguf_student_config(paths, value, local)
    if local.exists():
        return ModelConfig(None, f"materials.{role} = {value!r}: {local} has no config.json; add the model's "
                                 "config.json (the weights may come later)")
    if not hub.is_repo_source(value):
        return ModelConfig(None, f"materials.{role} = {value!r}: no such folder ({local}) and not a hub repo id")
    skip = settings.materials.query_rows_file if role == "teacher" else ""
    try:
        remote = hub_shapes.hub_model(paths.cache_dir, value, skip=skip, token=token, options=options,
                                      ask_hub=ask_hub)
    except UserError as exc:  # HubError included: its first line names the repo and the fix
        return ModelConfig(None, f"the estimate needs the hub for {value}: {str(exc).splitlines()[0]}")
    except OSError as exc:  # a read-only project folder: nowhere to keep what the hub said
        return ModelConfig(None, f"{value}: cannot keep the hub's answer in {paths.cache_dir} ({exc}); make the "
                                 "project folder writable")
    weights = f"the weights, {size_text(remote.weights_bytes / GIB)} in {remote.weight_files} file(s), not downloaded"
    if layout.is_pipeline_folder(remote.folder):  # how its text encoder was sized follows (pipeline_params)
        return ModelConfig(remote.folder, f" (the configs from the hub at {remote.commit[:12]}, "
                                          f"{remote.read_bytes / 1024:.1f} KiB read; {weights})")
    return ModelConfig(remote.folder, f" (config.json from the hub at {remote.commit[:12]}, "
                                      f"{remote.read_bytes / 1024:.1f} KiB read, built on the meta device; {weights})")


def teacher_check(paths: ProjectPaths, settings: Settings, *, token: str | None = None,
                  options: hub.HubOptions | None = None) -> tuple[bool, str] | None:
    """An LLaDA-Image teacher checked before its weights (lib/materials/teacher/preflight.py), as the materials step
    checks it: (passed, one line). None for another teacher. A hub pipeline's weight headers are read by range."""
    from gguf_assets.lib.materials.teacher import preflight as teacher_preflight

    if settings.precompute.mock_teacher:
        return None
    config = model_config(paths, settings, "teacher", token=token, options=options)
    source = settings.materials.teacher
    if config.folder is None:
        # A pipeline the hub answered for but whose code or configs were refused; other gaps are the memory lines'
        return (False, config.why) if f"{layout.TEXT_ENCODER_DIR}/" in config.why else None
    if not layout.is_pipeline_folder(config.folder):
        return None
    folder, served = config.folder, []
    local = teacher_preflight.local_headers(folder)
    remote = None
    if hub.is_repo_source(source) and not paths.resolve_local(source).exists():
        ref = hub.RepoRef.parse(source, kind="model")
        listing = hub.list_repo(ref, revision=folder.name if hub.COMMIT.match(folder.name) else None, token=token,
                                options=options or hub.HubOptions())
        remote = hub_shapes.range_headers(ref, listing, paths.cache_dir / "headers", token=token,
                                          options=options or hub.HubOptions(), served=served)

    def header_of(rel: str) -> dict | None:
        found = local(rel)
        return found if found is not None or remote is None else remote(rel)

    try:
        code = layout.folder_code_closure(folder)
        problem = teacher_preflight.pipeline_problem(folder, settings, header_of=header_of)
    except (layout.LayoutError, ValueError, OSError) as exc:
        problem, code = str(exc), []
    if problem:
        return False, f"materials.teacher = {source!r}: {problem}"
    trusted = "its code imported and built on the meta device" if settings.materials.trust_remote_code else \
        "its code not run (materials.trust_remote_code is off)"
    return True, (f"checked before its weights: {len(code)} code file(s), the config's keys, the tokenizer, the "
                  f"parts' weight headers; {trusted}" + (f"; {sum(served) / 1024:.1f} KiB of headers read"
                                                        if served else ""))


def _gguf_student_config(paths: ProjectPaths, value: str, gguf: Path) -> ModelConfig:
    """A GGUF student sized from its own header: the config its tensors' shapes give (as the materials step reads
    it, lib/materials/student/from_gguf.py), kept in the project's .cache by the file's size and mtime."""
    stat = gguf.stat()
    folder = paths.cache_dir / "gguf-student" / f"{stat.st_size}-{stat.st_mtime_ns}"
    if not (folder / "config.json").is_file():
        try:
            config = gguf_student.read_student_gguf(gguf).config
            atomic.write_json(folder / "config.json", config)
        except UserError as exc:
            return ModelConfig(None, f"materials.student = {value!r}: {str(exc).splitlines()[0]}")
        except OSError as exc:
            return ModelConfig(None, f"{value}: cannot keep its config in {paths.cache_dir} ({exc}); make the "
                                     "project folder writable")
    return ModelConfig(folder, f" (from the header of {gguf.name}, built on the meta device)")


def _rows_shape(paths: ProjectPaths, settings: Settings, teacher: Path, *, token: str | None,
                options: hub.HubOptions | None, ask_hub: bool) -> tuple[int, int, str]:
    """(Q, D, where Q came from) of the teacher's targets, from the query rows' header wherever they are: the
    fetched material, the file or hub repo materials.query_rows names, the teacher folder's query_rows_file;
    else the usual Q, said so with what to add."""
    m = settings.materials
    if layout.is_pipeline_folder(teacher):  # the rows are the QueryFormer's, the width the projection's
        return (*layout.conditioning_shape(teacher), "")
    hidden = qr.teacher_hidden_size(teacher)
    if m.query_rows:
        entry = None
        try:
            entry = load_manifest(paths).query_rows
        except (OSError, ValueError, TypeError, UserError):
            pass
        if entry and entry.get("key") == qr.setting_key(m.query_rows):
            return entry["shape"][0], hidden, ""
        local = paths.resolve_local(m.query_rows["source"])
        if local.exists():
            file = local / m.query_rows["file"] if local.is_dir() else local
            return hub_shapes.local_rows_shape(file, m.query_rows["tensor"], hidden)[0], hidden, ""
        shape, _ = hub_shapes.hub_rows_shape(paths.cache_dir, m.query_rows["source"], m.query_rows["file"],
                                             m.query_rows["tensor"], hidden, token=token, options=options,
                                             ask_hub=ask_hub)
        return shape[0], hidden, f", rows from the header of {m.query_rows['source']}:{m.query_rows['file']}"
    file = teacher / m.query_rows_file
    if file.is_file():
        return hub_shapes.local_rows_shape(file, m.query_rows_tensor, hidden)[0], hidden, ""
    return (USUAL_QUERY_ROWS, hidden, f"; Q = {USUAL_QUERY_ROWS} assumed (the usual): add {m.query_rows_file} to the "
            "teacher folder or set materials.query_rows to count the real rows")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n:,}"


_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def teacher_blocks(folder: Path, settings: Settings) -> int | None:
    """The blocks a middle-layer teacher keeps (the precompute builds and loads no others), None: all."""
    layer = settings.materials.teacher_layer
    if layer == -1 or layout.is_pipeline_folder(folder) or not (folder / "config.json").is_file():
        return None
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return blocks_for_layer(config.get("num_hidden_layers") or (config.get("text_config") or {}).get(
        "num_hidden_layers"), layer)


def weight_params(folder: Path, *, skip: str = "", blocks: int | None = None) -> int:
    """Parameters in a model folder's *.safetensors (headers only), the ``skip`` file left out; ``blocks``: only
    the first that many blocks' (a middle-layer teacher's), None: all."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        if file.name == skip:
            continue
        header, _, _ = safetensors_header(file)
        for name, entry in header.items():
            block = _BLOCK.search(name)
            if name != "__metadata__" and (blocks is None or block is None or int(block.group(1)) < blocks):
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total


def config_params(folder: Path, settings: Settings, *, blocks: int | None = None) -> int:
    """Parameters of the model a folder's config.json describes, built on the meta device (no weights, no
    download): the same module tree the precompute's placement planner sizes (lib/precompute/teacher.py)."""
    import torch

    from gguf_assets.lib.precompute.teacher import empty_model

    return sum(p.numel() for p in empty_model(folder, settings, torch.bfloat16, blocks=blocks).parameters())


def pipeline_params(folder: Path, settings: Settings) -> tuple[int, str]:
    """(parameters, from where) of an LLaDA-Image pipeline's text stack: the text encoder, QueryFormer and text
    projection, from their safetensors headers; without weights, the parts from their configs and the text encoder
    from its config on the meta device (by the repo's code: only with materials.trust_remote_code), else from its
    weights index."""
    parts = sum(weight_params(folder / p) for p in (layout.QUERYFORMER_DIR, layout.PROJECTION_DIR)) \
        or layout.parts_params(folder)
    backbone, how = weight_params(folder / layout.TEXT_ENCODER_DIR), ""
    if not backbone and settings.materials.trust_remote_code:
        import torch

        from gguf_assets.lib.precompute.llada_teacher import empty_backbone

        backbone = sum(p.numel() for p in empty_backbone(folder, settings, torch.bfloat16).parameters())
        how = "; the text encoder from its config.json on the meta device, by the repo's code"
    elif not backbone:
        size = layout.index_bytes(folder)
        if size is None:
            raise UserError(f"{folder / layout.TEXT_ENCODER_DIR}: its size needs its weights, its safetensors index, "
                            "or materials.trust_remote_code (its config is built by the repo's code)")
        backbone, how = size // BYTES["bf16"], "; the text encoder from its weights index (bf16)"
    return backbone + parts, f" (text encoder, QueryFormer and text projection{how})"


def model_params(folder: Path, settings: Settings, *, skip: str = "", blocks: int | None = None) -> tuple[int, str]:
    """(parameters, from where): the safetensors headers when the weights are there, else config.json alone;
    ``blocks``: only the first that many blocks (a middle-layer teacher's)."""
    if layout.is_pipeline_folder(folder):
        return pipeline_params(folder, settings)
    kept = "" if blocks is None else f" (its first {blocks} layers: materials.teacher_layer reads no others)"
    n = weight_params(folder, skip=skip, blocks=blocks)
    if n:
        return n, kept
    return (config_params(folder, settings, blocks=blocks),
            f" (from config.json on the meta device: no weights here yet){kept}")


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
    parts_gib = 0.0
    if layout.is_pipeline_folder(folder):  # the backbone is placed; its small parts stay on the chosen GPU
        from gguf_assets.lib.precompute.llada_teacher import empty_backbone

        if not settings.materials.trust_remote_code:
            raise UserError("the text encoder's layers are known from the repo's own code: set "
                            "materials.trust_remote_code: true to plan where they go")
        model = empty_backbone(folder, settings, torch.bfloat16)
        parts_gib = layout.parts_params(folder) * BYTES["bf16"] / GIB
    else:
        model = empty_model(folder, settings, torch.bfloat16, blocks=teacher_blocks(folder, settings))
    natural = {k: max_memory[k] for k in sorted(k for k in max_memory if isinstance(k, int))} | {
        "cpu": max_memory["cpu"]}  # balanced splits over the GPUs in their own order, as transformers does
    with _quiet_about_absent_gpus():
        plans = {"sequential": device_map_summary(model, sequential_device_map(model, max_memory)),
                 "balanced": device_map_summary(model, _get_device_map(model, "balanced", natural, None))}
    for summary in plans.values():
        if parts_gib:
            chosen = summary.setdefault(str(device), {"layers": 0, "gib": 0.0})
            chosen["gib"] = round(chosen["gib"] + parts_gib, 4)
    return plans


@contextlib.contextmanager
def _quiet_about_absent_gpus():
    """GPUs named with --gpus need not be in this machine: accelerate's planner warns "Device 0 is not available"
    for each, on every plan, which is noise here (the plan is for the machine the user names)."""
    planner_log = logging.getLogger("accelerate.utils.modeling")
    level = planner_log.level
    planner_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        planner_log.setLevel(level)


def adapter_params(student_dim: int, query_rows: int, target_dim: int, width: int, depth: int) -> int:
    """The adapter's parameter count (lib/training/adapter.py's layout: docs/gguf_layout.md's tensor table), with
    its statistics buffers (target_centre and loss_std [Q, D], target_std [D]): the checkpoint's state dict."""
    mlp = 4 * width
    block = 4 * 2 * width + 8 * (width * width + width) + (width * mlp + mlp) + (mlp * width + width)
    return (query_rows * width + student_dim * width + width + depth * block
            + 2 * width + width * target_dim + target_dim + 2 * query_rows * target_dim + target_dim)


def _weights_line(role: str, config: ModelConfig, settings: Settings, dtype: str, how: str,
                  after: str = "") -> MemoryLine:
    """The weights of a model in ``dtype``; not known (one line why) when its config is missing or unbuildable."""
    if config.folder is None:
        return MemoryLine(role, None, config.why)
    try:
        teacher = role == "teacher"
        n, source = model_params(config.folder, settings, skip=settings.materials.query_rows_file if teacher else "",
                                 blocks=teacher_blocks(config.folder, settings) if teacher else None)
    except (ValueError, KeyError, OSError, ImportError) as exc:  # an unknown model_type, a config missing a key
        return MemoryLine(role, None, f"{config.folder / 'config.json'} cannot be built on the meta device "
                                      f"({str(exc).splitlines()[0][:200]}); check materials.{role}")
    where = config.why + source if layout.is_pipeline_folder(config.folder) else config.why or source
    return MemoryLine(role, n * BYTES[dtype] / GIB, f"{_count(n)} parameters in {dtype} {how}{where}{after}")


def estimate(paths: ProjectPaths, settings: Settings, *, token: str | None = None,
             options: hub.HubOptions | None = None, ask_hub: bool = True) -> list[MemoryLine]:
    """Teacher, student and adapter training, each in GiB, or None with one line saying what is missing. Hub ids
    not downloaded yet are read from the hub (``token``: the HF token the materials step sends; ``options``: its
    bounds, hub_shapes.quick_options() where the answer must come quickly; ``ask_hub`` False: only what the
    project's .cache holds)."""
    p, t = settings.precompute, settings.training
    lines = []
    student = model_config(paths, settings, "student", token=token, options=options, ask_hub=ask_hub)
    teacher = ModelConfig(None)
    if p.mock_teacher:
        lines.append(MemoryLine("teacher", 0.0, "precompute.mock_teacher: no teacher is loaded"))
    else:
        teacher = model_config(paths, settings, "teacher", token=token, options=options, ask_hub=ask_hub)
        lines.append(_weights_line("teacher", teacher, settings, "bf16", "(GPU)",
                                   "; on a CPU it computes in f32, twice that, in RAM"))
    lines.append(_weights_line("student", student, settings, p.student_dtype, "(precompute.student_dtype)"))
    shape, missing = None, "known once the teacher's and the student's config.json are there"
    if student.folder is not None and (p.mock_teacher or teacher.folder is not None):
        try:
            student_dim = qr.teacher_hidden_size(student.folder)
            if p.mock_teacher:
                shape = MOCK_QUERY_ROWS, MOCK_DIM, ""
            else:
                shape = _rows_shape(paths, settings, teacher.folder, token=token, options=options, ask_hub=ask_hub)
        except (UserError, OSError, ValueError) as exc:  # a wrong tensor name lists candidates: the first line here
            missing = f"the query rows' shape: {str(exc).splitlines()[0]}"
    if shape is not None:
        query_rows, target_dim, rows_note = shape
        n = adapter_params(student_dim, query_rows, target_dim, t.width, t.depth)
        per_param = ADAM_BYTES_PER_PARAM + (4 if t.ema_decay else 0)
        lines.append(MemoryLine("adapter training", n * per_param / GIB,
                                f"{_count(n)} parameters ({t.width} x {t.depth}, {query_rows} x {target_dim} "
                                f"out) x {per_param} bytes (weights, gradients, AdamW"
                                + (", weight average" if t.ema_decay else "") + f"), plus activations{rows_note}",
                                params=n))
    else:
        lines.append(MemoryLine("adapter training", None, missing))
    return lines


def kept_steps_text(settings: Settings, lines: list[MemoryLine]) -> str:
    """What the training.keep_steps_* schedule keeps on disk by the run's end, in one line: how many kept steps
    (the newest training.keep_steps_last of them when set) and their size, each an f32 copy of the adapter's
    weights (4 bytes a parameter, ``lines``' adapter count; "?" while that is not known). The studio's Memory panel
    and `gguf-trainer estimate` print it."""
    t = settings.training
    if not t.keep_steps_every:
        return "kept steps on a schedule: off (training.keep_steps_every 0)"
    steps = scheduled_steps(every=t.keep_steps_every, first=t.keep_steps_from, last=t.keep_steps_to,
                            planned=t.steps, newest=t.keep_steps_last)
    params = next((line.params for line in lines if line.params is not None), None)
    size = "size ?" if params is None else bytes_text(len(steps) * 4 * params)
    schedule = (f"training.keep_steps_every {t.keep_steps_every}" + (f" from {t.keep_steps_from}" if t.keep_steps_from
                                                                      else "")
                + (f" to {t.keep_steps_to}" if t.keep_steps_to else "")
                + (f", the newest {t.keep_steps_last} kept" if t.keep_steps_last else ""))
    which = f": steps {', '.join(map(str, steps))}" if 0 < len(steps) <= 6 else (
        f": steps {steps[0]} to {steps[-1]}" if steps else f": none within {t.steps} steps")
    return f"kept steps on a schedule: {len(steps)} file{'' if len(steps) == 1 else 's'}, {size} ({schedule}{which})"


def missing_piece(lines: list[MemoryLine]) -> str | None:
    """The first thing the estimate lacks, in one line (None when every part is known)."""
    return next((line.how for line in lines if line.gib is None), None)


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


# The seed's measurement (DESIGN.md §1, its reference run: a Qwen3-30B-A3B-class MoE teacher on an RTX 5090 with an
# RTX 4050): 4.5 prompts/s with the whole teacher on the GPUs (sequential), 2.4 prompts/s with about half of it
# offloaded to the CPU (balanced). The only two points measured; every other figure is interpolated between them.
SEED_PROMPTS_PER_S_ON_GPUS = 4.5
SEED_PROMPTS_PER_S_HALF_OFFLOADED = 2.4


def prompts_per_s(offloaded: float) -> float:
    """The seed's speed with a share ``offloaded`` of the teacher in CPU RAM: seconds per prompt interpolated
    linearly between its two measurements (0 and half offloaded), and extrapolated past half the same way (each
    offloaded layer costs the CPU the same time)."""
    on_gpus, half = 1 / SEED_PROMPTS_PER_S_ON_GPUS, 1 / SEED_PROMPTS_PER_S_HALF_OFFLOADED
    return 1 / (on_gpus + (half - on_gpus) * offloaded / 0.5)


def placement_outcome(summary: dict[str, dict[str, float]]) -> str:
    """What a placement comes to (all on one GPU, split over GPUs, or part in CPU RAM) and the speed it costs,
    scaled from the seed's measurement."""
    total = sum(v["gib"] for v in summary.values()) or 1.0
    off = sum(v["gib"] for d, v in summary.items() if not d.startswith("cuda")) / total
    gpus = [d for d in summary if d.startswith("cuda")]
    if "disk" in summary:  # the precompute refuses this (plan_placement): GPUs and RAM are too small
        return (f"does not fit: {summary['disk']['gib']:.2f} GiB would go to disk; raise "
                "precompute.teacher_cpu_memory_gib or use bigger GPUs")
    if off > 0:
        where = f"teacher partly offloaded: {off:.0%} of it in CPU RAM"
    elif len(gpus) > 1:
        where = f"teacher split over {len(gpus)} GPUs, nothing offloaded"
    else:
        where = "all on one GPU"
    return f"{where}; about {prompts_per_s(off):.1f} prompts/s"


SPEED_NOTE = (f"speed: the seed's measurement ({SEED_PROMPTS_PER_S_ON_GPUS} prompts/s with a Qwen3-30B-A3B-class "
              f"teacher all on GPUs, {SEED_PROMPTS_PER_S_HALF_OFFLOADED} with half of it offloaded; an RTX 5090 + "
              "RTX 4050), interpolated in seconds per prompt by the share offloaded; other GPUs and teachers differ")


def placement_lines(paths: ProjectPaths, settings: Settings, gpus: list[dict], *, token: str | None = None,
                    options: hub.HubOptions | None = None, available_cpu_bytes: int | None = None) -> list[str]:
    """Where the teacher would go on these GPUs (gpu_snapshot's: index, mem_total_gib, mem_used_gib), per device,
    under sequential and balanced placement, with what each costs in speed; none when there is no GPU, the
    precompute runs on the CPU, or the teacher is the mock one or not known yet."""
    import psutil

    if not gpus or settings.precompute.mock_teacher:
        return []
    if settings.precompute.device == "cpu":
        return ["teacher placement: precompute.device = 'cpu' keeps the teacher in RAM; set it to auto or cuda to "
                "place it on GPUs"]
    folder = model_config(paths, settings, "teacher", token=token, options=options).folder
    if folder is None:
        return []
    free = {int(g["index"]): int((g["mem_total_gib"] - g["mem_used_gib"]) * GIB) for g in gpus}
    cpu = psutil.virtual_memory().available if available_cpu_bytes is None else available_cpu_bytes
    try:
        placements = teacher_placements(folder, settings, free_gpu_bytes=free, available_cpu_bytes=cpu)
    except (UserError, ValueError, OSError, KeyError, ImportError) as exc:  # e.g. precompute.device: no such GPU
        return [f"teacher placement: {str(exc).splitlines()[0]}"]
    chosen = settings.precompute.teacher_placement
    return [f"teacher placement {strategy}{' (precompute.teacher_placement)' if strategy == chosen else ''}: "
            f"{placement_text(summary)} -> {placement_outcome(summary)}" for strategy, summary in placements.items()
            ] + [SPEED_NOTE]


def placement_text(summary: dict[str, dict[str, float]]) -> str:
    """A placement per device in one line: "cuda:0 24 layers 28.44 GiB, cuda:1 24 layers 27.86 GiB"."""
    return ", ".join(f"{device} {v['layers']} layers {v['gib']:.2f} GiB" for device, v in summary.items())


def named_gpus(sizes_gib: list[float]) -> list[dict]:
    """GPUs the user names by size (``--gpus 24,24``), empty, in gpu_snapshot's form."""
    return [{"index": i, "mem_total_gib": float(size), "mem_used_gib": 0.0} for i, size in enumerate(sizes_gib)]


def parse_gpu_sizes(text: str) -> list[float]:
    """``--gpus 24,24`` -> [24.0, 24.0]: GiB per GPU; a UserError naming the option otherwise."""
    try:
        sizes = [float(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or not all(0 < size < 1e6 for size in sizes):
        raise UserError(f"--gpus {text!r}: give each GPU's memory in GiB, separated by commas (for example "
                        "--gpus 24,24 for two 24 GiB cards, --gpus 80 for one).")
    return sizes


def estimate_lines(paths: ProjectPaths, settings: Settings, *, gpus: list[dict] | None = None,
                   gpu_sizes_gib: list[float] | None = None, token: str | None = None,
                   options: hub.HubOptions | None = None, available_cpu_bytes: int | None = None,
                   lines: list[MemoryLine] | None = None) -> list[str]:
    """The estimate as console lines, against the GPUs named (``gpu_sizes_gib``: --gpus), else the ones given
    (``gpus``: gpu_snapshot's), else this machine's; with where the teacher would go on them (the studio shows
    the same). ``lines``: estimate()'s, when the caller has them already."""
    from gguf_assets.lib.telemetry.hardware import gpu_snapshot

    lines = estimate(paths, settings, token=token, options=options) if lines is None else lines
    out = [f"  {line.part:<17} {size_text(line.gib):>10}  {line.how}" for line in lines]
    peak = peak_gib(lines)
    if gpu_sizes_gib:
        gpus = named_gpus(gpu_sizes_gib)
        where = "--gpus " + ", ".join(f"GPU {g['index']} {g['mem_total_gib']:g} GiB" for g in gpus)
    else:
        gpus = gpu_snapshot() if gpus is None else gpus
        where = "this machine: " + (", ".join(f"GPU {g['index']} {g['mem_total_gib']:.0f} GiB" for g in gpus)
                                    or "no NVIDIA GPU here (--gpus 24,24 plans for GPUs you name)")
    out.append(f"  peak on one GPU   {size_text(peak):>10}  teacher + student while the "
               f"shards are computed, or the adapter's training; {where}")
    return out + [f"  {line}" for line in placement_lines(paths, settings, gpus, token=token, options=options,
                                                          available_cpu_bytes=available_cpu_bytes)]
