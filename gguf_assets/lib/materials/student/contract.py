"""Would ggk run this student as transformers does? The student's config.json and tensors against ggk's fixed Qwen3
(model/te/llm.hpp): checked when the materials are pinned, before any precompute, and again by the export.

ggk takes hidden size, vocabulary, heads, kv heads, layers and MLP width from the tensor shapes and fixes everything
else (head dim, RMSNorm eps, NEOX rope theta, qk-norm, no qkv bias, SiLU MLP, full causal attention). A transformers
Qwen3 folder whose config.json says otherwise would give other hidden states in ggk than in training, silently;
``student_contract_problem`` names the first such difference. No torch: config.json and safetensors headers.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from gguf_assets.lib.core.ggk_contract import (
    GGK_VERSION,
    STUDENT_ARCHITECTURES,
    STUDENT_HEAD_DIM,
    STUDENT_RMS_NORM_EPS,
    STUDENT_ROPE_THETA,
)
from gguf_assets.lib.core.safetensors_io import SafetensorsFile

MODEL_TYPE = "qwen3"
CONFIG_FILE = "config.json"
PREFIX = "model."
EMBED = "embed_tokens.weight"
FINAL_NORM = "norm.weight"
# Per-layer tensors (names under model.layers.N.) in file order.
LAYER_TENSORS = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                 "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight")
_LAYER_RE = re.compile(r"layers\.(0|[1-9][0-9]*)\.(.+)")
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# transformers' Qwen3Config defaults for keys a config.json may leave out.
_DEFAULT_ROPE_THETA = 10_000.0
# ggk's num_layers == 28 quirk (llm.hpp: detect_from_weights forces 16 heads for QWEN3).
QUIRK_LAYERS, QUIRK_HEADS = 28, 16
# A real student that meets every rule, for the fixes.
_EXAMPLE = "Qwen/Qwen3-0.6B"


# --- reading the folder --------------------------------------------------------------------


def read_config(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        return None, (f"{path} is missing; point the student at a transformers Qwen3 folder (config.json + "
                      f"*.safetensors, as `Qwen3ForCausalLM.save_pretrained` writes)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"{path} cannot be read as JSON ({exc}); restore it from the model's repo"
    if not isinstance(config, dict):
        return None, f"{path} is not a JSON object; restore it from the model's repo"
    return config, None


def student_weights(folder: Path) -> tuple[dict[str, tuple[SafetensorsFile, str]], list[str], str | None]:
    """(GGUF name → (file, key)) for every tensor ggk loads, the keys left out, and a problem."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return {}, [], f"{folder} has no *.safetensors weights; save the student with `save_pretrained`"
    found: dict[str, tuple[SafetensorsFile, str]] = {}
    for file in files:
        try:
            st = SafetensorsFile(file)
        except (OSError, ValueError) as exc:
            return {}, [], f"{exc}; download or save the student again"
        for key in st.keys():
            if key in found:
                return {}, [], f"{file}: tensor {key!r} is also in {found[key][0].path}; remove the stale file"
            found[key] = (st, key)
    # Qwen3ForCausalLM keeps the model under `model.`; a bare Qwen3Model has no prefix.
    prefixed = any(k.startswith(PREFIX) for k in found)
    selected: dict[str, tuple[SafetensorsFile, str]] = {}
    skipped: list[str] = []
    for key, where in found.items():
        relative = key[len(PREFIX):] if prefixed and key.startswith(PREFIX) else (None if prefixed else key)
        if relative is not None and (relative in (EMBED, FINAL_NORM) or _is_layer_tensor(relative)):
            selected[PREFIX + relative] = where
        else:
            skipped.append(key)
    return selected, sorted(skipped), None


def _is_layer_tensor(relative: str) -> bool:
    match = _LAYER_RE.fullmatch(relative)
    return bool(match and match.group(2) in LAYER_TENSORS)


def _layer_indices(names: list[str]) -> set[int]:
    """Every N of a ``layers.N.`` in the names: what ggk counts layers by (the highest + 1)."""
    return {int(m.group(1)) for n in names if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", n))}


# --- the contract -------------------------------------------------------------------------


def _shown(value: Any) -> str:
    """A config value as config.json spells it (``true``, ``"gelu"``, ``1e-05``)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _rope_problem(where: str, config: dict[str, Any]) -> str | None:
    """Theta and type: transformers 5's ``rope_parameters``, an older config's ``rope_theta``/``rope_scaling``."""
    fix = f"pick a student with plain rope at theta {STUDENT_ROPE_THETA:.0f} (as {_EXAMPLE} has)"
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        return (f"{where}: rope_parameters = {_shown(params)} is not an object; restore config.json from the "
                "model's repo")
    params = params or {}
    scaling = config.get("rope_scaling")
    for key, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        if block is None:
            continue
        if not isinstance(block, dict):
            return f"{where}: {key} = {_shown(block)} is not an object; restore config.json from the model's repo"
        kind = block.get("rope_type", block.get("type", "default"))
        if kind != "default":
            return (f"{where}: {key}.rope_type = {_shown(kind)}, but ggk {GGK_VERSION} fixes the student's rope to "
                    f"plain NEOX rope (no scaling); {fix}")
        factor = block.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            return (f"{where}: {key}.partial_rotary_factor = {_shown(factor)}, but ggk {GGK_VERSION} rotates all "
                    f"{STUDENT_HEAD_DIM} dims of every head; {fix}")
    if "rope_theta" in params:
        key, theta = "rope_parameters.rope_theta", params["rope_theta"]
    elif "rope_theta" in config:
        key, theta = "rope_theta", config["rope_theta"]
    else:
        return (f"{where}: no rope_theta (neither rope_parameters.rope_theta nor rope_theta), so transformers uses "
                f"{_DEFAULT_ROPE_THETA:.0f}, but ggk {GGK_VERSION} fixes the student's rope theta at "
                f"{STUDENT_ROPE_THETA:.0f}; {fix}")
    if not _number(theta) or float(theta) != STUDENT_ROPE_THETA:
        return (f"{where}: {key} = {_shown(theta)}, but ggk {GGK_VERSION} fixes the student's rope theta at "
                f"{STUDENT_ROPE_THETA:.0f}; {fix}")
    return None


def _config_problem(where: str, config: dict[str, Any]) -> str | None:
    ggk = f"ggk {GGK_VERSION}"
    archs = config.get("architectures")
    model_type = config.get("model_type")
    if not isinstance(archs, list) or not archs or any(a not in STUDENT_ARCHITECTURES for a in archs):
        return (f"{where}: architectures = {_shown(archs)}, but {ggk} runs the student as Qwen3 "
                f"({' or '.join(STUDENT_ARCHITECTURES)}); pick a Qwen3 student such as {_EXAMPLE}")
    if model_type != MODEL_TYPE:
        return (f"{where}: model_type = {_shown(model_type)}, but {ggk} runs the student as Qwen3 "
                f"(model_type {MODEL_TYPE!r}); pick a Qwen3 student such as {_EXAMPLE}")
    head_dim = config.get("head_dim", STUDENT_HEAD_DIM)  # Qwen3Config's default is 128
    if head_dim != STUDENT_HEAD_DIM:
        return (f"{where}: head_dim = {_shown(head_dim)}, but {ggk} fixes the student's head dim at "
                f"{STUDENT_HEAD_DIM}; pick a student with head_dim {STUDENT_HEAD_DIM} (as {_EXAMPLE} has)")
    eps = config.get("rms_norm_eps", STUDENT_RMS_NORM_EPS)  # Qwen3Config's default is 1e-6
    if not _number(eps) or float(eps) != STUDENT_RMS_NORM_EPS:
        return (f"{where}: rms_norm_eps = {_shown(eps)}, but {ggk} fixes the student's RMSNorm eps at "
                f"{STUDENT_RMS_NORM_EPS:g}; pick a student with rms_norm_eps {STUDENT_RMS_NORM_EPS:g} "
                f"(as {_EXAMPLE} has)")
    problem = _rope_problem(where, config)
    if problem:
        return problem
    bias = config.get("attention_bias", False)
    if bias is not False:
        return (f"{where}: attention_bias = {_shown(bias)}, but {ggk} runs the student's attention without biases; "
                f"pick a student with attention_bias false (as {_EXAMPLE} has)")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        return (f"{where}: hidden_act = {_shown(act)}, but {ggk} fixes the student's MLP activation to SiLU; pick a "
                f"student with hidden_act \"silu\" (as {_EXAMPLE} has)")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not _positive_int(config.get(key)):
            return (f"{where}: {key} = {_shown(config.get(key))}, but a Qwen3 config needs a positive integer there; "
                    f"restore config.json from the model's repo")
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if not _positive_int(kv_heads) or heads % kv_heads:
        return (f"{where}: num_key_value_heads = {_shown(kv_heads)} does not divide num_attention_heads ({heads}), "
                f"which {ggk}'s grouped attention needs; restore config.json from the model's repo")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        if sliding:
            return (f"{where}: layer_types = {_shown(layer_types[sliding[0]])} for layer {sliding[0]}, but {ggk} runs "
                    f"every student layer with full causal attention; pick a student without sliding-window layers "
                    f"(use_sliding_window false, as {_EXAMPLE} has)")
    elif config.get("use_sliding_window") and config.get("sliding_window") \
            and config.get("max_window_layers", 28) < layers:
        return (f"{where}: use_sliding_window = true (from layer {config.get('max_window_layers', 28)}), but {ggk} "
                f"runs every student layer with full causal attention; pick a student with use_sliding_window false "
                f"(as {_EXAMPLE} has)")
    if layers == QUIRK_LAYERS and heads != QUIRK_HEADS:
        return (f"{where}: num_attention_heads = {heads} with num_hidden_layers = {QUIRK_LAYERS}, but {ggk} forces "
                f"{QUIRK_HEADS} heads on every {QUIRK_LAYERS}-layer Qwen3 student; pick a student with another depth "
                f"or {QUIRK_HEADS} heads (as {_EXAMPLE} has)")
    return None


def expected_shapes(config: dict[str, Any], rows: int) -> dict[str, tuple[int, ...]]:
    """GGUF name → numpy shape of every tensor ggk loads, in file order, for this config."""
    d, inter = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * STUDENT_HEAD_DIM
    kv = (config.get("num_key_value_heads") or config["num_attention_heads"]) * STUDENT_HEAD_DIM
    per_layer = {"input_layernorm.weight": (d,), "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                 "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
                 "self_attn.q_norm.weight": (STUDENT_HEAD_DIM,), "self_attn.k_norm.weight": (STUDENT_HEAD_DIM,),
                 "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (inter, d),
                 "mlp.up_proj.weight": (inter, d), "mlp.down_proj.weight": (d, inter)}
    shapes = {PREFIX + EMBED: (rows, d)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"{PREFIX}layers.{i}.{leaf}": shape for leaf, shape in per_layer.items()})
    shapes[PREFIX + FINAL_NORM] = (d,)
    return shapes


def _weights_problem(folder: Path, config: dict[str, Any],
                     weights: dict[str, tuple[SafetensorsFile, str]]) -> str | None:
    where, ggk = folder / CONFIG_FILE, f"ggk {GGK_VERSION}"
    embed = weights.get(PREFIX + EMBED)
    if embed is None:
        return f"{folder}: the weights have no embed_tokens.weight; save the whole student with `save_pretrained`"
    rows = embed[0].shape(embed[1])[0]
    vocab = config["vocab_size"]
    if vocab > rows:
        return (f"{where}: vocab_size = {vocab}, but the embedding has {rows} rows and {ggk} silently reads row 0 "
                f"for every token id from {rows} on; use a student whose embedding covers its vocabulary")
    if PREFIX + FINAL_NORM not in weights:
        return (f"{folder}: the weights have no model.norm.weight (the final RMSNorm), without which {ggk} silently "
                f"skips the final norm the adapter was trained on; save the whole student with `save_pretrained`")
    layers = config["num_hidden_layers"]
    extra = sorted(i for i in _layer_indices(list(weights)) if i >= layers)
    if extra:
        return (f"{where}: num_hidden_layers = {layers}, but the weights have layers up to {extra[-1]} and {ggk} "
                f"runs every layer it finds; remove the extra layers' tensors or fix num_hidden_layers")
    for name, shape in expected_shapes(config, rows).items():
        if name not in weights:
            return (f"{folder}: the weights have no {name} for the {layers}-layer student config.json describes; "
                    f"save the whole student with `save_pretrained`")
        st, key = weights[name]
        if st.dtype(key) not in _FLOAT_DTYPES:
            return (f"{st.path}: tensor {key!r} has dtype {st.dtype(key)}, but {ggk} loads f32/f16 weights; export "
                    f"from an unquantized (f32, bf16 or f16) checkpoint")
        if st.shape(key) != shape:
            return (f"{st.path}: tensor {key!r} has shape {list(st.shape(key))}, but config.json (hidden_size, "
                    f"num_attention_heads, num_key_value_heads, intermediate_size, head_dim {STUDENT_HEAD_DIM}) "
                    f"gives {list(shape)}, so transformers and {ggk} (which reads the sizes from the shapes) "
                    f"would build different students; use the config.json saved with these weights")
    return None


def student_contract_problem(folder: Path) -> str | None:
    """Why ggk would compute other hidden states than transformers for the student in ``folder``, or None.

    One sentence naming config.json's key (or the tensor), its value, what ggk fixes and the fix. Reads config.json
    and the safetensors headers only.
    """
    folder = Path(folder)
    config, problem = read_config(folder)
    if problem:
        return problem
    problem = _config_problem(str(folder / CONFIG_FILE), config)
    if problem:
        return problem
    weights, _, problem = student_weights(folder)
    return problem or _weights_problem(folder, config, weights)


