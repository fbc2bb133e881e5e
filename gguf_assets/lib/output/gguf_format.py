"""The adapter's GGUF file: ggk's `--llm-adapter` layout, every key string, tensor name and dtype rule, in one place.

``write_adapter_gguf`` turns the ``Adapter`` state dict (as float32 numpy arrays, the standardization already
folded into ``out_proj`` by the export) plus its hyperparameters and provenance into one GGUF file, atomically
and verified: it writes a temp file beside the target, re-reads it with ``gguf.GGUFReader``, compares every
key and every tensor's bytes, and only then renames it over the target. docs/gguf_layout.md is generated
from this module and lib/core/ggk_contract.py (`python -m gguf_assets.docs`).

Layout (FORMAT_VERSION 3, ggk's seedless resampler; versions 1 and 2 were the product's own and ggk refused them):

* tensors: the torch state-dict names under ``adapter.`` (``adapter.query``, ``adapter.in_proj.weight``,
  ``adapter.blocks.0.self_attn.q.weight``, ``adapter.blocks.0.mlp.0.weight``, ``adapter.ln_out.bias``, ...),
  which ggk loads under ``text_encoders.llm_adapter.`` and reads the variant and sizes from. 2-D linear weights
  are F16; norms, biases and ``query`` F32 (llm_adapter.hpp makes ``query`` an F32 parameter), and so is a
  weight whose values, or whose inputs on the val prompts, would overflow f16.
* shapes: gguf stores a numpy array of shape ``(rows, cols)`` with ``ne = [cols, rows]`` (GGML lists the
  fastest-varying dimension first; the bytes are the same row-major buffer). So a torch
  ``nn.Linear(in, out).weight`` of shape ``(out, in)`` has ``ne = [in, out]``, which is what ggk's Linear reads.
* metadata: ``general.architecture = "llm_adapter"``, ``general.name``, ``adapter.format_version``,
  ``adapter.variant``, the hyperparameters (``HPARAM_TYPES``) as ``adapter.<field>``, and the provenance as
  ``adapter.<key>`` (e.g. ``adapter.student.repo``), of which ``REQUIRED_PROVENANCE`` must be present with
  exactly those types. ggk reads none of the keys: they are for people and tools holding only the file.

No torch here: the evaluator (gguf_eval) imports this module and must stay torch-free.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys

from gguf_assets.lib.core import atomic, faults
from gguf_assets.lib.core.f16 import F16_MAX
from gguf_assets.lib.core.ggk_contract import (
    ADAPTER_HEAD_DIM,
    ADAPTER_LAYER_NORM_EPS,
    ADAPTER_PREFIX,
    ADAPTER_VARIANTS,
)

logger = logging.getLogger(__name__)

ARCH = "llm_adapter"
FORMAT_VERSION = 3          # ggk's resampler (1 and 2, the product's own layouts, are never written nor read)
READ_VERSIONS = (FORMAT_VERSION,)

# The general.* keys every GGUF shares, from gguf-py (the adapter and the vision GGUF both use them).
KEY_ARCHITECTURE = Keys.General.ARCHITECTURE
KEY_NAME = Keys.General.NAME
KEY_TYPE = Keys.General.TYPE
KEY_FILE_TYPE = Keys.General.FILE_TYPE
# Metadata, hyperparameters and provenance share the tensors' namespace: adapter.<key>.
KEY_PREFIX = ADAPTER_PREFIX
KEY_FORMAT_VERSION = f"{KEY_PREFIX}format_version"
KEY_VARIANT = f"{KEY_PREFIX}variant"

# Hyperparameters, as ggk derives them from the tensors (llm_adapter.hpp, detect_from_weights): integers are
# UINT32 and the epsilon FLOAT32, as llama.cpp does for its own.
HPARAM_TYPES: dict[str, GGUFValueType] = {
    "in_dim": GGUFValueType.UINT32,
    "out_dim": GGUFValueType.UINT32,
    "width": GGUFValueType.UINT32,
    "depth": GGUFValueType.UINT32,
    "heads": GGUFValueType.UINT32,
    "head_dim": GGUFValueType.UINT32,
    "query_count": GGUFValueType.UINT32,
    "mlp_hidden": GGUFValueType.UINT32,
    "layer_norm_epsilon": GGUFValueType.FLOAT32,
}
# docs/gguf_layout.md's key tables are generated from the three tables below (`python -m gguf_assets.docs`; a
# test fails when the committed file differs), so the words a loader's author reads are these.
GENERAL_HELP: dict[str, tuple[GGUFValueType, str]] = {
    KEY_ARCHITECTURE: (GGUFValueType.STRING, f"always `{ARCH}`"),
    KEY_NAME: (GGUFValueType.STRING, "human-readable model name (never empty)"),
    KEY_FORMAT_VERSION: (GGUFValueType.UINT32, f"`{FORMAT_VERSION}`; a loader must refuse other values"),
    KEY_VARIANT: (GGUFValueType.STRING, "`resampler`: ggk's seedless resampler (it tells so by `adapter.query` "
                                        "and no `adapter.t5_embed*`)"),
}
HPARAM_HELP: dict[str, str] = {
    "in_dim": "Ds: hidden size of the student's final-norm states fed in (`in_proj`'s input)",
    "out_dim": "D: width of each conditioning row (`out_proj`'s output)",
    "width": "W: internal width (a multiple of 64)",
    "depth": "number of blocks (`adapter.blocks.0` ... `adapter.blocks.{depth-1}`)",
    "heads": f"heads of every attention: `W / {ADAPTER_HEAD_DIM}` (ggk fixes the head dim)",
    "head_dim": f"`{ADAPTER_HEAD_DIM}`",
    "query_count": "Q: learned query rows = rows of the output",
    "mlp_hidden": "MLP hidden size (`4 * W`; ggk reads it from `adapter.blocks.0.mlp.0.weight`)",
    "layer_norm_epsilon": f"eps of every LayerNorm (`{ADAPTER_LAYER_NORM_EPS:g}`, fixed in ggk; the nearest f32)",
}

# Provenance a person holding only the file needs: where the student states come from, what the output
# imitates, what it was trained for and how good it was. Every export carries these with exactly these types;
# build_metadata refuses a file without them.
REQUIRED_PROVENANCE: dict[str, GGUFValueType] = {
    "conditioning": GGUFValueType.STRING,
    "student.repo": GGUFValueType.STRING,
    "student.commit": GGUFValueType.STRING,
    "student.hidden_size": GGUFValueType.INT64,
    "teacher.repo": GGUFValueType.STRING,
    "teacher.commit": GGUFValueType.STRING,
    "training.steps": GGUFValueType.INT64,
    "training.planned_steps": GGUFValueType.INT64,
    "training.checkpoint": GGUFValueType.STRING,
    "training.seed": GGUFValueType.INT64,
    "training.val_centred_cosine": GGUFValueType.FLOAT64,
    "trainer": GGUFValueType.STRING,
}
# Known provenance keys (written as adapter.<key>), in the order the exporter lists them, with the type the
# exporter writes; others are allowed if well formed.
PROVENANCE_HELP: dict[str, tuple[GGUFValueType, str]] = {
    "conditioning": (GGUFValueType.STRING, "the runtime's conditioning contract the student was fed by "
                                           "(`llada-image`: ggk's LLaDA-Image template and pieces)"),
    "student.repo": (GGUFValueType.STRING, "student model repo id or local path"),
    "student.commit": (GGUFValueType.STRING, "student revision (commit hash) or `local:<content hash>`"),
    "student.hidden_size": (GGUFValueType.INT64, "student hidden size (= `in_dim`)"),
    "student.gguf": (GGUFValueType.STRING, "file name of the student GGUF exported beside the adapter (`--llm`)"),
    "teacher.repo": (GGUFValueType.STRING,
                     "teacher model repo id or local path (`mock-teacher` for the dev smoke test)"),
    "teacher.commit": (GGUFValueType.STRING,
                       "teacher revision (commit hash) or content hash (`none` for the mock teacher)"),
    "teacher.layer": (GGUFValueType.INT64, "teacher hidden-state layer index imitated"),
    "training.steps": (GGUFValueType.INT64, "optimizer steps of the exported weights"),
    "training.planned_steps": (GGUFValueType.INT64, "`training.steps` of the run they come from"),
    "training.checkpoint": (GGUFValueType.STRING, "the checkpoint exported (`final`, `best` or `step-N`)"),
    "training.seed": (GGUFValueType.INT64, "training seed"),
    "training.val_centred_cosine": (GGUFValueType.FLOAT64, "val centred cosine of the torch checkpoint at export"),
    "training.fingerprint": (GGUFValueType.STRING, "fingerprint of training settings and inputs"),
    "trainer": (GGUFValueType.STRING, "the program that trained it: `gguf_assets <version>`"),
    # Only when materials.query_rows names the rows (a tensor of another file or repo, such as a text-to-image
    # checkpoint), not the teacher's own query_rows.safetensors:
    "query_rows.source": (GGUFValueType.STRING, "where the query rows came from: a hub repo id or a local path"),
    "query_rows.file": (GGUFValueType.STRING, "the safetensors file in it that holds them"),
    "query_rows.tensor": (GGUFValueType.STRING, "the tensor's name in that file"),
    "query_rows.commit": (GGUFValueType.STRING, "the repo's commit, or `local:<sha256 of the file>`"),
    "query_rows.sha256": (GGUFValueType.STRING, "sha256 of the tensor's bytes as stored in the file"),
}


def metadata_key_rows() -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str, str]]]:
    """The key tables of docs/gguf_layout.md: (key, GGUF type, meaning) for the general keys and hyperparameters,
    in file order; (key, type, required, meaning) for the known provenance keys."""
    fixed = [(f"`{key}`", vtype.name, meaning) for key, (vtype, meaning) in GENERAL_HELP.items()]
    fixed += [(f"`{KEY_PREFIX}{key}`", vtype.name, HPARAM_HELP[key]) for key, vtype in HPARAM_TYPES.items()]
    provenance = [(f"`{KEY_PREFIX}{key}`", vtype.name, "yes" if key in REQUIRED_PROVENANCE else "", meaning)
                  for key, (vtype, meaning) in PROVENANCE_HELP.items()]
    return fixed, provenance


# GGML_MAX_NAME is 64 including the terminating NUL.
MAX_TENSOR_NAME = 63

_KEY_RE = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)*")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_UINT32_MAX = 2**32 - 1

# The resampler's state-dict keys (lib/training/adapter.py names its modules as ggk's tensors): top level, and
# per block. The training statistics (target_centre, target_std) never reach the file.
_TOP_TENSORS = ("query", "in_proj.weight", "in_proj.bias", "ln_out.weight", "ln_out.bias", "out_proj.weight",
                "out_proj.bias")
_BLOCK_NORMS = ("ln_self", "ln_q", "ln_kv", "ln_mlp")
_BLOCK_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                  "cross_attn.v", "cross_attn.o", "mlp.0", "mlp.2")
_BLOCK_LEAVES = tuple(f"{module}.{param}" for module in (*_BLOCK_NORMS, *_BLOCK_LINEARS)
                      for param in ("weight", "bias"))
_BLOCK_KEY_RE = re.compile(r"blocks\.(0|[1-9][0-9]*)\.(.+)")
TRAINING_ONLY = ("target_centre", "target_std", "loss_std")


class GGUFVerifyError(ValueError):
    """The file re-read after writing differs from what was meant to be written."""


class KV(NamedTuple):
    """One metadata entry exactly as written (and as verified after re-reading)."""

    key: str
    vtype: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None


# --- tensor names ---------------------------------------------------------------------


def _is_adapter_key(key: str) -> bool:
    if key in _TOP_TENSORS:
        return True
    match = _BLOCK_KEY_RE.fullmatch(key)
    return bool(match and match.group(2) in _BLOCK_LEAVES)


def tensor_name(state_dict_key: str) -> str:
    """GGUF tensor name of an ``Adapter`` state-dict key (ggk's: the key under ``adapter.``); ValueError for an
    unknown key."""
    if not _is_adapter_key(state_dict_key):
        raise ValueError(f"unknown adapter state-dict key {state_dict_key!r}: ggk's resampler has no such tensor "
                         "(did adapter.py gain a parameter? then ggk must read it first)")
    name = KEY_PREFIX + state_dict_key
    if len(name) > MAX_TENSOR_NAME:
        raise ValueError(f"tensor name {name!r} is longer than GGML's {MAX_TENSOR_NAME} characters")
    return name


def state_dict_key(gguf_name: str) -> str:
    """Inverse of ``tensor_name``."""
    key = gguf_name[len(KEY_PREFIX):] if gguf_name.startswith(KEY_PREFIX) else ""
    if not _is_adapter_key(key):
        raise ValueError(f"unknown adapter GGUF tensor name {gguf_name!r}")
    return key


def is_f16_tensor(state_dict_key: str) -> bool:
    """Whether the tensor is stored F16 (unless out of F16 range): the 2-D linear weights. ``query`` is an F32
    parameter in ggk; norms and biases stay F32 (tiny, and precision-sensitive)."""
    match = _BLOCK_KEY_RE.fullmatch(state_dict_key)
    leaf = match.group(2) if match else state_dict_key
    module, _, param = leaf.rpartition(".")
    return param == "weight" and module in (*_BLOCK_LINEARS, "in_proj", "out_proj")


# --- hyperparameters ------------------------------------------------------------------


def hparams_of(*, student_dim: int, query_rows: int, target_dim: int, width: int, depth: int,
               mlp_ratio: int = 4) -> dict[str, Any]:
    """The file's hyperparameters for an adapter of this shape (lib/training/adapter.py's AdapterShape fields)."""
    return {"in_dim": student_dim, "out_dim": target_dim, "width": width, "depth": depth,
            "heads": width // ADAPTER_HEAD_DIM, "head_dim": ADAPTER_HEAD_DIM, "query_count": query_rows,
            "mlp_hidden": mlp_ratio * width, "layer_norm_epsilon": ADAPTER_LAYER_NORM_EPS}


def validate_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """Exactly the HPARAM_TYPES keys, positive ints / positive finite eps, heads of ggk's head dim; a clean dict."""
    missing = sorted(set(HPARAM_TYPES) - set(hparams))
    extra = sorted(set(hparams) - set(HPARAM_TYPES))
    if missing or extra:
        raise ValueError(f"hparams: missing {missing}, unexpected {extra}; expected exactly {list(HPARAM_TYPES)}")
    clean: dict[str, Any] = {}
    for key, vtype in HPARAM_TYPES.items():
        value = hparams[key]
        if vtype == GGUFValueType.UINT32:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 < int(value) <= _UINT32_MAX:
                raise ValueError(f"hparams[{key!r}] = {value!r}: expected a positive integer")
            clean[key] = int(value)
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(float(value)) or float(value) <= 0:
                raise ValueError(f"hparams[{key!r}] = {value!r}: expected a positive finite number")
            clean[key] = float(value)
    if clean["head_dim"] != ADAPTER_HEAD_DIM or clean["heads"] * ADAPTER_HEAD_DIM != clean["width"]:
        raise ValueError(f"hparams: heads ({clean['heads']}) x head_dim ({clean['head_dim']}) must be width "
                         f"({clean['width']}) with ggk's head dim {ADAPTER_HEAD_DIM}")
    return clean


def expected_tensor_shapes(hparams: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """State-dict key -> numpy/torch shape for these hparams, in the file's tensor order."""
    hp = validate_hparams(hparams)
    ds, q, d, w, hidden = hp["in_dim"], hp["query_count"], hp["out_dim"], hp["width"], hp["mlp_hidden"]
    shapes: dict[str, tuple[int, ...]] = {"query": (q, w)}

    def norm(prefix: str, n: int) -> None:
        shapes[f"{prefix}.weight"] = (n,)
        shapes[f"{prefix}.bias"] = (n,)

    def linear(prefix: str, n_in: int, n_out: int) -> None:
        shapes[f"{prefix}.weight"] = (n_out, n_in)
        shapes[f"{prefix}.bias"] = (n_out,)

    linear("in_proj", ds, w)
    for i in range(hp["depth"]):
        p = f"blocks.{i}."
        norm(p + "ln_self", w)
        for proj in "qkvo":
            linear(f"{p}self_attn.{proj}", w, w)
        norm(p + "ln_q", w)
        norm(p + "ln_kv", w)
        for proj in "qkvo":
            linear(f"{p}cross_attn.{proj}", w, w)
        norm(p + "ln_mlp", w)
        linear(p + "mlp.0", w, hidden)
        linear(p + "mlp.2", hidden, w)
    norm("ln_out", w)
    linear("out_proj", w, d)
    return shapes


def hparams_from_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The hparams dict back from ``read_gguf_metadata``'s result (checks arch and version)."""
    check_header(metadata)
    missing = [KEY_PREFIX + k for k in HPARAM_TYPES if KEY_PREFIX + k not in metadata]
    if missing:
        raise ValueError(f"GGUF lacks hyperparameter keys {missing}")
    return validate_hparams({k: metadata[KEY_PREFIX + k] for k in HPARAM_TYPES})


def provenance_from_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The provenance dict back (``adapter.<key>`` minus hparams, format_version and variant)."""
    reserved = {KEY_FORMAT_VERSION, KEY_VARIANT} | {KEY_PREFIX + k for k in HPARAM_TYPES}
    return {k[len(KEY_PREFIX):]: v for k, v in metadata.items() if k.startswith(KEY_PREFIX) and k not in reserved}


def check_header(metadata: Mapping[str, Any]) -> None:
    """ValueError unless this is an llm_adapter file of the version this code reads."""
    arch = metadata.get(KEY_ARCHITECTURE)
    if arch != ARCH:
        raise ValueError(f"{KEY_ARCHITECTURE} is {arch!r}, expected {ARCH!r}")
    version = metadata.get(KEY_FORMAT_VERSION)
    if version not in READ_VERSIONS:
        raise ValueError(f"{KEY_FORMAT_VERSION} is {version!r}; this code reads versions {READ_VERSIONS} (an "
                         "older file is the product's own layout, which ggk refuses: export again)")
    if metadata.get(KEY_VARIANT) not in ADAPTER_VARIANTS:
        raise ValueError(f"{KEY_VARIANT} is {metadata.get(KEY_VARIANT)!r}; this code reads {ADAPTER_VARIANTS}")


# --- metadata -------------------------------------------------------------------------


def _scalar_kv(key: str, value: Any) -> KV:
    """Type a provenance scalar: str, bool, int (INT64) or float (FLOAT64, finite)."""
    if isinstance(value, str):
        # gguf's add_string silently drops an empty string: refuse instead.
        if not value:
            raise ValueError(f"metadata key {key!r} has an empty string (gguf would silently drop the key)")
        return KV(key, GGUFValueType.STRING, value)
    if isinstance(value, (bool, np.bool_)):
        return KV(key, GGUFValueType.BOOL, bool(value))
    if isinstance(value, (int, np.integer)):
        if not _INT64_MIN <= int(value) <= _INT64_MAX:
            raise ValueError(f"metadata key {key!r} = {value!r} does not fit in int64")
        return KV(key, GGUFValueType.INT64, int(value))
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(float(value)):
            raise ValueError(f"metadata key {key!r} = {value!r} is not finite")
        return KV(key, GGUFValueType.FLOAT64, float(value))
    raise ValueError(f"metadata key {key!r}: unsupported value {value!r} of type {type(value).__name__} "
                     f"(use str, int, float, bool or a non-empty list of one of them)")


def _provenance_kv(key: str, value: Any) -> KV:
    if isinstance(value, (list, tuple)):
        # gguf's add_array silently drops an empty array: refuse instead.
        if not value:
            raise ValueError(f"metadata key {key!r} has an empty array (gguf would silently drop the key)")
        items = [_scalar_kv(key, v) for v in value]
        types = {item.vtype for item in items}
        if len(types) != 1:
            raise ValueError(f"metadata key {key!r}: array items mix types {sorted(t.name for t in types)}")
        return KV(key, GGUFValueType.ARRAY, [item.value for item in items], items[0].vtype)
    return _scalar_kv(key, value)


def _check_required_provenance(provenance: Mapping[str, Any], hp: Mapping[str, Any]) -> None:
    missing = [k for k in REQUIRED_PROVENANCE if k not in provenance]
    if missing:
        raise ValueError(f"provenance lacks required keys {missing}: every adapter GGUF records its conditioning, the "
                         f"student and teacher (repo, commit), the student's hidden size, the trained and planned "
                         f"steps, the checkpoint, seed, val centred cosine and trainer "
                         f"(gguf_format.REQUIRED_PROVENANCE)")
    for key, vtype in REQUIRED_PROVENANCE.items():
        got = _provenance_kv(KEY_PREFIX + key, provenance[key]).vtype
        if got != vtype:
            raise ValueError(f"provenance key {key!r} = {provenance[key]!r} would be stored as {got.name}; "
                             f"it must be {vtype.name}")
    if provenance["student.hidden_size"] != hp["in_dim"]:
        raise ValueError(f"provenance student.hidden_size ({provenance['student.hidden_size']}) != hparams "
                         f"in_dim ({hp['in_dim']})")
    if not -1.0 <= float(provenance["training.val_centred_cosine"]) <= 1.0:
        raise ValueError(f"provenance training.val_centred_cosine = {provenance['training.val_centred_cosine']!r} "
                         "is not a cosine (outside [-1, 1])")


def build_metadata(*, hparams: Mapping[str, Any], provenance: Mapping[str, Any], name: str) -> list[KV]:
    """Every metadata entry the file will hold, typed, in file order."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"metadata key {KEY_NAME!r}: name must be a non-empty string (got {name!r})")
    hp = validate_hparams(hparams)
    kvs = [KV(KEY_ARCHITECTURE, GGUFValueType.STRING, ARCH),
           KV(KEY_NAME, GGUFValueType.STRING, name),
           KV(KEY_FORMAT_VERSION, GGUFValueType.UINT32, FORMAT_VERSION),
           KV(KEY_VARIANT, GGUFValueType.STRING, ADAPTER_VARIANTS[0])]
    kvs += [KV(KEY_PREFIX + k, vtype, hp[k]) for k, vtype in HPARAM_TYPES.items()]
    _check_required_provenance(provenance, hp)
    reserved = {kv.key for kv in kvs}
    for key, value in provenance.items():
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"provenance key {key!r}: use lowercase dotted names like 'student.repo'")
        full = KEY_PREFIX + key
        if full in reserved:
            raise ValueError(f"provenance key {key!r} collides with the reserved key {full!r}")
        kvs.append(_provenance_kv(full, value))
    return kvs


# --- tensors --------------------------------------------------------------------------


def f16_unless_overflow(name: str, f32: np.ndarray) -> np.ndarray:
    """``f32`` as float16, or unchanged (float32) if a value lies beyond the f16 range."""
    if f32.size and float(np.abs(f32).max()) > F16_MAX:
        # Writing inf would poison every output; F32 costs a little size only.
        logger.warning("tensor %s has |value| %.6g > %g (f16 max): kept in f32", name, float(np.abs(f32).max()),
                       F16_MAX)
        return f32
    return f32.astype(np.float16)


def _f16_has_nan_or_inf(array: np.ndarray, chunk: int = 1 << 19) -> bool:
    """All exponent bits set is inf or NaN. Integer ops on the bits, as numpy's float16 ufuncs are
    slow, a chunk at a time so the temporaries stay in the CPU cache."""
    bits = array.reshape(-1).view(np.uint16)
    return any(int((bits[i:i + chunk] & 0x7FFF).max()) >= 0x7C00 for i in range(0, bits.size, chunk))


def _prepare_tensors(tensors: Mapping[str, np.ndarray], hparams: Mapping[str, Any],
                     keep_f32: Collection[str] = ()) -> tuple[dict[str, np.ndarray], list[str]]:
    """Check names/shapes/finiteness and cast: GGUF name → array as stored; plus kept_f32.

    ``keep_f32``: torch names of matrices stored F32 although their values fit f16 (their inputs would
    not: export.activation_rule)."""
    expected = expected_tensor_shapes(hparams)
    missing = [k for k in expected if k not in tensors]
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"adapter tensors do not match hparams: missing {missing}, unexpected {extra}")
    prepared: dict[str, np.ndarray] = {}
    kept_f32: list[str] = []
    for key, shape in expected.items():
        name = tensor_name(key)
        array = np.asarray(tensors[key])
        if not np.issubdtype(array.dtype, np.floating):
            raise ValueError(f"tensor {key!r} ({name}) has dtype {array.dtype}, expected floating point")
        if tuple(array.shape) != shape:
            raise ValueError(f"tensor {key!r} ({name}) has shape {tuple(array.shape)}, expected {shape}")
        if key in keep_f32 and is_f16_tensor(key):
            prepared[name] = np.ascontiguousarray(array, dtype=np.float32)
            if not np.isfinite(prepared[name]).all():
                raise ValueError(f"tensor {key!r} ({name}) contains NaN or inf")
            kept_f32.append(name)
            continue
        if array.dtype == np.float16 and is_f16_tensor(key):
            # Cast by the caller (export casts in torch, many times faster than numpy): checked, not cast again.
            if _f16_has_nan_or_inf(np.ascontiguousarray(array)):
                raise ValueError(f"tensor {key!r} ({name}) contains NaN or inf")
            prepared[name] = np.ascontiguousarray(array)
            continue
        if not np.isfinite(array).all():
            raise ValueError(f"tensor {key!r} ({name}) contains NaN or inf")
        f32 = np.ascontiguousarray(array, dtype=np.float32)
        if not np.isfinite(f32).all():  # e.g. float64 input beyond the float32 range
            raise ValueError(f"tensor {key!r} ({name}) overflows float32")
        if is_f16_tensor(key):
            prepared[name] = f16_unless_overflow(name, f32)
            if prepared[name].dtype != np.float16:
                kept_f32.append(name)
        else:
            prepared[name] = f32
    return prepared, kept_f32


def _ggml_type(array: np.ndarray) -> GGMLQuantizationType:
    return GGMLQuantizationType.F16 if array.dtype == np.float16 else GGMLQuantizationType.F32


# --- write / verify -------------------------------------------------------------------


class _Layout(NamedTuple):
    """What the bytes of a written GGUF are, in file order: ``prefix`` (header, keys, tensor
    infos, as written), then each tensor's bytes at its aligned offset, zeros between."""

    prefix: bytes
    alignment: int


def _pad(n: int, alignment: int) -> int:
    return GGUFWriter.ggml_pad(n, alignment) - n


def _hash_layout(layout: _Layout, tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 of the file ``layout`` and ``tensors`` describe, computed from memory (hashlib
    releases the GIL, so this runs beside the write). ``_verify_file`` then proves the file
    holds exactly these bytes, so this is the file's hash without reading it a second time."""
    sha = hashlib.sha256(layout.prefix)
    sha.update(bytes(_pad(len(layout.prefix), layout.alignment)))
    for array in tensors.values():
        sha.update(memoryview(np.ascontiguousarray(array)).cast("B"))
        sha.update(bytes(_pad(array.nbytes, layout.alignment)))
    return sha.hexdigest()


def _write_file(path: Path, kvs: list[KV], tensors: Mapping[str, np.ndarray],
                pool: ThreadPoolExecutor) -> tuple[_Layout, Future[str]]:
    """Write the GGUF bytes to ``path`` (the temp file); the sha256 is computed in ``pool``
    from the prefix and the arrays while the tensor bytes go to the file."""
    if not kvs or kvs[0].key != KEY_ARCHITECTURE:
        raise ValueError(f"the first metadata entry must be {KEY_ARCHITECTURE}")
    writer = GGUFWriter(path, kvs[0].value)  # writes general.architecture itself
    try:
        for kv in kvs:
            if kv.key != KEY_ARCHITECTURE:
                # add_key_value, not add_string/add_array: those drop empty values silently.
                writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
        for name, array in tensors.items():
            writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with open(path, "rb") as fh:  # flushed by write_ti_data_to_file; a few KiB
            layout = _Layout(fh.read(), writer.data_alignment)
        sha = pool.submit(_hash_layout, layout, tensors)
        for array in tensors.values():
            writer.write_tensor_data(array)
    finally:
        writer.close()
    return layout, sha


def _same_value(vtype: GGUFValueType, expected: Any, actual: Any) -> bool:
    if vtype == GGUFValueType.FLOAT32:
        return bool(np.float32(expected) == np.float32(actual))
    return type(actual) is type(expected) and actual == expected


def _same_bytes(a: np.ndarray, b: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Byte views compared a MiB at a time: no copy, and the comparison's temporary stays in the
    CPU cache (about 2x faster than one array_equal over a tensor of many MiB)."""
    if a.shape != b.shape:
        return False
    return all(np.array_equal(a[i:i + chunk], b[i:i + chunk]) for i in range(0, a.size, chunk))


def _verify_layout(path: Path, reader: GGUFReader, tensors: Mapping[str, np.ndarray], layout: _Layout) -> None:
    """The file is exactly prefix, zeros, tensor, zeros, ...: its size, its prefix and every
    padding byte (a few KiB in all) are checked; the tensors' bytes are compared by the caller."""
    data = reader.data  # the whole file, memory-mapped
    offset = GGUFWriter.ggml_pad(len(layout.prefix), layout.alignment)
    end = offset + sum(GGUFWriter.ggml_pad(a.nbytes, layout.alignment) for a in tensors.values())
    if len(data) != end:
        raise GGUFVerifyError(f"{path}: {len(data)} bytes, expected {end}")
    if bytes(data[:len(layout.prefix)]) != layout.prefix:
        raise GGUFVerifyError(f"{path}: header, keys or tensor infos differ from what was written")
    gaps = [(len(layout.prefix), offset)]
    for array in tensors.values():
        gaps.append((offset + array.nbytes, offset + GGUFWriter.ggml_pad(array.nbytes, layout.alignment)))
        offset = gaps[-1][1]
    if any(np.any(data[a:b]) for a, b in gaps if b > a):
        raise GGUFVerifyError(f"{path}: padding between tensors is not zero")


def _verify_file(path: Path, kvs: list[KV], tensors: Mapping[str, np.ndarray], layout: _Layout) -> None:
    """Re-read ``path`` and compare every key (type and value) and every tensor's bytes, and
    check that every other byte is what ``layout`` says (so its hash is the file's)."""
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # a torn file shows up as any of several reader errors
        raise GGUFVerifyError(f"{path}: cannot re-read the written GGUF: {exc!r}") from exc
    _verify_layout(path, reader, tensors, layout)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    if list(fields) != [kv.key for kv in kvs]:
        raise GGUFVerifyError(f"{path}: keys {list(fields)} != written {[kv.key for kv in kvs]}")
    for kv in kvs:
        field = fields[kv.key]
        types = [kv.vtype] + ([kv.sub_type] if kv.sub_type is not None else [])
        if list(field.types) != types:
            raise GGUFVerifyError(f"{path}: key {kv.key!r} has types {field.types}, expected {types}")
        actual = field.contents()
        if kv.vtype == GGUFValueType.ARRAY:
            same = len(actual) == len(kv.value) and all(
                _same_value(kv.sub_type, e, a) for e, a in zip(kv.value, actual))  # type: ignore[arg-type]
        else:
            same = _same_value(kv.vtype, kv.value, actual)
        if not same:
            raise GGUFVerifyError(f"{path}: key {kv.key!r} reads back {actual!r}, wrote {kv.value!r}")
    read = {t.name: t for t in reader.tensors}
    if list(read) != list(tensors):
        raise GGUFVerifyError(f"{path}: tensors {list(read)} != written {list(tensors)}")
    for name, array in tensors.items():
        t = read[name]
        ne = list(reversed(array.shape))
        if t.tensor_type != _ggml_type(array) or [int(x) for x in t.shape] != ne:
            raise GGUFVerifyError(f"{path}: tensor {name} is {t.tensor_type.name} ne={list(t.shape)}, "
                                  f"expected {_ggml_type(array).name} ne={ne}")
        if not _same_bytes(np.asarray(t.data).reshape(-1).view(np.uint8), array.reshape(-1).view(np.uint8)):
            raise GGUFVerifyError(f"{path}: tensor {name} bytes differ from what was written")


@dataclass(frozen=True)
class VerifiedFile:
    """A file written atomically and verified: its size, and its sha256 (hashed from memory as it was written)."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class WrittenGguf:
    """What ``write_adapter_gguf`` wrote: the file (path, size, sha256), its tensors by stored type (the names
    kept in f32 among them), and the model name, architecture and format version in its metadata. The export
    sidecar (lib/project/manifests.py ``ExportSidecar``) records these fields under the same names."""

    path: str
    bytes: int
    sha256: str
    tensor_count: int
    f16_count: int
    f32_count: int
    kept_f32: tuple[str, ...]  # GGUF names of the tensors kept in f32 that would be f16 (the activation rule, range)
    name: str
    architecture: str
    format_version: int


def write_verified_gguf(path: Path, kvs: list[KV], tensors: Mapping[str, np.ndarray]) -> VerifiedFile:
    """Write any GGUF (architecture = ``kvs[0]``) atomically: temp file, re-read and compare
    every key and tensor byte, then rename. Returns the final file's size and sha256.

    ``tensors`` maps GGUF names to arrays already in their stored dtype (F16 or F32).
    """
    for name, array in tensors.items():
        if len(name) > MAX_TENSOR_NAME:
            raise ValueError(f"tensor name {name!r} is longer than GGML's {MAX_TENSOR_NAME} characters")
        if array.dtype not in (np.float16, np.float32):
            raise ValueError(f"tensor {name!r} has dtype {array.dtype}; only float16/float32 are written")
    # Three passes overlap: the hash (from memory, started with the tensor bytes and still running
    # through the rename), the flush to disk (started once the bytes are written, so atomic_path's
    # own fsync finds nothing left) and the verification (from the page cache).
    with ThreadPoolExecutor(max_workers=2) as pool:
        with atomic.atomic_path(Path(path)) as tmp:
            layout, sha = _write_file(tmp, kvs, tensors, pool)
            faults.point("gguf-export", tmp)
            synced = pool.submit(atomic.fsync_file, tmp)
            _verify_file(tmp, kvs, tensors, layout)
            size = tmp.stat().st_size
            synced.result()
        return VerifiedFile(bytes=size, sha256=sha.result())


def write_adapter_gguf(path: Path, *, tensors: Mapping[str, np.ndarray], hparams: Mapping[str, Any],
                       provenance: Mapping[str, Any], name: str, keep_f32: Collection[str] = ()) -> WrittenGguf:
    """Write the adapter GGUF atomically and verified; return what was written.

    ``tensors`` is the ``Adapter`` state dict as float arrays (torch names). The target
    file is replaced only after the temp file re-reads identically; on any error the old
    file (if any) is untouched and no temp file remains.
    """
    path = Path(path)
    kvs = build_metadata(hparams=hparams, provenance=provenance, name=name)
    prepared, kept_f32 = _prepare_tensors(tensors, hparams, keep_f32)
    written = write_verified_gguf(path, kvs, prepared)
    f16 = sum(1 for a in prepared.values() if a.dtype == np.float16)
    summary = WrittenGguf(path=str(path), bytes=written.bytes, sha256=written.sha256, tensor_count=len(prepared),
                          f16_count=f16, f32_count=len(prepared) - f16, kept_f32=tuple(kept_f32), name=name,
                          architecture=ARCH, format_version=FORMAT_VERSION)
    logger.info("wrote %s: %d tensors (%d f16, %d f32), %d bytes, sha256 %s", path, len(prepared), f16,
                len(prepared) - f16, written.bytes, written.sha256[:12])
    return summary


# --- read -----------------------------------------------------------------------------


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key → python value (str, int, float, bool or list); no GGUF.* pseudo keys."""
    reader = GGUFReader(Path(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def read_gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    """GGUF tensor name → numpy copy in the stored dtype, numpy shape (= reversed ne)."""
    reader = GGUFReader(Path(path))
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.tensor_type not in (GGMLQuantizationType.F16, GGMLQuantizationType.F32):
            raise ValueError(f"{path}: tensor {t.name} has type {t.tensor_type.name}; only F16/F32 are used")
        out[t.name] = np.array(t.data).reshape(tuple(int(x) for x in reversed(t.shape)))
    return out
