"""The tiny LLaDA-Image-Turbo replica (gguf_assets_tests/llada_repo.py): deterministic, complete, and its remote-code
backbone loads and runs as the released LLaDA2-MoE code does (a 2-D mask turns causal; "default" RoPE must be
registered by the caller under transformers 5)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from llada_repo import EOS_TOKEN, TINY_LLADA, build_tiny_llada_repo, remote_code_files
from safetensors import safe_open


def _default_rope(config, device=None, **_):
    """transformers 4's "default" RoPE init, which transformers 5 dropped from ROPE_INIT_FUNCTIONS."""
    dim = int(config.head_dim * config.partial_rotary_factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (config.rope_theta ** exponents), 1.0


@pytest.fixture
def remote_code_env(tmp_path, monkeypatch):
    """Remote code copied into a temp HF_MODULES_CACHE (transformers reads the variable at import, so the module
    constant is re-pointed too), sys.path and sys.modules restored after; ROPE_INIT_FUNCTIONS without "default"
    inside the test, as transformers 5 ships it, and as it was after."""
    from transformers import dynamic_module_utils
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cache = tmp_path / "hf-modules"
    monkeypatch.setenv("HF_MODULES_CACHE", str(cache))
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(cache))
    monkeypatch.setattr(sys, "path", [str(cache)] + [p for p in sys.path
                                                     if not (Path(p or ".") / "transformers_modules").is_dir()])
    had_default = ROPE_INIT_FUNCTIONS.pop("default", None)  # as transformers 5 ships it, inside the test
    before = set(sys.modules)
    # A transformers_modules package another test loaded from its own cache would hide this cache's modules.
    outside = {name: sys.modules.pop(name) for name in list(sys.modules) if name.startswith("transformers_modules")}
    yield ROPE_INIT_FUNCTIONS
    # The test registers one: gone after it (a "default" left here changes the Qwen3 models of later tests).
    ROPE_INIT_FUNCTIONS.pop("default", None)
    if had_default is not None:
        ROPE_INIT_FUNCTIONS["default"] = had_default
    for name in set(sys.modules) - before:
        if name.startswith("transformers_modules"):
            del sys.modules[name]
    sys.modules.update(outside)


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_and_the_layout(tmp_path):
    first = _files(build_tiny_llada_repo(tmp_path / "a", seed=0))
    assert first == _files(build_tiny_llada_repo(tmp_path / "b", seed=0))
    assert _files(build_tiny_llada_repo(tmp_path / "c", seed=1))["queryformer/diffusion_pytorch_model.safetensors"] \
        != first["queryformer/diffusion_pytorch_model.safetensors"]

    assert "config.json" not in first
    index = json.loads(first["model_index.json"])
    assert index["text_encoder"] == ["transformers", "LLaDA2MoeModelLM"] and index["sigvq"] == ["llada_image", "SigVQ"]
    assert remote_code_files(tmp_path / "a") == ["text_encoder/configuration_tiny_llada2.py",
                                                 "text_encoder/modeling_tiny_llada2.py"]
    assert {"text_encoder/model-00001-of-00002.safetensors", "text_encoder/model-00002-of-00002.safetensors",
            "text_encoder/model.safetensors.index.json", "sigvq/model.safetensors",
            "scheduler/scheduler_config.json", "tokenizer/tokenizer.json", "README.md"} <= set(first)
    assert 1.9 * 2**20 < len(first["transformer/diffusion_pytorch_model.safetensors"]) < 2.2 * 2**20
    assert 0.9 * 2**20 < len(first["vae/diffusion_pytorch_model.safetensors"]) < 1.2 * 2**20

    shard_index = json.loads(first["text_encoder/model.safetensors.index.json"])
    assert set(shard_index["weight_map"].values()) == {"model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"}

    with safe_open(tmp_path / "a/queryformer/diffusion_pytorch_model.safetensors", "pt") as f:
        assert f.get_slice("meta_queries").get_shape() == [TINY_LLADA.num_queries, TINY_LLADA.hidden_size]
        assert f.get_slice("query_blocks.1.cross_attn.in_proj_weight").get_shape() == [96, 32]
    with safe_open(tmp_path / "a/text_projection/diffusion_pytorch_model.safetensors", "pt") as f:
        assert f.get_slice("projector.weight").get_shape() == [TINY_LLADA.projection_dim, TINY_LLADA.hidden_size]
        assert f.get_slice("layers.1.mlp.fc1.weight").get_shape() == [56, 32]

    single = build_tiny_llada_repo(tmp_path / "d", with_sigvq=False, shards=1)
    assert (single / "text_encoder/model.safetensors").is_file() and not (single / "sigvq").exists()
    assert not (single / "text_encoder/model.safetensors.index.json").exists()


def test_the_tokenizer_keeps_the_template_tokens_whole(tmp_path):
    from transformers import AutoTokenizer

    root = build_tiny_llada_repo(tmp_path / "repo", with_sigvq=False)
    tok = AutoTokenizer.from_pretrained(root / "tokenizer")
    ids = tok("<role>HUMAN</role> Generate an image: a cat\n<role>ASSISTANT</role>\n<IMAGE1>")["input_ids"]
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens[0] == "<role>" and tokens[-1] == "<IMAGE1>" and tokens.count("</role>") == 2
    assert tok.pad_token == EOS_TOKEN and tok.padding_side == "right" and tok.bos_token is None
    assert json.loads((root / "text_encoder/config.json").read_text())["vocab_size"] == len(tok)


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")  # set as the released config does
def test_the_backbone_loads_as_remote_code_and_runs(tmp_path, remote_code_env):
    from transformers import AutoModel

    root = build_tiny_llada_repo(tmp_path / "repo", with_sigvq=False)
    with pytest.raises(KeyError, match="default"):  # transformers 5 without a registered "default" RoPE
        AutoModel.from_pretrained(root / "text_encoder", trust_remote_code=True, attn_implementation="sdpa")
    remote_code_env.setdefault("default", _default_rope)

    model, info = AutoModel.from_pretrained(root / "text_encoder", trust_remote_code=True,
                                            attn_implementation="sdpa", output_loading_info=True)
    assert type(model).__name__ == "TinyLLaDA2ModelLM" and not info["missing_keys"] and not info["unexpected_keys"]
    assert isinstance(model.get_input_embeddings(), torch.nn.Embedding)
    mod = model.model.rotary_emb
    expected, _ = _default_rope(mod.config)
    uninitialised = not torch.equal(mod.inv_freq, expected)
    print(f"inv_freq after from_pretrained: {mod.inv_freq.tolist()} (expected {expected.tolist()}): "
          f"{'UNINITIALISED' if uninitialised else 'initialised'}")  # transformers 5.25: uninitialised
    if uninitialised:  # the remote-code-on-meta issue: recompute it as a teacher must
        mod.inv_freq = mod.rope_init_fn(mod.config, None)[0]
        mod.original_inv_freq = mod.inv_freq
    assert torch.equal(mod.inv_freq, expected)

    gen = torch.Generator().manual_seed(0)
    b, length = 2, 7
    embeds = model.get_input_embeddings()(torch.randint(0, model.config.vocab_size, (b, length), generator=gen))
    positions = torch.arange(length).unsqueeze(0).expand(b, -1)
    changed = embeds.clone()
    changed[:, 3:] += 0.5 * torch.randn(changed[:, 3:].shape, generator=gen)  # the tokens after the third
    zeros_4d = torch.zeros(b, 1, length, length)  # additive: every query sees every key
    padding_2d = torch.ones(b, length, dtype=torch.long)
    with torch.no_grad():
        def run(x, mask=None):
            return model.model(inputs_embeds=x, attention_mask=mask, position_ids=positions).last_hidden_state

        full, unmasked, causal = run(embeds, zeros_4d), run(embeds), run(embeds, padding_2d)
        full_changed, causal_changed = run(changed, zeros_4d), run(changed, padding_2d)
        first_alone = model.model(inputs_embeds=embeds[:, :1], position_ids=positions[:, :1]).last_hidden_state
    assert full.shape == (b, length, TINY_LLADA.hidden_size) and torch.isfinite(full).all()
    assert full.std() > 0.1  # not degenerate
    assert torch.allclose(full, unmasked, atol=1e-6)
    # Bidirectional under the 4-D mask: every position depends on the later tokens.
    assert not torch.allclose(full_changed[:, :3], full[:, :3], atol=1e-3)
    # A 2-D (padding) mask is made causal: the first positions ignore the later tokens, the first sees only itself.
    assert torch.allclose(causal_changed[:, :3], causal[:, :3], atol=1e-5)
    assert torch.allclose(causal[:, :1], first_alone, atol=1e-5)
    assert not torch.allclose(causal, full, atol=1e-3)
