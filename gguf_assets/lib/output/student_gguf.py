"""The student LLM as the GGUF ggk runs with ``--llm``, and the check that ggk would run it as transformers does.

ggk (model/te/llm.hpp, arch QWEN3) loads the student's tensors under their Hugging Face names (``model.*``, read
under ``text_encoders.llm.``) and reads no metadata key: it takes hidden size, vocabulary, heads, kv heads, layers
and MLP width from the tensor shapes and fixes everything else (head dim, RMSNorm eps, NEOX rope theta, qk-norm, no
qkv bias, SiLU MLP, full causal attention). A transformers Qwen3 folder whose config.json says otherwise would give
other hidden states in ggk than in training, silently; ``student_contract_problem`` names the first such difference,
and ``write_student_gguf`` refuses to export such a student.

Layout written: ``general.architecture = qwen3``, ``general.name``, ``general.file_type`` (mostly f16) and our own
provenance keys (``gguf_assets.student.*``); the tensors ``model.embed_tokens.weight``, per layer
``model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm,
mlp.{gate,up,down}_proj}.weight`` and ``model.norm.weight``, in that order. Matrices are F16 (F32 where a value is
beyond the f16 range), norms F32. ``lm_head.weight`` and anything else in the folder is left out (ggk ignores it).
A bare ``Qwen3Model`` checkpoint (names without ``model.``) gets the prefix.

No torch and no dagster here: weights are read with the project's safetensors reader.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, LlamaFileType

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.ggk_contract import (
    GGK_VERSION,
)
from gguf_assets.lib.core.safetensors_io import to_float32
from gguf_assets.lib.materials.student.contract import (
    EMBED,
    PREFIX,
    expected_shapes,
    read_config,
    student_contract_problem,
    student_weights,
)
from gguf_assets.lib.output import gguf_format as fmt

logger = logging.getLogger(__name__)

ARCH = "qwen3"
STUDENT_SUFFIX = "-student.gguf"
FILE_TYPE_MOSTLY_F16 = int(LlamaFileType.MOSTLY_F16)  # 1-D norms stay f32
# Our own provenance, outside ggk's and llama.cpp's namespaces (ggk reads none of the keys).
KEY_SOURCE = "gguf_assets.student.source"
KEY_COMMIT = "gguf_assets.student.commit"
KEY_GGK_VERSION = "gguf_assets.student.ggk_version"  # the engine whose contract the student was checked against

class StudentExportError(UserError, ValueError):
    """The student folder cannot be exported, or ggk would run it differently; the message names the key and fix."""


def student_gguf_path(output_dir: Path, adapter_name: str) -> Path:
    """Where the student GGUF goes: beside the adapter, named after it."""
    return Path(output_dir) / f"{adapter_name}{STUDENT_SUFFIX}"


# --- writing ------------------------------------------------------------------------------


def student_metadata(*, name: str, source: str, commit: str) -> list[fmt.KV]:
    """Every metadata entry of the student GGUF, typed, in file order (ggk reads none of them)."""
    for key, value in (("name", name), ("source", source), ("commit", commit)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"student GGUF {key} must be a non-empty string (got {value!r})")
    return [fmt.KV(fmt.KEY_ARCHITECTURE, GGUFValueType.STRING, ARCH),
            fmt.KV(fmt.KEY_NAME, GGUFValueType.STRING, name),
            fmt.KV(fmt.KEY_FILE_TYPE, GGUFValueType.UINT32, FILE_TYPE_MOSTLY_F16),
            fmt.KV(KEY_SOURCE, GGUFValueType.STRING, source),
            fmt.KV(KEY_COMMIT, GGUFValueType.STRING, commit),
            fmt.KV(KEY_GGK_VERSION, GGUFValueType.STRING, GGK_VERSION)]


def write_student_gguf(folder: Path, out: Path, *, name: str, source: str, commit: str) -> dict[str, Any]:
    """Export the transformers Qwen3 student in ``folder`` to the GGUF ggk runs with ``--llm`` (atomic, verified).

    Raises ``StudentExportError`` with ``student_contract_problem``'s sentence when ggk would run it differently.
    Returns ``{path, bytes, sha256, tensors, f16, f32, kept_f32, skipped}``: tensor counts, matrices kept F32
    (beyond the f16 range) and the folder's tensors left out (``lm_head.weight``).
    """
    folder, out = Path(folder), Path(out)
    kvs = student_metadata(name=name, source=source, commit=commit)
    problem = student_contract_problem(folder)
    if problem:
        raise StudentExportError(problem)
    config, _ = read_config(folder)
    weights, skipped, _ = student_weights(folder)
    rows = weights[PREFIX + EMBED][0].shape(weights[PREFIX + EMBED][1])[0]
    tensors: dict[str, np.ndarray] = {}
    kept_f32: list[str] = []
    for target in expected_shapes(config, rows):
        st, key = weights[target]
        f32 = np.ascontiguousarray(to_float32(st.raw(key), st.dtype(key)), dtype=np.float32)
        if not np.isfinite(f32).all():
            raise StudentExportError(f"{st.path}: tensor {key!r} contains NaN or inf; the student is broken, "
                                     "download or save it again")
        if f32.ndim >= 2:
            tensors[target] = fmt.f16_unless_overflow(target, f32)
            if tensors[target].dtype != np.float16:
                kept_f32.append(target)
        else:
            tensors[target] = f32
    written = fmt.write_verified_gguf(out, kvs, tensors)
    f16 = sum(1 for a in tensors.values() if a.dtype == np.float16)
    logger.info("wrote student %s: %d tensors (%d f16, %d f32), %d left out, %d bytes", out, len(tensors), f16,
                len(tensors) - f16, len(skipped), written.bytes)
    return {"path": str(out), "bytes": written.bytes, "sha256": written.sha256, "tensors": len(tensors), "f16": f16,
            "f32": len(tensors) - f16, "kept_f32": kept_f32, "skipped": skipped}
