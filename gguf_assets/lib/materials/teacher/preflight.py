"""An LLaDA-Image teacher checked before a byte of its weights: its code, config, tokenizer and parts' headers.

The real teacher's weights are 33 GB. Everything that can fail without them fails here, for kilobytes, naming the
file and the fix (``run``'s materials step calls this between the small files and the weights; ``estimate`` calls
it on what it read from the hub):

1. the text encoder's config.json holds every key the forward relies on, with a value it handles (config_problems);
2. the QueryFormer's and text projection's configs build modules whose tensors are exactly their weights' headers
   (names and shapes), and their width is the text encoder's;
3. the tokenizer loads, renders the pipeline's template, and its ids fit the embedding table;
4. with materials.trust_remote_code only: the repo's code imports (its whole closure, lib/materials/teacher/layout.py)
   and builds the backbone on the meta device from the real config, and the backbone's tensors are its weights'
   index and headers.

``header_of(path)`` answers a weights file's header ({name: {"shape": [...], ...}}) or None when it cannot be read
yet: a local file's own header, or the hub's by two range reads (lib/materials/hub_shapes.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from gguf_assets.lib.core.ggk_contract import rendered_prompt
from gguf_assets.lib.materials.teacher import layout

HeaderOf = Callable[[str], dict | None]

ENCODER_CONFIG = f"{layout.TEXT_ENCODER_DIR}/config.json"
PARTS_WEIGHTS = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# What the text-only forward reads from the text encoder's config (the real modeling_llada2uni_moe.py), each with the
# values it handles. Checked before the weights: a key missing here fails deep inside the first shard otherwise.
POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "max_position_embeddings")
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
ROPE_TYPES_HANDLED = ("default",)  # the 4.x function the teacher registers (lib/precompute/llada_teacher.py)
SAMPLE_PROMPT = "a red fox in the snow"


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def config_problems(config: dict) -> list[str]:
    """What the text encoder's config lacks for the forward, one line each naming the key and its value."""
    problems = []
    for key in POSITIVE_INTS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            problems.append(f"{key} is {value!r}, not a positive whole number")
    for key in POSITIVE_NUMBERS:
        if not _number(config.get(key)) or config[key] <= 0:
            problems.append(f"{key} is {config.get(key)!r}, not a positive number")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    head_dim = config.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2):
        problems.append(f"head_dim is {head_dim!r}, not a positive even number")
    factor = config.get("partial_rotary_factor", 1.0)
    if not _number(factor) or not 0 < factor <= 1:
        problems.append(f"partial_rotary_factor is {factor!r}, not a number in (0, 1]")
    rope = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if rope_type not in ROPE_TYPES_HANDLED:
        problems.append(f"rope_scaling's rope_type is {rope_type!r}; the teacher's rotary tables are checked for "
                        f"{', '.join(ROPE_TYPES_HANDLED)} only")
    pad, vocab = config.get("pad_token_id"), config.get("vocab_size")
    if pad is not None and isinstance(vocab, int) and (not isinstance(pad, int) or not 0 <= pad < vocab):
        problems.append(f"pad_token_id {pad!r} is not a row of the {vocab}-row embedding table")
    experts = config.get("num_experts")
    if experts:  # the MoE layers: the router's groups (LLaDA2MoeGate.group_limited_topk) must be well formed
        # n_group and topk_group have defaults in the published configuration class; checked where they are set
        for key in ("moe_intermediate_size", "num_experts_per_tok", *(k for k in ("n_group", "topk_group")
                                                                        if k in config)):
            if not isinstance(config.get(key), int) or config[key] <= 0:
                problems.append(f"{key} is {config.get(key)!r}, not a positive whole number (num_experts is "
                                f"{experts})")
        groups, top_groups, per_token = config.get("n_group"), config.get("topk_group"), \
            config.get("num_experts_per_tok")
        if all(isinstance(v, int) and v > 0 for v in (experts, groups, top_groups, per_token)):
            if experts % groups or experts // groups < 2:
                problems.append(f"num_experts {experts} does not split into n_group {groups} groups of at least "
                                "2 experts")
            elif top_groups > groups or per_token > top_groups * (experts // groups):
                problems.append(f"num_experts_per_tok {per_token} cannot be chosen from topk_group {top_groups} of "
                                f"n_group {groups} groups of {experts // groups} experts")
        if not isinstance(config.get("first_k_dense_replace", 0), int):
            problems.append(f"first_k_dense_replace is {config.get('first_k_dense_replace')!r}, not a whole number")
    return problems


def _shapes(header: dict) -> dict[str, tuple[int, ...]]:
    return {name: tuple(entry["shape"]) for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "shape" in entry}


def tensor_mismatch(where: str, expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
                    *, shapes: bool = True) -> str | None:
    """One line saying how ``found`` (a weights header or index) differs from the module the config builds."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshapen = sorted(f"{k} {list(found[k])} (the config builds {list(expected[k])})"
                       for k in set(found) & set(expected) if shapes and tuple(found[k]) != tuple(expected[k]))
    if not (missing or unexpected or misshapen):
        return None
    return f"{where} does not match its config: " + "; ".join(part for part in (
        f"{len(missing)} tensor(s) missing ({', '.join(missing[:4])})" if missing else "",
        f"{len(unexpected)} unexpected ({', '.join(unexpected[:4])})" if unexpected else "",
        f"misshapen: {', '.join(misshapen[:3])}" if misshapen else "") if part)


def _part_problem(folder: Path, part: str, module_class, hidden: int, header_of: HeaderOf) -> str | None:
    import torch

    config_file = folder / part / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        with torch.device("meta"):
            module = module_class(config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{part}/config.json cannot build the {part} ({type(exc).__name__}: {exc})"
    width = int(config.get("hidden_size", 0))
    if width != hidden:
        return (f"{part}/config.json's hidden_size {width} is not the text encoder's {hidden} ({ENCODER_CONFIG}): "
                "the parts come from different models")
    header = header_of(f"{part}/{PARTS_WEIGHTS}")
    if header is None:
        return None
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    return tensor_mismatch(f"{part}/{PARTS_WEIGHTS}", expected, _shapes(header))


def _tokenizer_problem(folder: Path, vocab: int) -> str | None:
    from transformers import AutoTokenizer

    where = folder / layout.TOKENIZER_DIR
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
        rows = [tokenizer(rendered_prompt(text), add_special_tokens=True)["input_ids"]
                for text in ("", SAMPLE_PROMPT)]
    except Exception as exc:  # noqa: BLE001 (whatever the tokenizer's files make transformers raise)
        return (f"{layout.TOKENIZER_DIR}/ does not load as a tokenizer ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else ''}): restore the pipeline's tokenizer files")
    if not all(rows):
        return f"{layout.TOKENIZER_DIR}/ renders the template to no tokens"
    top = max(max(row) for row in rows)
    if top >= vocab:
        return (f"{layout.TOKENIZER_DIR}/ gives token id {top} for the template, but {ENCODER_CONFIG}'s vocab_size "
                f"is {vocab}: the tokenizer is not this text encoder's")
    return None


def backbone_on_meta(encoder: Path, *, trust_remote_code: bool):
    """The text encoder built by the repo's own code from its config, on the meta device (no weights);
    ``trust_remote_code`` is materials.trust_remote_code (transformers refuses the code without it)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel

    from gguf_assets.lib.materials.teacher.text_stack import written_for_transformers_4

    with written_for_transformers_4():
        config = AutoConfig.from_pretrained(encoder, trust_remote_code=trust_remote_code)
        with init_empty_weights():
            return AutoModel.from_config(config, dtype=torch.bfloat16, trust_remote_code=trust_remote_code)


def _backbone_problem(folder: Path, header_of: HeaderOf, *, trust_remote_code: bool) -> str | None:
    """The repo's code imported and the backbone built on the meta device, its tensors against the weights'."""
    try:
        model = backbone_on_meta(folder / layout.TEXT_ENCODER_DIR, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 (the repo's code can raise anything while it imports and builds)
        text = str(exc).strip().splitlines()
        return (f"the text encoder's code does not import and build from {ENCODER_CONFIG} "
                f"({type(exc).__name__}: {text[-1][:300] if text else ''})")
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    index_file = folder / layout.TEXT_ENCODER_DIR / WEIGHTS_INDEX
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text(encoding="utf-8")).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        named = dict.fromkeys(weight_map, ())
        problem = tensor_mismatch(f"{layout.TEXT_ENCODER_DIR}/{WEIGHTS_INDEX}", expected, named, shapes=False)
    else:
        files, problem = ["model.safetensors"], None
    if problem:
        return problem
    found: dict[str, tuple[int, ...]] = {}
    for name in files:
        header = header_of(f"{layout.TEXT_ENCODER_DIR}/{name}")
        if header is None:
            return None
        found.update(_shapes(header))
    return tensor_mismatch(f"{layout.TEXT_ENCODER_DIR}/ weights", expected, found)


def local_headers(folder: Path) -> HeaderOf:
    """header_of for a local pipeline folder (None for a file that is not there yet)."""
    from gguf_assets.lib.core.safetensors_io import safetensors_header

    def header_of(rel: str) -> dict | None:
        file = folder / rel
        return safetensors_header(file)[0] if file.is_file() else None

    return header_of


def pipeline_problem(folder: Path, settings, *, header_of: HeaderOf | None = None) -> str | None:
    """The first thing about the pipeline in ``folder`` that would fail once its weights are in, or None.

    ``folder`` holds at least model_index.json, the parts' config.json, tokenizer/ and the text encoder's code and
    weights index; the code is run only under materials.trust_remote_code."""
    from gguf_assets.lib.materials.teacher.text_stack import QueryFormer, TextProjection  # torch, only here

    header_of = header_of or local_headers(folder)
    try:
        config = layout.encoder_config(folder)
    except (OSError, ValueError) as exc:
        return f"{ENCODER_CONFIG} does not read as JSON ({exc})"
    problems = config_problems(config)
    if problems:
        return (f"{ENCODER_CONFIG}: {'; '.join(problems)}. The forward reads these keys: restore the published "
                "config.json")
    hidden = config["hidden_size"]
    for part, module_class in ((layout.QUERYFORMER_DIR, QueryFormer), (layout.PROJECTION_DIR, TextProjection)):
        problem = _part_problem(folder, part, module_class, hidden, header_of)
        if problem:
            return problem
    problem = _tokenizer_problem(folder, config["vocab_size"])
    if problem or not settings.materials.trust_remote_code:
        return problem
    return _backbone_problem(folder, header_of, trust_remote_code=settings.materials.trust_remote_code)
