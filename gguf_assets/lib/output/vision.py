"""The paired vision encoder as an f16 GGUF, following llama.cpp's mmproj conventions.

A SigLIP-style vision tower (a transformers folder: config.json + *.safetensors, optional
preprocessor_config.json) becomes one GGUF with ``general.architecture = clip``, the
``clip.vision.*`` hyper-parameters from its config, and llama.cpp's ``v.*`` tensor names
(``gguf-py``'s ``TensorNameMap`` for ``MODEL_ARCH.MMPROJ``; a test holds ``VISION_TENSOR_MAP``
to it). Tensors without a known mapping (SigLIP's attention-pooling ``head.*``, anything
model specific) keep their original safetensors names. docs/vision_gguf.md is the
human-readable version of this module.

Only the vision tower is exported: in a composite checkpoint (SigLIP with a text tower,
a VLM) the tensors outside the vision prefix are skipped and listed in the summary.
Writing goes through ``gguf_format.write_verified_gguf`` (temp file, re-read, compare,
rename), and the f16 rule and overflow fallback are the adapter's.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, Keys, LlamaFileType

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.safetensors_io import SafetensorsFile, to_float32
from gguf_assets.lib.output import gguf_format as fmt

logger = logging.getLogger(__name__)

ARCH = "clip"
GGUF_TYPE = "mmproj"  # general.type of llama.cpp's multimodal projector files
FILE_TYPE_MOSTLY_F16 = int(LlamaFileType.MOSTLY_F16)  # 1-D tensors stay f32
VISION_SUFFIX = "-vision.gguf"
CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"

# llama.cpp's clip keys, from gguf-py's constants.
KEY_HAS_VISION = Keys.Clip.HAS_VISION_ENCODER
KEY_USE_GELU = Keys.ClipVision.USE_GELU
# Our own provenance, outside llama.cpp's namespaces.
KEY_SOURCE = "gguf_assets.vision.source"
KEY_COMMIT = "gguf_assets.vision.commit"
KEY_HIDDEN_ACT = "gguf_assets.vision.hidden_act"

# clip.vision.<key> ← config field (all required; a config without one is refused by name).
VISION_HPARAMS: dict[str, tuple[str, GGUFValueType]] = {
    Keys.ClipVision.IMAGE_SIZE: ("image_size", GGUFValueType.UINT32),
    Keys.ClipVision.PATCH_SIZE: ("patch_size", GGUFValueType.UINT32),
    Keys.ClipVision.EMBEDDING_LENGTH: ("hidden_size", GGUFValueType.UINT32),
    Keys.ClipVision.FEED_FORWARD_LENGTH: ("intermediate_size", GGUFValueType.UINT32),
    Keys.ClipVision.BLOCK_COUNT: ("num_hidden_layers", GGUFValueType.UINT32),
    Keys.ClipVision.Attention.HEAD_COUNT: ("num_attention_heads", GGUFValueType.UINT32),
    Keys.ClipVision.Attention.LAYERNORM_EPS: ("layer_norm_eps", GGUFValueType.FLOAT32),
}
KEY_IMAGE_MEAN = Keys.ClipVision.IMAGE_MEAN
KEY_IMAGE_STD = Keys.ClipVision.IMAGE_STD

# Prefixes under which checkpoints keep the vision tower (longest first). transformers 5
# saves a bare SiglipVisionModel with no prefix at all.
VISION_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_model.",
                   "vision_model.")

# SigLIP name (relative to the vision model) → llama.cpp name; {bid} is the block index.
VISION_TENSOR_MAP: dict[str, str] = {
    "embeddings.patch_embedding": "v.patch_embd",
    "embeddings.position_embedding": "v.position_embd",
    "encoder.layers.{bid}.layer_norm1": "v.blk.{bid}.ln1",
    "encoder.layers.{bid}.self_attn.q_proj": "v.blk.{bid}.attn_q",
    "encoder.layers.{bid}.self_attn.k_proj": "v.blk.{bid}.attn_k",
    "encoder.layers.{bid}.self_attn.v_proj": "v.blk.{bid}.attn_v",
    "encoder.layers.{bid}.self_attn.out_proj": "v.blk.{bid}.attn_out",
    "encoder.layers.{bid}.layer_norm2": "v.blk.{bid}.ln2",
    "encoder.layers.{bid}.mlp.fc1": "v.blk.{bid}.ffn_up",
    "encoder.layers.{bid}.mlp.fc2": "v.blk.{bid}.ffn_down",
    "post_layernorm": "v.post_ln",
}
_SUFFIXES = ("weight", "bias")
_BLOCK_RE = re.compile(r"encoder\.layers\.(0|[1-9][0-9]*)\.(.+)")


class VisionExportError(UserError, ValueError):
    """The vision encoder folder cannot be converted; the message names the file and key."""


def vision_gguf_path(output_dir: Path, adapter_name: str) -> Path:
    """Where the vision GGUF goes: beside the adapter, named after it."""
    return Path(output_dir) / f"{adapter_name}{VISION_SUFFIX}"


def vision_tensor_name(relative: str) -> str | None:
    """llama.cpp name of a SigLIP tensor name (relative to the vision model), or None."""
    stem, _, suffix = relative.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    block = _BLOCK_RE.fullmatch(stem)
    pattern = f"encoder.layers.{{bid}}.{block.group(2)}" if block else stem
    target = VISION_TENSOR_MAP.get(pattern)
    if target is None:
        return None
    return f"{target.format(bid=block.group(1)) if block else target}.{suffix}"


def _vision_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise VisionExportError(f"materials.vision_encoder: {path} is missing; point it at a transformers vision "
                                "model folder (config.json + *.safetensors)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise VisionExportError(f"{path}: not valid JSON ({exc})") from exc
    # A composite checkpoint (SiglipModel, a VLM) nests the tower's config.
    nested = config.get("vision_config")
    return nested if isinstance(nested, dict) else config


def _image_stats(folder: Path) -> dict[str, list[float]]:
    path = folder / PREPROCESSOR_FILE
    if not path.is_file():
        return {}
    pre = json.loads(path.read_text(encoding="utf-8"))
    out = {}
    for key, field in ((KEY_IMAGE_MEAN, "image_mean"), (KEY_IMAGE_STD, "image_std")):
        value = pre.get(field)
        if value is None:
            continue
        if not isinstance(value, list) or not value or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
            raise VisionExportError(f"{path}: {field} = {value!r}; expected a non-empty list of numbers")
        out[key] = [float(v) for v in value]
    return out


def vision_metadata(folder: Path, *, name: str, source: str, commit: str) -> list[fmt.KV]:
    """Every metadata entry of the vision GGUF, typed, in file order."""
    config = _vision_config(folder)
    kvs = [fmt.KV(fmt.KEY_ARCHITECTURE, GGUFValueType.STRING, ARCH),
           fmt.KV(fmt.KEY_TYPE, GGUFValueType.STRING, GGUF_TYPE),
           fmt.KV(fmt.KEY_NAME, GGUFValueType.STRING, name),
           fmt.KV(fmt.KEY_FILE_TYPE, GGUFValueType.UINT32, FILE_TYPE_MOSTLY_F16),
           fmt.KV(KEY_HAS_VISION, GGUFValueType.BOOL, True)]
    hidden_act = config.get("hidden_act")
    if isinstance(hidden_act, str) and hidden_act:
        # llama.cpp's clip picks exact GELU with use_gelu, else quick_gelu.
        kvs.append(fmt.KV(KEY_USE_GELU, GGUFValueType.BOOL, hidden_act.startswith("gelu")))
    for key, (field, vtype) in VISION_HPARAMS.items():
        value = config.get(field)
        if vtype == GGUFValueType.UINT32:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**32:
                raise VisionExportError(f"{folder / CONFIG_FILE}: {field} = {value!r}; expected a positive integer "
                                        f"(needed for {key})")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise VisionExportError(f"{folder / CONFIG_FILE}: {field} = {value!r}; expected a positive number "
                                    f"(needed for {key})")
        kvs.append(fmt.KV(key, vtype, value if vtype == GGUFValueType.UINT32 else float(value)))
    for key, values in _image_stats(folder).items():
        kvs.append(fmt.KV(key, GGUFValueType.ARRAY, values, GGUFValueType.FLOAT32))
    for key, value in ((KEY_SOURCE, source), (KEY_COMMIT, commit), (KEY_HIDDEN_ACT, hidden_act)):
        if isinstance(value, str) and value:  # gguf drops empty strings silently
            kvs.append(fmt.KV(key, GGUFValueType.STRING, value))
    return kvs


def _read_weights(folder: Path) -> dict[str, tuple[SafetensorsFile, str]]:
    """Tensor name → (file, name) over every *.safetensors file of the folder."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise VisionExportError(f"materials.vision_encoder: no *.safetensors weights in {folder}")
    where: dict[str, tuple[SafetensorsFile, str]] = {}
    for file in files:
        st = SafetensorsFile(file)
        for key in st.keys():
            if key in where:
                raise VisionExportError(f"{file}: tensor {key!r} is also in {where[key][0].path}")
            where[key] = (st, key)
    return where


def _select_vision(keys: list[str]) -> tuple[dict[str, str], list[str]]:
    """(original key → name relative to the vision model, skipped keys)."""
    prefixed = [k for k in keys if k.startswith(VISION_PREFIXES)]
    if not prefixed:
        return {k: k for k in keys}, []  # a bare vision model
    selected = {}
    for key in prefixed:
        prefix = next(p for p in VISION_PREFIXES if key.startswith(p))
        selected[key] = key[len(prefix):]
    return selected, sorted(set(keys) - set(selected))


def write_vision_gguf(folder: Path, out: Path, *, name: str, source: str, commit: str) -> dict[str, Any]:
    """Convert the vision encoder in ``folder`` to an f16 GGUF at ``out`` (atomic, verified).

    Matrices and other tensors of 2+ dimensions are F16 (F32 if a value exceeds the f16
    range, listed in ``kept_f32``); 1-D tensors (norms, biases) are F32. Returns
    ``{path, bytes, sha256, architecture, tensor_count, f16_count, f32_count, kept_f32,
    mapped, unmapped, skipped}``; ``unmapped`` lists tensors written under their original
    names, ``skipped`` those outside the vision tower.
    """
    folder, out = Path(folder), Path(out)
    kvs = vision_metadata(folder, name=name, source=source, commit=commit)
    hp = {kv.key: kv.value for kv in kvs}
    where = _read_weights(folder)
    selected, skipped = _select_vision(list(where))
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}
    unmapped: list[str] = []
    kept_f32: list[str] = []
    for key, relative in selected.items():
        st, st_key = where[key]
        if st.dtype(st_key) not in ("F32", "F16", "BF16", "F64"):
            raise VisionExportError(f"{st.path}: tensor {key!r} has dtype {st.dtype(st_key)}; expected floating point")
        target = vision_tensor_name(relative)
        if target is None:
            target = key
            unmapped.append(key)
        if target in origin:
            raise VisionExportError(f"{st.path}: tensors {origin[target]!r} and {key!r} both map to {target!r}")
        if len(target) > fmt.MAX_TENSOR_NAME:
            raise VisionExportError(f"{st.path}: tensor {key!r} has no llama.cpp mapping and its name is longer "
                                    f"than GGML's {fmt.MAX_TENSOR_NAME} characters")
        f32 = np.ascontiguousarray(to_float32(st.raw(st_key), st.dtype(st_key)), dtype=np.float32)
        if not np.isfinite(f32).all():
            raise VisionExportError(f"{st.path}: tensor {key!r} contains NaN or inf")
        if f32.ndim >= 2:
            stored = fmt.f16_unless_overflow(target, f32)
            if stored.dtype != np.float16:
                kept_f32.append(target)
        else:
            stored = f32
        tensors[target] = stored
        origin[target] = key
    _check_blocks(folder, tensors, hp)
    written = fmt.write_verified_gguf(out, kvs, tensors)
    f16 = sum(1 for a in tensors.values() if a.dtype == np.float16)
    summary = {"path": str(out), "bytes": written.bytes, "sha256": written.sha256, "architecture": ARCH,
               "name": name, "tensor_count": len(tensors), "f16_count": f16, "f32_count": len(tensors) - f16,
               "kept_f32": kept_f32, "mapped": len(tensors) - len(unmapped), "unmapped": unmapped, "skipped": skipped,
               "source": source, "commit": commit}
    logger.info("wrote vision encoder %s: %d tensors (%d under original names, %d skipped), %d bytes", out,
                len(tensors), len(unmapped), len(skipped), written.bytes)
    return summary


def _check_blocks(folder: Path, tensors: dict[str, np.ndarray], hp: dict[str, Any]) -> None:
    """The config and the weights must describe the same tower."""
    width, blocks = hp[Keys.ClipVision.EMBEDDING_LENGTH], hp[Keys.ClipVision.BLOCK_COUNT]
    needed = ["v.patch_embd.weight", "v.position_embd.weight"]
    for i in range(blocks):
        needed += [f"v.blk.{i}.{t}.weight" for t in ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_up", "ffn_down")]
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise VisionExportError(f"{folder}: weights lack {missing[:6]}{' …' if len(missing) > 6 else ''} for the "
                                f"{blocks}-block SigLIP tower its config.json describes")
    extra = sorted({int(m.group(1)) for n in tensors if (m := re.match(r"v\.blk\.(\d+)\.", n))}
                   - set(range(blocks)))
    if extra:
        raise VisionExportError(f"{folder}: weights have blocks {extra} beyond config.json's num_hidden_layers "
                                f"({blocks})")
    patch = tensors["v.patch_embd.weight"].shape
    p = hp[Keys.ClipVision.PATCH_SIZE]
    if patch[0] != width or tuple(patch[-2:]) != (p, p):
        raise VisionExportError(f"{folder}: patch embedding shape {list(patch)} does not match hidden_size {width} "
                                f"and patch_size {p} in config.json")
