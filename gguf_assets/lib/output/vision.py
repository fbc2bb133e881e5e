"""The paired vision encoder as the SigVQ GGUF that ggk loads with ``--llm_vision``.

LLaDA-Image's reference-image encoder, SigVQ (a ViT, a 1x1 conv into a VQ codebook, the prior
token embedding and its projector), is read by ggk 0.9.7's ``model/te/sigvq.hpp``: the file's
tensors keep the checkpoint's own names (ggk loads them under ``sigvq.``), every size comes from
the tensor shapes, and no metadata key is read. So the export takes a SigVQ checkpoint folder (a
diffusers pipeline's ``sigvq/`` folder: ``*.safetensors`` and an optional ``config.json``, which
is not read), keeps exactly the tensors ggk reads (``sigvq_tensor_shapes``; anything else, a
decoder for example, is skipped and listed in the summary), checks that they are all there with
shapes that agree, and writes them unrenamed. The metadata (architecture ``sigvq``, provenance,
the sizes ggk derives) is for people and tools; ggk ignores it. docs/vision_gguf.md is the
human-readable version of this module.

dtypes follow what ggk holds each tensor in (its loader converts any float type on load):
Linear weights take the file's type, so they are F16 (F32 if a value passes the f16 range,
listed in ``kept_f32``); the conv kernels and ``prior_token_embedding`` are held in f16 whatever
the file has, so they are F16 and a value beyond the f16 range is refused (ggk would make it
inf); the position table and the codebook are held in f32 (the codebook feeds a cosine argmax),
so they stay F32, as do all 1-D tensors (norms, biases). Writing goes through
``gguf_format.write_verified_gguf`` (temp file, re-read, compare, rename).

This replaces the llama.cpp ``clip``/mmproj export (``v.*`` tensor names) that this module wrote
before: ggk cannot load that form and nothing relied on it, so it is gone.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.f16 import F16_MAX
from gguf_assets.lib.core.safetensors_io import SafetensorsFile, to_float32
from gguf_assets.lib.output import gguf_format as fmt

logger = logging.getLogger(__name__)

ARCH = "sigvq"
VISION_SUFFIX = "-vision.gguf"
HEADS = 16  # fixed in ggk's SigVQ, as are LayerNorm eps 1e-6 and the erf GELU
KEY_SOURCE = f"{ARCH}.source"
KEY_COMMIT = f"{ARCH}.commit"
HPARAMS = ("hidden", "patch", "pos_grid", "codebook_size", "codebook_dim", "semantic_dim", "blocks", "heads")

PATCH = "visual.patch_embed.proj.weight"
POS = "visual.embeddings.position_embedding.weight"
QUANT_CONV = "vqmodel.quant_conv.weight"
CODEBOOK = "vqmodel.quantize.embedding.weight"
PRIOR = "prior_token_embedding.weight"
FC1 = "visual.blocks.0.mlp.fc1.weight"
ENGINE_F16 = frozenset({PATCH, QUANT_CONV, PRIOR})  # ggk holds these in f16 whatever the file's type
ENGINE_F32 = frozenset({POS, CODEBOOK})  # and these in f32
# Where ggk reads each size (sigvq.hpp, detect_from_weights): tensor, its dimensions, numpy axis.
SIZE_SOURCES = {"hidden": (PATCH, 4, 0), "patch": (PATCH, 4, 3), "pos_rows": (POS, 2, 0),
                "codebook_dim": (QUANT_CONV, 4, 0), "codebook_size": (PRIOR, 2, 0), "semantic_dim": (PRIOR, 2, 1),
                "intermediate": (FC1, 2, 0)}
_BLOCK_RE = re.compile(r"visual\.blocks\.(\d+)\.")
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_FIX = ("point materials.vision_encoder at LLaDA-Image's SigVQ checkpoint (the pipeline's sigvq/ folder), "
        "unconverted, with its tensors under their own names")


class VisionExportError(UserError, ValueError):
    """The vision encoder folder cannot be converted; the message names the file, the tensor and the fix."""


def vision_gguf_path(output_dir: Path, adapter_name: str) -> Path:
    """Where the vision GGUF goes: beside the adapter, named after it."""
    return Path(output_dir) / f"{adapter_name}{VISION_SUFFIX}"


def sigvq_tensor_shapes(*, hidden: int, intermediate: int, patch: int, pos_grid: int, codebook_size: int,
                        codebook_dim: int, semantic_dim: int, blocks: int) -> dict[str, tuple[int, ...]]:
    """Every tensor ggk's SigVQ reads → its numpy shape (ggml's ne reversed), in file order."""
    h, i, s = hidden, intermediate, semantic_dim
    shapes: dict[str, tuple[int, ...]] = {PATCH: (h, 3, patch, patch), "visual.patch_embed.proj.bias": (h,),
                                          POS: (pos_grid * pos_grid, h)}
    for n in range(blocks):
        b = f"visual.blocks.{n}."
        shapes.update({b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "norm2.weight": (h,),
                       b + "norm2.bias": (h,), b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
                       b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,), b + "mlp.fc1.weight": (i, h),
                       b + "mlp.fc1.bias": (i,), b + "mlp.fc2.weight": (h, i), b + "mlp.fc2.bias": (h,)})
    shapes.update({QUANT_CONV: (codebook_dim, h, 1, 1), "vqmodel.quant_conv.bias": (codebook_dim,),
                   CODEBOOK: (codebook_size, codebook_dim), PRIOR: (codebook_size, s),
                   "prior_projector.net.0.proj.weight": (s, s), "prior_projector.net.0.proj.bias": (s,),
                   "prior_projector.net.2.weight": (s, s), "prior_projector.net.2.bias": (s,)})
    return shapes


def _read_weights(folder: Path) -> dict[str, SafetensorsFile]:
    """Tensor name → its file, over every *.safetensors file of the folder."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise VisionExportError(f"materials.vision_encoder: no *.safetensors weights in {folder}; {_FIX}")
    where: dict[str, SafetensorsFile] = {}
    for file in files:
        st = SafetensorsFile(file)
        for key in st.keys():
            if key in where:
                raise VisionExportError(f"{file}: tensor {key!r} is also in {where[key].path}")
            where[key] = st
    return where


def _sizes(folder: Path, where: dict[str, SafetensorsFile]) -> dict[str, int]:
    """The sizes ggk derives, from the shapes it reads them from; every tensor checked against them."""
    indices = {int(m.group(1)) for key in where if (m := _BLOCK_RE.match(key))}
    blocks = max(indices, default=0) + 1  # ggk: the highest block index + 1
    needed = set(sigvq_tensor_shapes(hidden=1, intermediate=1, patch=1, pos_grid=1, codebook_size=1, codebook_dim=1,
                                     semantic_dim=1, blocks=blocks))
    missing = sorted(needed - set(where))
    if missing:
        files = ", ".join(sorted({st.path.name for st in where.values()}))
        raise VisionExportError(f"{folder} ({files}): missing tensor{'s' if len(missing) > 1 else ''} "
                                f"{', '.join(missing[:6])}{' …' if len(missing) > 6 else ''} "
                                f"({len(missing)} of the {len(needed)} that ggk's SigVQ encoder with {blocks} "
                                f"block{'s' if blocks > 1 else ''} needs); {_FIX}")
    sizes = {}
    for size, (name, ndim, axis) in SIZE_SOURCES.items():
        shape = where[name].shape(name)
        if len(shape) != ndim:
            raise VisionExportError(f"{where[name].path}: tensor {name!r} has shape {list(shape)}; ggk reads "
                                    f"{size} from it as a {ndim}-D tensor; {_FIX}")
        sizes[size] = shape[axis]
    rows = sizes.pop("pos_rows")
    grid = round(math.sqrt(rows))
    if grid * grid != rows:
        raise VisionExportError(f"{where[POS].path}: tensor {POS!r} has {rows} rows, not a square grid: ggk takes "
                                f"the grid side as round(sqrt(rows)) = {grid} and needs {grid}x{grid} = {grid * grid}"
                                f" rows. Use the checkpoint's full square position table; {_FIX}")
    sizes.update(pos_grid=grid, blocks=blocks)
    expected = sigvq_tensor_shapes(**sizes)
    for name, want in expected.items():
        got = where[name].shape(name)
        if got != want:
            raise VisionExportError(f"{where[name].path}: tensor {name!r} has shape {list(got)}, expected "
                                    f"{list(want)} from the other tensors ({_describe(sizes)}); {_FIX}")
    if sizes["hidden"] % HEADS:
        raise VisionExportError(f"{where[PATCH].path}: hidden size {sizes['hidden']} (tensor {PATCH!r}) is not a "
                                f"multiple of ggk's fixed {HEADS} SigVQ attention heads; {_FIX}")
    return sizes


def _describe(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sizes.items())


def _stored(st: SafetensorsFile, name: str, kept_f32: list[str]) -> np.ndarray:
    """The tensor in the dtype it is written in (see the module docstring)."""
    if st.dtype(name) not in _FLOAT_DTYPES:
        raise VisionExportError(f"{st.path}: tensor {name!r} has dtype {st.dtype(name)}; expected floating point; "
                                f"{_FIX}")
    f32 = np.ascontiguousarray(to_float32(st.raw(name), st.dtype(name)), dtype=np.float32)
    if not np.isfinite(f32).all():
        raise VisionExportError(f"{st.path}: tensor {name!r} contains NaN or inf; the checkpoint is damaged: "
                                "download it again")
    if f32.ndim < 2 or name in ENGINE_F32:
        return f32
    peak = float(np.abs(f32).max()) if f32.size else 0.0
    if name in ENGINE_F16 and peak > F16_MAX:
        raise VisionExportError(f"{st.path}: tensor {name!r} has |value| {peak:.6g} beyond the f16 range "
                                f"({F16_MAX:g}); ggk holds it in f16, where it would be inf. This checkpoint "
                                "cannot run in ggk as it is")
    stored = fmt.f16_unless_overflow(name, f32)
    if stored.dtype != np.float16:
        kept_f32.append(name)
    return stored


def write_vision_gguf(folder: Path, out: Path, *, name: str, source: str, commit: str) -> dict[str, Any]:
    """Convert the SigVQ checkpoint in ``folder`` to the GGUF ggk loads, at ``out`` (atomic, verified).

    Returns ``{path, bytes, sha256, architecture, name, tensor_count, f16_count, f32_count, kept_f32,
    skipped, unmapped, hparams, source, commit}``: ``skipped`` lists the checkpoint's tensors ggk does
    not read; ``unmapped`` is always empty (every tensor keeps its name) and stays for the summary's
    readers; ``hparams`` holds the sizes also written as ``sigvq.<size>``.
    """
    folder, out = Path(folder), Path(out)
    where = _read_weights(folder)
    sizes = _sizes(folder, where)
    hparams = {k: (HEADS if k == "heads" else sizes[k]) for k in HPARAMS}
    kept_f32: list[str] = []
    tensors = {t: _stored(where[t], t, kept_f32) for t in sigvq_tensor_shapes(**sizes)}
    skipped = sorted(set(where) - set(tensors))
    kvs = [fmt.KV(fmt.KEY_ARCHITECTURE, GGUFValueType.STRING, ARCH),
           fmt.KV(fmt.KEY_NAME, GGUFValueType.STRING, name),
           fmt.KV(KEY_SOURCE, GGUFValueType.STRING, source),
           fmt.KV(KEY_COMMIT, GGUFValueType.STRING, commit),
           *(fmt.KV(f"{ARCH}.{k}", GGUFValueType.UINT32, v) for k, v in hparams.items())]
    written = fmt.write_verified_gguf(out, kvs, tensors)
    f16 = sum(1 for a in tensors.values() if a.dtype == np.float16)
    logger.info("wrote SigVQ encoder %s: %d tensors (%d f16), %d skipped, %d bytes", out, len(tensors), f16,
                len(skipped), written.bytes)
    return {"path": str(out), "bytes": written.bytes, "sha256": written.sha256, "architecture": ARCH, "name": name,
            "tensor_count": len(tensors), "f16_count": f16, "f32_count": len(tensors) - f16, "kept_f32": kept_f32,
            "skipped": skipped, "unmapped": [], "hparams": hparams, "source": source, "commit": commit}
