"""Export the trained adapter to its f16 GGUF (plus an atomic, verified copy where asked)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from gguf_assets.lib import atomic
from gguf_assets.lib.adapter import MLP_RATIO, NORM_EPS
from gguf_assets.lib.gguf_format import write_adapter_gguf
from gguf_assets.lib.layout import ProjectPaths
from gguf_assets.lib.pipeline import gguf_fingerprint, gguf_path
from gguf_assets.lib.settings import Settings
from gguf_assets.lib.train import load_final

log = logging.getLogger(__name__)


def _provenance(settings: Settings, materials: dict, meta: dict) -> dict:
    student, teacher = materials["student"], materials.get("teacher")
    p = {
        "student.repo": student["source"], "student.commit": student["commit"],
        "student.layer": settings.materials.student_layer, "student.hidden_size": meta["shape"]["student_dim"],
        "teacher.repo": teacher["source"] if teacher and not settings.precompute.mock_teacher else "mock-teacher",
        "teacher.commit": teacher["commit"] if teacher and not settings.precompute.mock_teacher else "none",
        "teacher.layer": settings.materials.teacher_layer,
        "prompt_template": settings.precompute.prompt_template,
        "training.steps": meta["step"], "training.seed": settings.training.seed,
        "training.val_centred_cosine": float(meta["val_centred_cosine"]),
        "training.fingerprint": meta["fingerprint"],
    }
    return p


def copy_verified(source: Path, folder: Path, *, sha256: str) -> Path:
    """Atomic copy into ``folder``; the copy's sha256 must match before it takes the final name."""
    target = Path(folder).expanduser() / source.name
    with atomic.atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)
        if atomic.sha256_file(tmp) != sha256:
            raise OSError(f"copy of {source} to {target} does not match its sha256; nothing was replaced")
    return target


def export_adapter(paths: ProjectPaths, settings: Settings, materials: dict, adapter_manifest: dict) -> dict:
    """Write <output_dir>/<adapter_name>.gguf and its sidecar; returns the summary (also the sidecar)."""
    run_dir = paths.root / adapter_manifest["run_dir"]
    model, meta = load_final(run_dir)
    tensors = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    shape = meta["shape"]
    hparams = {**shape, "layer_norm_epsilon": NORM_EPS, "mlp_ratio": MLP_RATIO}
    target = gguf_path(paths, settings)
    summary = write_adapter_gguf(target, tensors=tensors, hparams=hparams,
                                 provenance=_provenance(settings, materials, meta), name=settings.output.adapter_name)
    if summary.get("kept_f32"):
        log.warning("kept in f32 because values exceed the f16 range: %s", summary["kept_f32"])
    copies = []
    if settings.output.also_copy_to:
        copies.append(str(copy_verified(target, paths.resolve_local(settings.output.also_copy_to), sha256=summary["sha256"])))
    sidecar = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in summary.items()},
               "fingerprint": gguf_fingerprint(settings, materials, adapter_manifest["fingerprint"]),
               "adapter_fingerprint": adapter_manifest["fingerprint"], "copies": copies,
               "val_centred_cosine_torch": float(meta["val_centred_cosine"]),
               "empty_prompt_cosine_torch": meta.get("empty_prompt_cosine")}
    atomic.write_json(target.with_suffix(".json"), sidecar)
    return sidecar
