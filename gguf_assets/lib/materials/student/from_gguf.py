"""A student given as the GGUF ggk runs with ``--llm``, turned into the transformers Qwen3 folder the rest reads.

``materials.student`` may name the user's own student file (``pig_clip-f16.gguf``): a Qwen3 under its Hugging Face
tensor names (``model.*``), the layout ``gguf_assets.lib.output.student_gguf`` writes, in f32/f16/bf16 or any type
gguf-py dequantizes (q8_0, q4_0, the k-quants ...). ggk reads no metadata key from it: it takes hidden size,
vocabulary, heads, kv heads, layers and MLP width from the tensor shapes and fixes the rest (head dim 128, RMSNorm
eps 1e-6, rope theta 1e6; ``gguf_assets.lib.core.ggk_contract``). So does this module: ``read_student_gguf`` checks
the tensors against that Qwen3 (naming the file and the tensor when they are not) and derives the config from the
shapes; ``convert_student_gguf`` writes config.json, model.safetensors (the dequantized tensors: BF16 where the GGUF
has BF16, else F32, so nothing is rounded again) and the tokenizer files of ``materials.student_tokenizer`` into a
folder, atomically, with ``gguf_source.json`` saying what it was made from. Precompute, the export and the checks
then read that folder as they read any student.

No torch and no dagster here: gguf-py reads and dequantizes, the safetensors file is written directly.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.ggk_contract import (
    GGK_VERSION,
    STUDENT_HEAD_DIM,
    STUDENT_RMS_NORM_EPS,
    STUDENT_ROPE_THETA,
)
from gguf_assets.lib.materials.student.contract import (
    EMBED,
    FINAL_NORM,
    PREFIX,
    _config_problem,
    _layer_indices,
    expected_shapes,
)

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
CONVERTED_DIR = "student-gguf"  # under materials/: one folder per converted GGUF (and tokenizer)
SOURCE_RECORD = "gguf_source.json"
CONVERTER_VERSION = 1  # raised when the conversion writes something else: every student is converted again
LM_HEAD = "lm_head.weight"
TOKENIZER_FILE = "tokenizer.json"
# What is copied from materials.student_tokenizer: the tokenizer and what transformers reads beside it.
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")
MAX_POSITION_EMBEDDINGS = 40960  # Qwen3's; ggk has no such limit, transformers' rope needs a value
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_WEIGHTS_FILE = "model.safetensors"


class StudentGgufError(UserError, ValueError):
    """The GGUF is not ggk's Qwen3 student, or cannot be converted; the message names the file and the tensor."""


def is_gguf_source(source: str) -> bool:
    """Whether a ``materials.student`` value names a GGUF file (by its suffix)."""
    return source.strip().lower().endswith(GGUF_SUFFIX)


@dataclass(frozen=True)
class GgufStudent:
    """What ``read_student_gguf`` found: the config the shapes give and the tensors to convert, in file order."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, Any]  # safetensors name -> gguf ReaderTensor
    ignored: list[str]  # tensors ggk does not load (left out)
    types: dict[str, int]  # ggml type name -> tensor count


def _numpy_shape(tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(tensor.shape))


def _open(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (OSError, ValueError, KeyError, IndexError, struct.error) as exc:
        raise StudentGgufError(f"{path} cannot be read as a GGUF file ({type(exc).__name__}: {exc}); copy it again "
                               "or export the student again") from None


def read_student_gguf(path: Path) -> GgufStudent:
    """The student in the GGUF at ``path`` as ggk would load it: its config (from the shapes) and its tensors.

    Raises ``StudentGgufError`` naming the file and the tensor when ggk would not run it as the Qwen3 the config
    describes (llama.cpp names, a missing tensor, a head dim other than 128, a shape that does not fit).
    """
    path = Path(path)
    reader = _open(path)
    by_name = {t.name: t for t in reader.tensors}
    ggk = f"ggk {GGK_VERSION}"
    fix = ("export the student with its Hugging Face tensor names (model.*), as gguf-trainer's student GGUF has")
    if not any(name.startswith(PREFIX) for name in by_name):
        shown = ", ".join(sorted(by_name)[:4]) or "none"
        if "token_embd.weight" in by_name:
            raise StudentGgufError(f"{path}: its tensors have llama.cpp's names ({shown}, ...), but {ggk}'s --llm "
                                   f"loads the student under its Hugging Face names (model.embed_tokens.weight, "
                                   f"model.layers.N.*); {fix}")
        raise StudentGgufError(f"{path}: no tensor is named model.* (its tensors: {shown}), so it is not the Qwen3 "
                               f"student {ggk}'s --llm loads; {fix}")
    embed_name, norm_name = PREFIX + EMBED, PREFIX + FINAL_NORM
    for name, what in ((embed_name, "the token embedding"), (norm_name, "the final RMSNorm")):
        if name not in by_name:
            raise StudentGgufError(f"{path}: tensor {name} ({what}) is missing, without which {ggk} does not run the "
                                   f"student as transformers does; {fix} from the whole model")
    embed_shape = _numpy_shape(by_name[embed_name])
    if len(embed_shape) != 2:
        raise StudentGgufError(f"{path}: tensor {embed_name} has shape {list(embed_shape)}, but the token embedding "
                               "is a 2-D vocabulary x hidden matrix")
    rows, hidden = embed_shape
    layers = max(_layer_indices([n for n in by_name if n.startswith(PREFIX)]), default=-1) + 1
    if layers == 0:
        raise StudentGgufError(f"{path}: no model.layers.N.* tensors, so the student has no layers; {fix}")
    sizes = {}
    for leaf in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight"):
        name = f"{PREFIX}layers.0.{leaf}"
        if name not in by_name:
            raise StudentGgufError(f"{path}: tensor {name} is missing; {fix} from the whole model")
        shape = _numpy_shape(by_name[name])
        if len(shape) != 2:
            raise StudentGgufError(f"{path}: tensor {name} has shape {list(shape)}, but it is a 2-D matrix")
        sizes[leaf] = shape[0]
    for leaf in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
        if sizes[leaf] % STUDENT_HEAD_DIM:
            raise StudentGgufError(f"{path}: tensor {PREFIX}layers.0.{leaf} has {sizes[leaf]} rows, not a multiple of "
                                   f"{STUDENT_HEAD_DIM}, but {ggk} fixes the student's head dim at {STUDENT_HEAD_DIM}; "
                                   "pick a student with head_dim 128 (as Qwen/Qwen3-0.6B has)")
    q_norm = f"{PREFIX}layers.0.self_attn.q_norm.weight"
    if q_norm in by_name and _numpy_shape(by_name[q_norm]) != (STUDENT_HEAD_DIM,):
        raise StudentGgufError(f"{path}: tensor {q_norm} has shape {list(_numpy_shape(by_name[q_norm]))}, so the "
                               f"head dim is not {STUDENT_HEAD_DIM}, at which {ggk} fixes it; pick a student with "
                               f"head_dim {STUDENT_HEAD_DIM} (as Qwen/Qwen3-0.6B has)")
    config = student_config(hidden=hidden, vocab=rows, layers=layers,
                            heads=sizes["self_attn.q_proj.weight"] // STUDENT_HEAD_DIM,
                            kv_heads=sizes["self_attn.k_proj.weight"] // STUDENT_HEAD_DIM,
                            intermediate=sizes["mlp.gate_proj.weight"], tied=LM_HEAD not in by_name)
    problem = _config_problem(str(path), config)  # e.g. ggk's 28-layer quirk, kv heads that do not divide
    if problem:
        raise StudentGgufError(problem)
    expected = expected_shapes(config, rows)
    if LM_HEAD in by_name:
        expected[LM_HEAD] = (rows, hidden)
    tensors: dict[str, Any] = {}
    for name, shape in expected.items():
        if name not in by_name:
            raise StudentGgufError(f"{path}: tensor {name} is missing for the {layers}-layer student its other "
                                   f"tensors describe; {fix} from the whole model")
        found = _numpy_shape(by_name[name])
        if found != shape:
            raise StudentGgufError(f"{path}: tensor {name} has shape {list(found)}, but the student's other tensors "
                                   f"(hidden {hidden}, {config['num_attention_heads']} heads and "
                                   f"{config['num_key_value_heads']} kv heads of {STUDENT_HEAD_DIM}, MLP "
                                   f"{config['intermediate_size']}) give {list(shape)}; the file is not one Qwen3 "
                                   "student, export it again")
        tensors[name] = by_name[name]
    ignored = sorted(n for n in by_name if n not in tensors)
    types: dict[str, int] = {}
    for t in tensors.values():
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return GgufStudent(path, config, tensors, ignored, types)


def student_config(*, hidden: int, vocab: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                   tied: bool, dtype: str = "float32", token_ids: dict[str, int | None] | None = None) -> dict:
    """config.json of the Qwen3 ggk runs with these sizes: its fixed constants, the sizes from the shapes."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": hidden, "vocab_size": vocab,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "intermediate_size": intermediate, "head_dim": STUDENT_HEAD_DIM, "rms_norm_eps": STUDENT_RMS_NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": STUDENT_ROPE_THETA},
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * layers, "tie_word_embeddings": tied, "use_cache": True,
        "dtype": dtype, **(token_ids or {}),
    }


def _token_ids(tokenizer_folder: Path) -> dict[str, int | None]:
    """pad/eos/bos ids for config.json, from tokenizer_config.json's token strings (None when unknown)."""
    try:
        spec = json.loads((tokenizer_folder / TOKENIZER_FILE).read_text(encoding="utf-8"))
        tok_config = json.loads((tokenizer_folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    ids = {**((spec.get("model") or {}).get("vocab") or {}),
           **{t["content"]: t["id"] for t in spec.get("added_tokens") or [] if "content" in t and "id" in t}}
    out: dict[str, int | None] = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = tok_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        out[f"{key}_id"] = ids.get(value) if isinstance(value, str) else None
    return out


def _dequantized(student: GgufStudent, name: str) -> tuple[str, np.ndarray]:
    """(safetensors dtype, array) of one tensor: BF16 kept as its bits, everything else as float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    tensor = student.tensors[name]
    shape = _numpy_shape(tensor)
    qtype = tensor.tensor_type
    if qtype == GGMLQuantizationType.BF16:
        bits = np.ascontiguousarray(tensor.data).view(np.uint16).reshape(shape)
        check = (bits.astype(np.uint32) << 16).view(np.float32)
        out: tuple[str, np.ndarray] = ("BF16", bits)
    else:
        try:
            values = np.asarray(dequantize(tensor.data, qtype), dtype=np.float32).reshape(shape)
        except (NotImplementedError, ValueError, KeyError) as exc:
            raise StudentGgufError(f"{student.path}: tensor {name} has type {qtype.name}, which gguf-py cannot "
                                   f"dequantize here ({type(exc).__name__}: {exc}); export the student in f16, "
                                   "bf16 or q8_0") from None
        check = values
        out = ("F32", np.ascontiguousarray(values, dtype=np.float32))
    if not np.isfinite(check).all():
        raise StudentGgufError(f"{student.path}: tensor {name} contains NaN or inf; the student is broken, export "
                               "it again")
    return out


def _write_safetensors(student: GgufStudent, out: Path) -> dict[str, int]:
    """model.safetensors with every tensor of ``student``, written one tensor at a time; dtype -> count."""
    from gguf import GGMLQuantizationType

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in student.tensors.items():
        dtype = "BF16" if tensor.tensor_type == GGMLQuantizationType.BF16 else "F32"
        shape = _numpy_shape(tensor)
        size = int(np.prod(shape)) * (2 if dtype == "BF16" else 4)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    counts: dict[str, int] = {}
    with open(out, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for name in student.tensors:
            dtype, array = _dequantized(student, name)
            if dtype != header[name]["dtype"] or array.nbytes != header[name]["data_offsets"][1] - \
                    header[name]["data_offsets"][0]:
                raise StudentGgufError(f"{student.path}: tensor {name} dequantized to {array.shape} {dtype}, not "
                                       f"{header[name]['shape']} {header[name]['dtype']}")
            fh.write(array.tobytes())
            counts[dtype] = counts.get(dtype, 0) + 1
    return counts


def tokenizer_folder_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot give the GGUF student its tokenizer, or None."""
    if not (folder / TOKENIZER_FILE).is_file():
        present = sorted(p.name for p in folder.iterdir())[:8] if folder.is_dir() else []
        return (f"{folder} has no {TOKENIZER_FILE} (its files: {', '.join(present) or 'none'}); point it at the "
                "folder or hub repo of the student's tokenizer (the model the GGUF was exported from)")
    return None


def converted_folder(materials_dir: Path, gguf_sha256: str, tokenizer_commit: str) -> Path:
    """Where the GGUF with this sha256, given this tokenizer, is converted to: named by both."""
    key = atomic.fingerprint([gguf_sha256, tokenizer_commit, CONVERTER_VERSION])
    return Path(materials_dir) / CONVERTED_DIR / f"{gguf_sha256[:16]}-{key[:8]}"


def source_record(gguf_sha256: str, tokenizer_commit: str) -> dict[str, Any]:
    return {"gguf_sha256": gguf_sha256, "tokenizer_commit": tokenizer_commit, "converter": CONVERTER_VERSION}


def is_converted(folder: Path, gguf_sha256: str, tokenizer_commit: str) -> bool:
    """Whether ``folder`` holds a finished conversion of this GGUF with this tokenizer (by its record)."""
    try:
        recorded = json.loads((folder / SOURCE_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    wanted = source_record(gguf_sha256, tokenizer_commit)
    return isinstance(recorded, dict) and all(recorded.get(k) == v for k, v in wanted.items()) \
        and (folder / "config.json").is_file() and (folder / _WEIGHTS_FILE).is_file()


def convert_student_gguf(gguf_file: Path, tokenizer_folder: Path, out: Path, *, gguf_sha256: str,
                         tokenizer_commit: str) -> dict[str, Any]:
    """Write the transformers Qwen3 folder of the GGUF student at ``gguf_file`` to ``out`` (atomically: the whole
    folder or nothing): config.json, model.safetensors, the tokenizer files of ``tokenizer_folder`` and
    gguf_source.json. Returns that record."""
    gguf_file, tokenizer_folder, out = Path(gguf_file), Path(tokenizer_folder), Path(out)
    problem = tokenizer_folder_problem(tokenizer_folder)
    if problem:
        raise StudentGgufError(problem)
    student = read_student_gguf(gguf_file)
    all_bf16 = set(student.types) == {"BF16"}
    config = {**student.config, "dtype": "bfloat16" if all_bf16 else "float32", **_token_ids(tokenizer_folder)}
    with atomic.atomic_dir(out) as tmp:
        counts = _write_safetensors(student, tmp / _WEIGHTS_FILE)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        copied = []
        for name in TOKENIZER_FILES:
            if (tokenizer_folder / name).is_file():
                shutil.copyfile(tokenizer_folder / name, tmp / name)
                copied.append(name)
        record = {**source_record(gguf_sha256, tokenizer_commit), "gguf_file": gguf_file.name,
                  "gguf_types": student.types, "stored_dtypes": counts, "ignored_tensors": student.ignored,
                  "tokenizer_files": copied}
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    log.info("converted the GGUF student %s (%s) to %s: %d tensors (%s), %d left out", gguf_file,
             ", ".join(f"{n} {k}" for k, n in sorted(student.types.items())), out, len(student.tensors),
             ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), len(student.ignored))
    return record


def remove_other_conversions(materials_dir: Path, keep: Path) -> list[Path]:
    """Delete the conversions of other GGUFs (or tokenizers) beside ``keep``: a changed student's old folder."""
    root = Path(materials_dir) / CONVERTED_DIR
    removed = []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        if child.is_dir() and child != keep:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed
