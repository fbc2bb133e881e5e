"""Export the trained adapter to its f16 GGUF, the vision encoder to its own GGUF when asked,
and an atomic, verified copy of each into ``output.also_copy_to``.

The sidecar ``<adapter_name>.json`` beside the adapter GGUF records what was exported
(``files``: role, path, bytes, sha256 for every file and copy), the fingerprint that
makes the stage current, and the torch checkpoint's own scores for the report.
"""

from __future__ import annotations

import logging
import math
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.f16 import F16_MAX
from gguf_assets.lib.core.ggk_contract import TOKENIZER_PACK_MERGES
from gguf_assets.lib.core.metrics import EMPTY_PROMPT_COSINE, VAL_CENTRED_COSINE
from gguf_assets.lib.materials.ggk_tokenizer import write_tokenizer_pack
from gguf_assets.lib.output.export_run import export_sidecar, gguf_fingerprint, gguf_path
from gguf_assets.lib.output.gguf_format import TRAINING_ONLY, hparams_of, is_f16_tensor, tensor_name, write_adapter_gguf
from gguf_assets.lib.output.kept import copy_verified, keep_export
from gguf_assets.lib.output.snapshot_names import remove_dead_snapshot_temps
from gguf_assets.lib.output.student_gguf import student_gguf_path, write_student_gguf
from gguf_assets.lib.output.vision import vision_gguf_path, write_vision_gguf
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.manifests import ExportSidecar, MaterialsManifest
from gguf_assets.lib.project.settings import Settings, adapter_name_problem
from gguf_assets.lib.project.teacher_choice import teacher_choice
from gguf_assets.lib.telemetry.hardware import resolve_device
from gguf_assets.lib.training.adapter import MLP_RATIO, Adapter
from gguf_assets.lib.training.checkpoints import load_final
from gguf_assets.lib.training.input_peaks import measure_peaks, recorded_peaks
from gguf_assets.lib.training.training_run import final_run_dir

log = logging.getLogger(__name__)

TRAINER = f"gguf_assets {package_version('gguf_assets')}"
ROLE_ADAPTER = "adapter"
ROLE_STUDENT = "student"
ROLE_TOKENIZER_PACK = "tokenizer_pack"
ROLE_VISION = "vision_encoder"


class ExportError(UserError, ValueError):
    """The export cannot proceed; the message names the setting or file and the fix."""


def tokenizer_pack_dir(output_dir: Path, adapter_name: str) -> Path:
    """The folder ggk's --tokenizer-pack takes: it holds qwen2/merges.txt."""
    return output_dir / f"{adapter_name}-tokenizer"


def check_file_name(name: str, *, setting: str = "output.adapter_name") -> str:
    """``name`` if it is a plain file name (settings.adapter_name_problem: the same rule settings apply)."""
    problem = adapter_name_problem(name)
    if problem:
        raise ExportError(f"{setting} = {problem}")
    return name


def provenance(settings: Settings, materials: MaterialsManifest, meta: dict, *,
               checkpoint: str = "final") -> dict[str, Any]:
    """The adapter GGUF's provenance keys (gguf_format.REQUIRED_PROVENANCE and the rest). The planned steps are
    the count in force when the weights were made (a snapshot's, a run ended early's), else the settings'."""
    student = materials.student
    teacher_repo, teacher_commit = teacher_choice(settings).provenance(materials)
    rows = materials.query_rows  # the query rows as a material of their own (materials.query_rows), when set
    rows_keys = {} if not rows else {
        "query_rows.source": rows["source"], "query_rows.file": rows["file"], "query_rows.tensor": rows["tensor"],
        "query_rows.commit": rows["commit"], "query_rows.sha256": rows["tensor_sha256"]}
    return {
        "conditioning": settings.precompute.conditioning,
        "student.repo": student["source"], "student.commit": student["commit"],
        "student.hidden_size": meta["shape"]["student_dim"],
        "student.gguf": student_gguf_path(Path("."), settings.output.adapter_name).name,
        "teacher.repo": teacher_repo, "teacher.commit": teacher_commit,
        "teacher.layer": settings.materials.teacher_layer,
        "training.steps": meta["step"], "training.planned_steps": meta.get("planned_steps", settings.training.steps),
        "training.checkpoint": checkpoint, "training.seed": settings.training.seed,
        "training.val_centred_cosine": float(meta[VAL_CENTRED_COSINE]),
        "training.fingerprint": meta["fingerprint"],
        "trainer": TRAINER,
        **rows_keys,
    }


def _file_entry(role: str, path: Path | str, sha256: str, *, copy_of: str | None = None) -> dict[str, Any]:
    # The stamp (size, mtime, inode) lets `status` see a changed file without reading it.
    entry = {"role": role, "path": str(path), **verify.record(Path(path), sha256=sha256)}
    if copy_of:
        entry["copy_of"] = copy_of
    return entry


def ggk_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors as ggk reads them: the state dict without the training statistics, with the
    standardization folded into out_proj (ggk has no tensor for it), so the file computes targets directly."""
    tensors = {k: v for k, v in model.state_dict().items() if k not in TRAINING_ONLY}
    tensors["out_proj.weight"], tensors["out_proj.bias"] = model.folded_out_proj()
    return tensors


def _cast_once(state_dict: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The adapter's tensors as the GGUF stores them, cast in torch (about 10x faster than numpy's f16 cast).

    Tensors that gguf_format stores in f16 come as float16 when every value fits; anything else
    comes as float32 and gguf_format decides (a value beyond the f16 range keeps the tensor f32,
    with a warning; a NaN or inf is refused).
    """
    out = {}
    for key, value in state_dict.items():
        value = value.detach().float().contiguous()
        fits = False
        if is_f16_tensor(key) and value.numel():
            low, high = (float(x) for x in torch.aminmax(value))  # one pass; a NaN or inf shows in either
            fits = math.isfinite(low) and math.isfinite(high) and max(-low, high) <= F16_MAX
        out[key] = value.half().numpy() if fits else value.numpy()
    return out


# A runtime's matrix product rounds its inputs to f16 when the weight is f16 (ggml's CPU path does), so a
# matrix whose inputs reach past F16_MAX / ACTIVATION_HEADROOM on the val prompts is stored f32: the
# headroom covers prompts larger than any val prompt (docs/gguf_layout.md, "F16 rule").
ACTIVATION_HEADROOM = 4.0


def activation_rule(peaks: dict[str, float]) -> list[str]:
    """The matrices (torch names) whose inputs would overflow f16 in a runtime's product: stored f32."""
    return sorted(name for name, peak in peaks.items() if not peak <= F16_MAX / ACTIVATION_HEADROOM)


def peaks_device(settings: Settings) -> torch.device:
    """Where the export runs the adapter over the val prompts when no validation recorded its input peaks: the
    training device, or the CPU where that one is not here (a project trained elsewhere)."""
    try:
        return resolve_device(settings.training.device)
    except RuntimeError:
        return torch.device("cpu")


def activation_peaks(model: Adapter, meta: dict, val_folders: list[Path], *, device: torch.device) -> dict[str, float]:
    """Each linear's largest input over the val prompts: as the validation of these weights recorded it in their
    ``meta``, else measured now on ``device`` (lib/training/input_peaks.py)."""
    recorded = recorded_peaks(meta, val_folders)
    if recorded is not None:
        return recorded
    if val_folders:
        log.info("running the adapter over the val prompts on %s for the f16 check (its weights' validation "
                 "recorded no input peaks for these val shards)", device)
    return measure_peaks(model, val_folders, device=device)


def _previous_files(paths: ProjectPaths, settings: Settings) -> dict[str, dict]:
    """The files this project's last export wrote, by path (none if it never exported)."""
    try:
        return {f["path"]: f for f in export_sidecar(paths, settings).files}
    except (OSError, ValueError):
        return {}


def _warn_if_not_ours(target: Path, previous_files: dict[str, dict], adapter_name: str) -> None:
    """Say so when a copy replaces a file this project did not write there (a folder shared by projects)."""
    if not target.is_file():
        return
    ours = previous_files.get(str(target))
    if ours is None or not verify.unchanged(target, ours):
        log.warning("output.also_copy_to: replacing %s, which this project's last export did not write (another "
                    "project with output.adapter_name %r copies there too?). Give each project its own "
                    "adapter_name or also_copy_to, or they overwrite each other.", target, adapter_name)


def write_adapter_file(target: Path, model: Adapter, meta: dict, *, provenance: dict[str, Any], name: str,
                       val_folders: list[Path], device: torch.device = torch.device("cpu")):
    """The adapter ``model`` (of a run whose ``meta`` gives its shape) as ggk's GGUF at ``target``: deterministic
    for the same weights, provenance and val shards (a snapshot and a kept step's export are byte-identical).
    ``device``: where the f16 check runs the adapter when ``meta`` records no input peaks (``activation_peaks``)."""
    tensors = _cast_once(ggk_tensors(model))
    keep_f32 = activation_rule(activation_peaks(model, meta, list(val_folders), device=device))
    if keep_f32:
        log.warning("kept in f32 because their inputs exceed %.0f on the val prompts (a runtime rounds a f16 "
                    "product's inputs to f16): %s", F16_MAX / ACTIVATION_HEADROOM, keep_f32)
    shape = meta["shape"]
    hparams = hparams_of(student_dim=shape["student_dim"], query_rows=shape["query_rows"],
                         target_dim=shape["target_dim"], width=shape["width"], depth=shape["depth"],
                         mlp_ratio=MLP_RATIO)
    summary = write_adapter_gguf(target, tensors=tensors, hparams=hparams, provenance=provenance, name=name,
                                 keep_f32=keep_f32)
    by_values = [n for n in summary.kept_f32 if n not in {tensor_name(k) for k in keep_f32}]
    if by_values:
        log.warning("kept in f32 because values exceed the f16 range: %s", by_values)
    return summary


def export_adapter(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest,
                   adapter_manifest: dict, *, val_folders: list[Path] = ()) -> ExportSidecar:
    """Write <output_dir>/<adapter_name>.gguf (+ vision GGUF, + copies) and the sidecar; return the sidecar.

    ``val_folders``: the val shards, whose student states the activation rule is checked on."""
    name = check_file_name(settings.output.adapter_name)
    run_dir = final_run_dir(paths, adapter_manifest)  # confined to checkpoints/: a received project's record
    model, meta = load_final(run_dir)
    target = gguf_path(paths, settings)
    previous_files = _previous_files(paths, settings)
    # A killed export leaves its temp files; only ours go, as the folder may be shared.
    student_target = student_gguf_path(target.parent, name)
    pack_merges = tokenizer_pack_dir(target.parent, name) / TOKENIZER_PACK_MERGES
    ours = [target.name, vision_gguf_path(target.parent, name).name, target.with_suffix(".json").name,
            student_target.name]
    atomic.remove_stale_temps(target.parent, of=ours)
    atomic.remove_stale_temps(pack_merges.parent, of=[pack_merges.name])  # the pack's own folder
    remove_dead_snapshot_temps(target.parent, name)  # a snapshot killed while it wrote, at any step
    summary = write_adapter_file(target, model, meta, provenance=provenance(settings, materials, meta), name=name,
                                 val_folders=val_folders, device=peaks_device(settings))
    files = [_file_entry(ROLE_ADAPTER, target, summary.sha256)]
    # The exact student the adapter was trained against, as ggk runs it (--llm), and its tokenizer as ggk reads it
    # (--tokenizer-pack): the user always holds the pair.
    student = materials.student
    student_file = write_student_gguf(Path(student["path"]), student_target, name=f"{name}-student",
                                      source=student["source"], commit=student["commit"])
    files.append(_file_entry(ROLE_STUDENT, student_file["path"], student_file["sha256"]))
    write_tokenizer_pack(Path(student["path"]), pack_merges.parent.parent)
    files.append(_file_entry(ROLE_TOKENIZER_PACK, pack_merges, atomic.sha256_file(pack_merges)))

    vision = None
    encoder = materials.vision_encoder
    if encoder and settings.output.export_vision_encoder:
        vision = write_vision_gguf(Path(encoder["path"]), vision_gguf_path(target.parent, name),
                                   name=f"{name}-vision", source=encoder["source"], commit=encoder["commit"])
        files.append(_file_entry(ROLE_VISION, vision["path"], vision["sha256"]))
    elif encoder:
        log.info("vision encoder not exported: output.export_vision_encoder is off")

    copies = []
    if settings.output.also_copy_to:
        folder = paths.resolve_local(settings.output.also_copy_to)
        atomic.remove_stale_temps(folder, of=ours)
        for entry in list(files):
            # Each file keeps its place under the output folder (the tokenizer pack's qwen2/merges.txt).
            into = folder / Path(entry["path"]).parent.relative_to(target.parent)
            into.mkdir(parents=True, exist_ok=True)
            atomic.remove_stale_temps(into, of=[Path(entry["path"]).name])  # a subfolder's too (the pack's)
            _warn_if_not_ours(into / Path(entry["path"]).name, previous_files, name)
            copy = copy_verified(Path(entry["path"]), into, sha256=entry["sha256"])
            copies.append(str(copy))
            files.append(_file_entry(entry["role"], copy, entry["sha256"], copy_of=entry["path"]))

    sidecar = ExportSidecar(
        path=summary.path, sha256=summary.sha256, bytes=summary.bytes, name=summary.name,
        architecture=summary.architecture, format_version=summary.format_version, tensor_count=summary.tensor_count,
        f16_count=summary.f16_count, f32_count=summary.f32_count, kept_f32=list(summary.kept_f32),
        fingerprint=gguf_fingerprint(settings, materials, adapter_manifest["fingerprint"]),
        adapter_fingerprint=adapter_manifest["fingerprint"], copies=copies, files=files, vision=vision,
        provenance=provenance(settings, materials, meta), val_centred_cosine_torch=float(meta[VAL_CENTRED_COSINE]),
        empty_prompt_cosine_torch=meta.get(EMPTY_PROMPT_COSINE), per_shard_torch=meta.get("per_shard", []),
        settings_hash=settings_history.remember(paths.root, settings))
    # The run keeps its own copy (`gguf-trainer runs --use` restores it), before the sidecar makes the stage done:
    # a kill while it is copied leaves the export to be made again, which also clears the copy's temp file.
    keep_export(paths, sidecar)
    atomic.write_json(target.with_suffix(".json"), paths.stored_doc(sidecar.to_json()))
    return sidecar
