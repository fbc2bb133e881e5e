"""A tiny random-weight replica of the Hugging Face repo ``inclusionAI/LLaDA-Image-Turbo`` (a diffusers pipeline
folder), for the tests of the LLaDA-Image teacher kind. Nothing is downloaded; the same seed writes the same bytes.

``build_tiny_llada_repo(root)`` writes::

    model_index.json          the diffusers index (there is deliberately NO top-level config.json)
    README.md
    text_encoder/             a tiny bidirectional LLaDA2-MoE-like backbone, loadable ONLY as remote code
                              (config.json's auto_map -> configuration_tiny_llada2.py, modeling_tiny_llada2.py,
                              copied from gguf_assets_tests/llada_remote_code/); safetensors, sharded or not
    tokenizer/                a byte-level BPE (PreTrainedTokenizerFast) with <role>, </role>, <IMAGE1> and
                              <|endoftext|> as added special tokens; pad = <|endoftext|>, no BOS/EOS added
    queryformer/              learned meta queries + cross-attention blocks (config.json, safetensors)
    text_projection/          self-attention layers + a projector to projection_dim (config.json, safetensors)
    sigvq/                    gguf_assets.lib.demo.demo.build_demo_sigvq (only with ``with_sigvq``; the index
                              names it either way)
    transformer/, vae/        the DiT (~2 MiB) and the VAE (~1 MiB): random bytes the product must NEVER download
    scheduler/                scheduler_config.json

The backbone's remote code behaves like the released LLaDA2-MoE code where a teacher can trip (see
llada_remote_code/modeling_tiny_llada2.py): a 2-D attention mask becomes a CAUSAL mask, and its rotary module
needs ``ROPE_INIT_FUNCTIONS["default"]``, which transformers 5 no longer has.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

__all__ = ["TINY_LLADA", "TinyLLaDASizes", "build_tiny_llada_repo", "remote_code_files", "REMOTE_CODE_DIR",
           "SPECIAL_TOKENS", "EOS_TOKEN", "isolated_remote_code"]

REMOTE_CODE_DIR = Path(__file__).resolve().parent / "llada_remote_code"
_REMOTE_CODE = ("configuration_tiny_llada2.py", "modeling_tiny_llada2.py")
_DIFFUSERS_VERSION = "0.36.0"
_SAFETENSORS_METADATA = {"format": "pt"}

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = ("<role>", "</role>", "<IMAGE1>")  # added after the BPE's own EOS


@dataclass(frozen=True)
class TinyLLaDASizes:
    """The replica's sizes, for tests to assert shapes against."""

    hidden_size: int = 32             # the backbone's, queryformer's and text_projection's width
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    num_hidden_layers: int = 2        # the backbone's; layer 0 dense, layer 1 MoE
    intermediate_size: int = 64
    num_experts: int = 4
    num_experts_per_tok: int = 2
    num_shared_experts: int = 1
    moe_intermediate_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 600000.0
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 512
    num_queries: int = 8              # queryformer.meta_queries rows
    queryformer_layers: int = 2
    queryformer_intermediate_size: int = 48
    projection_dim: int = 40          # text_projection's output width
    text_projection_layers: int = 2
    text_projection_intermediate_size: int = 56
    norm_eps: float = 1e-6


TINY_LLADA = TinyLLaDASizes()


def remote_code_files(root: Path) -> list[str]:
    """The backbone's remote-code files in the replica at ``root``, as paths relative to ``root`` (posix, sorted)."""
    root = Path(root)
    return sorted(p.relative_to(root).as_posix() for p in (root / "text_encoder").glob("*.py"))


# ----------------------------------------------------------------------------------------------------- helpers


def _seed_for(seed: int, purpose: str) -> int:
    digest = hashlib.sha256(f"gguf_assets_tests.llada_repo:{seed}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8", newline="\n")


class _Tensors:
    """Seeded tensors, drawn in the order they are asked for from one generator."""

    def __init__(self, seed: int, purpose: str):
        self.gen = torch.Generator().manual_seed(_seed_for(seed, purpose))
        self.t: dict[str, torch.Tensor] = {}

    def normal(self, name: str, shape: tuple[int, ...], std: float, offset: float = 0.0) -> None:
        self.t[name] = (offset + torch.randn(shape, generator=self.gen, dtype=torch.float32) * std).contiguous()

    def linear(self, name: str, out_f: int, in_f: int, *, bias: bool = False, gain: float = 0.7) -> None:
        self.normal(f"{name}.weight", (out_f, in_f), gain / in_f ** 0.5)
        if bias:
            self.normal(f"{name}.bias", (out_f,), 0.02)

    def norm(self, name: str, size: int) -> None:
        self.normal(f"{name}.weight", (size,), 0.05, offset=1.0)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=_SAFETENSORS_METADATA)


def _save_sharded(tensors: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    """``model.safetensors``, or ``shards`` files and their index as save_pretrained names them."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    if shards == 1:
        _save(tensors, folder / "model.safetensors")
        return
    names = sorted(tensors)
    if shards > len(names):
        raise ValueError(f"cannot split {len(names)} tensors into {shards} shards")
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(shards)]
    done = 0
    for name, size in zip(names, sizes):  # by bytes: a tensor goes where its first byte falls
        groups[min(shards - 1, done * shards // total)].append(name)
        done += size
    if not all(groups):  # a few huge tensors: split by count instead
        groups = [names[k * len(names) // shards:(k + 1) * len(names) // shards] for k in range(shards)]
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        _save({n: tensors[n] for n in group}, folder / file)
        weight_map.update({n: file for n in group})
    _write_json(folder / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


# --------------------------------------------------------------------------------------------------- tokenizer


def _prompts(seed: int, n: int = 300) -> list[str]:
    from gguf_assets.lib.demo.demo import _demo_prompt

    rng = random.Random(_seed_for(seed, "prompts"))
    seen: set[str] = set()
    prompts: list[str] = []
    while len(prompts) < n:
        text = _demo_prompt(rng)
        if text not in seen:
            seen.add(text)
            prompts.append(text)
    return prompts


def _build_tokenizer(folder: Path, seed: int):
    """The demo's byte-level BPE (trained on demo prompts, some in the LLaDA template's words), plus the template's
    special tokens. Returns the tokenizer."""
    from gguf_assets.lib.demo.demo import _train_tokenizer

    prompts = _prompts(seed)
    texts = prompts + [f"HUMAN Generate an image: {p}\nASSISTANT\n" for p in prompts[::3]]
    tok = _train_tokenizer(texts)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tok.padding_side = "right"
    tok.model_max_length = TINY_LLADA.max_position_embeddings
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    # As the released repo names it (transformers 5 writes its own backend's name), and the map older versions read.
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config.update({"tokenizer_class": "PreTrainedTokenizerFast", "padding_side": "right",
                   "add_bos_token": False, "add_eos_token": False})
    _write_json(config_file, config)
    _write_json(folder / "special_tokens_map.json",
                {"additional_special_tokens": list(SPECIAL_TOKENS), "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN})
    return tok


# ------------------------------------------------------------------------------------------------ text encoder


def _text_encoder_config(vocab_size: int, pad_token_id: int, eos_token_id: int) -> dict:
    s = TINY_LLADA
    return {
        "architectures": ["TinyLLaDA2ModelLM"],
        "auto_map": {"AutoConfig": "configuration_tiny_llada2.TinyLLaDA2Config",
                     "AutoModel": "modeling_tiny_llada2.TinyLLaDA2ModelLM"},
        "model_type": "tiny_llada2",
        "vocab_size": vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "use_qk_norm": True,
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": {"type": "default", "rope_type": "default"},
        "partial_rotary_factor": s.partial_rotary_factor,
        "max_position_embeddings": s.max_position_embeddings,
        "num_experts": s.num_experts,
        "num_shared_experts": s.num_shared_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "moe_intermediate_size": s.moe_intermediate_size,
        "first_k_dense_replace": 1,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": False,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def _text_encoder_tensors(vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    s = TINY_LLADA
    h, hd = s.hidden_size, s.head_dim
    w = _Tensors(seed, "text_encoder")
    w.normal("model.word_embeddings.weight", (vocab_size, h), 0.1)
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}"
        w.norm(f"{p}.input_layernorm", h)
        w.linear(f"{p}.attention.q_proj", s.num_attention_heads * hd, h)
        w.linear(f"{p}.attention.k_proj", s.num_key_value_heads * hd, h)
        w.linear(f"{p}.attention.v_proj", s.num_key_value_heads * hd, h)
        w.linear(f"{p}.attention.o_proj", h, s.num_attention_heads * hd)
        w.norm(f"{p}.attention.query_layernorm", hd)
        w.norm(f"{p}.attention.key_layernorm", hd)
        w.norm(f"{p}.post_attention_layernorm", h)
        mlps = [(f"{p}.mlp", s.intermediate_size)] if i < 1 else (
            [(f"{p}.mlp.experts.{e}", s.moe_intermediate_size) for e in range(s.num_experts)]
            + [(f"{p}.mlp.shared_experts", s.moe_intermediate_size * s.num_shared_experts)])
        if i >= 1:
            w.linear(f"{p}.mlp.gate", s.num_experts, h, gain=1.0)
        for name, inter in mlps:
            w.linear(f"{name}.gate_proj", inter, h)
            w.linear(f"{name}.up_proj", inter, h)
            w.linear(f"{name}.down_proj", h, inter)
    w.norm("model.norm", h)
    w.linear("lm_head", vocab_size, h)
    return w.t


def _build_text_encoder(folder: Path, tok, seed: int, shards: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = len(tok)
    pad_id = tok.convert_tokens_to_ids(EOS_TOKEN)
    _write_json(folder / "config.json", _text_encoder_config(vocab_size, pad_id, pad_id))
    for name in _REMOTE_CODE:
        shutil.copyfile(REMOTE_CODE_DIR / name, folder / name)
    _save_sharded(_text_encoder_tensors(vocab_size, seed), folder, shards)


# ------------------------------------------------------------------------------- queryformer / text_projection


def _build_queryformer(folder: Path, seed: int) -> None:
    s = TINY_LLADA
    h = s.hidden_size
    _write_json(folder / "config.json", {
        "_class_name": "QueryFormer", "_diffusers_version": _DIFFUSERS_VERSION,
        "hidden_size": h, "num_queries": s.num_queries, "num_attention_heads": s.num_attention_heads,
        "intermediate_size": s.queryformer_intermediate_size, "norm_eps": s.norm_eps,
        "num_hidden_layers": s.queryformer_layers})
    w = _Tensors(seed, "queryformer")
    w.normal("meta_queries", (s.num_queries, h), 0.2)
    for i in range(s.queryformer_layers):
        b = f"query_blocks.{i}"
        w.normal(f"{b}.cross_attn.in_proj_weight", (3 * h, h), 0.7 / h ** 0.5)
        w.normal(f"{b}.cross_attn.in_proj_bias", (3 * h,), 0.02)
        w.linear(f"{b}.cross_attn.out_proj", h, h, bias=True)
        w.linear(f"{b}.mlp.fc1", s.queryformer_intermediate_size, h, bias=True)
        w.linear(f"{b}.mlp.fc2", h, s.queryformer_intermediate_size, bias=True)
    _save(w.t, folder / "diffusion_pytorch_model.safetensors")


def _build_text_projection(folder: Path, seed: int) -> None:
    s = TINY_LLADA
    h = s.hidden_size
    _write_json(folder / "config.json", {
        "_class_name": "TextProjection", "_diffusers_version": _DIFFUSERS_VERSION,
        "hidden_size": h, "intermediate_size": s.text_projection_intermediate_size,
        "num_attention_heads": s.num_attention_heads, "norm_eps": s.norm_eps,
        "num_hidden_layers": s.text_projection_layers, "projection_dim": s.projection_dim})
    w = _Tensors(seed, "text_projection")
    for i in range(s.text_projection_layers):
        p = f"layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w.linear(f"{p}.self_attn.{proj}", h, h, bias=True)
        w.linear(f"{p}.mlp.fc1", s.text_projection_intermediate_size, h, bias=True)
        w.linear(f"{p}.mlp.fc2", h, s.text_projection_intermediate_size, bias=True)
    w.linear("projector", s.projection_dim, h, bias=True)
    _save(w.t, folder / "diffusion_pytorch_model.safetensors")


# ------------------------------------------------------------------------------ never-downloaded components


def _build_transformer(folder: Path, seed: int) -> None:
    """The DiT: a valid safetensors file of 2 MiB (16 x [256, 128] f32), random; nothing reads it."""
    _write_json(folder / "config.json", {
        "_class_name": "LLaDAImageTransformer", "_diffusers_version": _DIFFUSERS_VERSION,
        "hidden_size": 128, "num_layers": 16, "in_channels": 128, "patch_size": 1,
        "cap_feat_dim": TINY_LLADA.projection_dim, "semantic_feat_dim": 64})
    w = _Tensors(seed, "transformer")
    for i in range(16):
        w.normal(f"layers.{i}.feed_forward.w1.weight", (256, 128), 0.02)
    _save(w.t, folder / "diffusion_pytorch_model.safetensors")


def _build_vae(folder: Path, seed: int) -> None:
    """The VAE: a valid safetensors file of about 1 MiB, random; nothing reads it."""
    _write_json(folder / "config.json", {
        "_class_name": "AutoencoderKL", "_diffusers_version": _DIFFUSERS_VERSION,
        "in_channels": 3, "out_channels": 3, "latent_channels": 32, "block_out_channels": [128]})
    w = _Tensors(seed, "vae")
    w.normal("encoder.conv_in.weight", (128, 3, 3, 3), 0.1)
    w.normal("encoder.down_blocks.0.resnets.0.conv1.weight", (128, 128, 3, 3), 0.03)
    w.normal("decoder.up_blocks.0.resnets.0.conv1.weight", (128, 96, 3, 3), 0.03)
    w.normal("decoder.conv_out.weight", (3, 128, 3, 3), 0.03)
    _save(w.t, folder / "diffusion_pytorch_model.safetensors")


_README = """---
library_name: diffusers
pipeline_tag: text-to-image
---

# tiny LLaDA-Image-Turbo (test replica)

A tiny random-weight replica of `inclusionAI/LLaDA-Image-Turbo`'s layout, built by
gguf_assets_tests/llada_repo.py for tests. The weights are random and mean nothing.
"""


def build_tiny_llada_repo(root: Path, *, seed: int = 0, with_sigvq: bool = True, shards: int = 2) -> Path:
    """Write the tiny LLaDA-Image-Turbo replica into ``root`` (created) and return ``root``.

    Same ``seed`` and options give byte-identical files. ``shards`` is the text encoder's safetensors file count
    (1: ``model.safetensors``; more: ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``).
    ``with_sigvq`` writes ``sigvq/`` (``build_demo_sigvq``); without it the folder is absent, though
    model_index.json still names the component as the released repo's does. The caller's global torch RNG is not
    touched.
    """
    from gguf_assets.lib.demo.demo import build_demo_sigvq

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    index = {
        "_class_name": "LLaDAImagePipeline",
        "_diffusers_version": _DIFFUSERS_VERSION,
        "text_encoder": ["transformers", "LLaDA2MoeModelLM"],
        "queryformer": ["llada_image", "QueryFormer"],
        "text_projection": ["llada_image", "TextProjection"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "sigvq": ["llada_image", "SigVQ"],
        "transformer": ["llada_image", "LLaDAImageTransformer"],
        "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    _write_json(root / "model_index.json", index)
    (root / "README.md").write_text(_README, encoding="utf-8", newline="\n")

    tok = _build_tokenizer(root / "tokenizer", seed)
    _build_text_encoder(root / "text_encoder", tok, seed, shards)
    _build_queryformer(root / "queryformer", seed)
    _build_text_projection(root / "text_projection", seed)
    if with_sigvq:
        build_demo_sigvq(root / "sigvq", seed)
    _build_transformer(root / "transformer", seed)
    _build_vae(root / "vae", seed)
    _write_json(root / "scheduler" / "scheduler_config.json", {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": _DIFFUSERS_VERSION,
        "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False})
    return root


@contextlib.contextmanager
def isolated_remote_code(cache: Path):
    """Remote code loaded in this process goes to ``cache``, not ~/.cache/huggingface/modules (transformers reads
    HF_MODULES_CACHE at import, so its module constant is re-pointed too); sys.path and the loaded
    transformers_modules are restored after, so another test's copy of the code is loaded afresh."""
    from transformers import dynamic_module_utils

    def loaded() -> dict:
        importlib.invalidate_caches()  # the import system's cached listings of the other cache's folders
        return {name: sys.modules.pop(name) for name in list(sys.modules) if name.startswith("transformers_modules")}

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_MODULES_CACHE", str(cache))
        patch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(cache))
        # Only this cache's transformers_modules on the path: Python imports the package from the first folder
        # that holds one (transformers put the default cache there when it was imported). The folder exists before
        # it goes on the path, or the import system caches "nothing here" for it.
        Path(cache).mkdir(parents=True, exist_ok=True)
        sys.path_importer_cache.pop(str(cache), None)
        patch.setattr(sys, "path", [str(cache)] + [p for p in sys.path
                                                   if not (Path(p or ".") / "transformers_modules").is_dir()])
        # A transformers_modules package loaded before (from another cache) would hide this cache's modules, and
        # this one's would hide the other's after: each side gets its own back.
        outside = loaded()
        try:
            yield
        finally:
            loaded()
            sys.modules.update(outside)
