"""The LLaDA-Image teacher (lib/precompute/llada_teacher.py) against two independent computations, on a tiny pipeline
built from the real published files (gguf_assets_tests/real_llada.py, its backbone the published code, run as the
repo's remote code):

- a straightforward one-prompt reference, written here from the facts (DESIGN.md §10) with plain tensor math: no
  padding, no masks beyond the text→query block, positions 0..n-1;
- the peer app's own QueryFormer and text projection (PyPI gguf-trainer, installed by scripts/setup.sh with no
  dependencies), run one prompt at a time.

The product's batched path must agree with both at max abs 1e-5 (f32); the peer's batched path, whose projection
attends to the padding, must not.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from llada_repo import TINY_LLADA, isolated_remote_code
from real_llada import build_real_llada_repo
from safetensors.torch import load_file, save_file

from gguf_assets.lib.precompute import llada_teacher as lt
from gguf_assets.lib.precompute.teacher import TeacherError
from gguf_assets.lib.project.settings import Settings

# Lengths differ, so a batch pads: the empty prompt (its own template), blanks (stripped to empty), spaces around.
PROMPTS = ["a cat", "", "   ", "  a red fox leaping over a sleeping dog at dawn, oil on canvas, warm light  ",
           "two words", "a lighthouse in a storm"]
CPU = torch.device("cpu")
ORACLE = Path(sys.prefix) / "oracle"  # the peer app, gguf-trainer 0.0.14 (scripts/setup.sh)


def _settings(repo, **precompute) -> Settings:
    return Settings.model_validate({"materials": {"teacher": str(repo), "trust_remote_code": True},
                                    "precompute": {"teacher_batch": 8, **precompute}})


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build_real_llada_repo(tmp_path_factory.mktemp("llada") / "LLaDA-Image-Turbo", with_sigvq=False)


@pytest.fixture(scope="module", autouse=True)
def remote_code_cache(tmp_path_factory):
    with isolated_remote_code(tmp_path_factory.mktemp("hf-modules")):
        yield


@pytest.fixture(scope="module")
def teacher(repo):
    return lt.LLaDAImageTeacher(repo, _settings(repo), CPU)


def _text(prompt: str) -> str:
    """The pipeline's template, spelled out here (DESIGN.md §10), not read from the product."""
    prompt = prompt.strip()
    if not prompt:
        return "<role>HUMAN</role> Generate an image.\n<role>ASSISTANT</role>\n<IMAGE1>"
    return "<role>HUMAN</role> Generate an image: " + prompt + "\n<role>ASSISTANT</role>\n<IMAGE1>"


def _attention(q, k, v, heads):
    """Softmax attention written out: [L, H*D] each → [Lq, H*D]."""
    split = lambda x: x.view(x.shape[0], heads, -1).transpose(0, 1)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), -1)
    return (weights @ v).transpose(0, 1).reshape(q.shape[1], -1)


def _config(repo, part):
    return json.loads((repo / part / "config.json").read_text())


def _reference_queries(repo, embeddings):
    """The QueryFormer for one unpadded prompt: [L, D] → [Q, D]."""
    cfg, w = _config(repo, "queryformer"), load_file(str(repo / "queryformer" / lt.PARTS_WEIGHTS))
    d, eps = cfg["hidden_size"], cfg["norm_eps"]
    ln = lambda x: F.layer_norm(x, (d,), eps=eps)  # noqa: E731
    lin = lambda x, name: x @ w[name + ".weight"].T + w[name + ".bias"]  # noqa: E731
    text, q = ln(embeddings), w["meta_queries"]
    for i in range(cfg["num_hidden_layers"]):
        b = f"query_blocks.{i}."
        q = ln(q)
        wi, bi = w[b + "cross_attn.in_proj_weight"], w[b + "cross_attn.in_proj_bias"]
        qq, kk, vv = q @ wi[:d].T + bi[:d], text @ wi[d:2 * d].T + bi[d:2 * d], text @ wi[2 * d:].T + bi[2 * d:]
        q = ln(q + lin(_attention(qq, kk, vv, cfg["num_attention_heads"]), b + "cross_attn.out_proj"))
        q = q + lin(F.gelu(lin(q, b + "mlp.fc1"), approximate="tanh"), b + "mlp.fc2")
    return q


def _reference_projection(repo, states):
    """The text projection over one prompt's own rows, unmasked: [L, D] → [L, P]."""
    cfg, w = _config(repo, "text_projection"), load_file(str(repo / "text_projection" / lt.PARTS_WEIGHTS))
    eps, heads = cfg["norm_eps"], cfg["num_attention_heads"]
    lin = lambda x, name: x @ w[name + ".weight"].T + w[name + ".bias"]  # noqa: E731

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rms_heads(x):
        return rms(x.view(x.shape[0], heads, -1)).reshape(x.shape)

    x = states
    for i in range(cfg["num_hidden_layers"]):
        b = f"layers.{i}."
        h = rms(x)
        q, k, v = rms_heads(lin(h, b + "self_attn.q_proj")), rms_heads(lin(h, b + "self_attn.k_proj")), \
            lin(h, b + "self_attn.v_proj")
        x = x + lin(_attention(q, k, v, heads), b + "self_attn.out_proj")
        x = x + lin(F.gelu(lin(rms(x), b + "mlp.fc1"), approximate="tanh"), b + "mlp.fc2")
    return lin(x, "projector")


def _one_prompt(teacher, prompt, queries_of, project):
    """One prompt alone through the backbone: [text; queries], the text blocked from the queries, nothing else."""
    ids = torch.tensor(teacher.tokenizer(_text(prompt), add_special_tokens=True)["input_ids"])
    embeddings = teacher.model.get_input_embeddings()(ids)
    queries = queries_of(embeddings)
    n, total = len(ids), len(ids) + queries.shape[0]
    mask = torch.zeros(1, 1, total, total)
    mask[..., :n, n:] = torch.finfo(torch.float32).min
    states = teacher.model.base_model(inputs_embeds=torch.cat([embeddings, queries])[None], attention_mask=mask,
                                      position_ids=torch.arange(total)[None]).last_hidden_state[0]
    return project(states)[n:]


@torch.inference_mode()
def test_batched_targets_match_a_one_prompt_reference_and_the_peer_apps_parts(repo, teacher):
    batched = teacher.encode(PROMPTS).targets
    assert batched.shape == (len(PROMPTS), TINY_LLADA.num_queries, TINY_LLADA.projection_dim)
    reference = torch.stack([_one_prompt(teacher, p, lambda e: _reference_queries(repo, e),
                                         lambda s: _reference_projection(repo, s)) for p in PROMPTS])
    assert (batched - reference).abs().max() <= 1e-5
    # The blank prompts are the empty prompt: its own template, not "Generate an image: ".
    assert torch.allclose(batched[1], batched[2], atol=1e-6)  # the fused experts sum in batch order

    import sys

    sys.path.insert(0, str(ORACLE))  # scripts/setup.sh installs the peer app there, apart from the project's scripts
    try:
        from gguf_trainer.llada_teacher import QueryFormer, TextProjection, load_diffusers_module
    finally:
        sys.path.remove(str(ORACLE))

    peer_qf = load_diffusers_module(QueryFormer, repo / "queryformer", CPU, torch.float32)
    peer_proj = load_diffusers_module(TextProjection, repo / "text_projection", CPU, torch.float32)
    oracle = torch.stack([_one_prompt(teacher, p, lambda e: peer_qf(e[None], torch.ones(1, e.shape[0]))[0],
                                      lambda s: peer_proj(s[None])[0]) for p in PROMPTS])
    assert (batched - oracle).abs().max() <= 1e-5

    # The peer's batched path runs its projection over the padded batch: the padding leaks into the query rows.
    rows = [teacher.tokenizer(_text(p))["input_ids"] for p in PROMPTS]
    longest = max(map(len, rows))
    ids = torch.tensor([r + [teacher.tokenizer.pad_token_id] * (longest - len(r)) for r in rows])
    keep_text = torch.tensor([[i < len(r) for i in range(longest)] for r in rows])
    embeddings = teacher.model.get_input_embeddings()(ids)
    keep = torch.cat([keep_text, torch.ones(len(rows), TINY_LLADA.num_queries, dtype=torch.bool)], 1)
    states = teacher.model.base_model(
        inputs_embeds=torch.cat([embeddings, peer_qf(embeddings, keep_text)], 1),
        attention_mask=lt.backbone_mask(keep, longest, torch.float32),
        position_ids=(keep.long().cumsum(1) - 1).clamp_min(0)).last_hidden_state
    peer_batched = peer_proj(states)[:, longest:]
    relative = (peer_batched - reference).norm() / reference.norm()
    assert relative > 1e-3, "the padded batch no longer shows the leak this test guards against"


def test_a_rotary_table_left_uninitialised_is_recomputed_and_one_that_cannot_be_is_refused(repo, teacher):
    def garbage_tables(encoder, **kwargs):
        model = lt._load_backbone(encoder, **kwargs)
        for _, module in lt.rotary_modules(model):
            module.inv_freq = torch.full_like(module.inv_freq, 1e27)
        return model

    repaired = lt.LLaDAImageTeacher(repo, _settings(repo), CPU, load_backbone=garbage_tables)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # Registered only while the backbone is built: transformers 5's own Qwen3 (the student) would take it.
    assert "default" not in ROPE_INIT_FUNCTIONS
    assert repaired.repaired == [name for name, _ in lt.rotary_modules(repaired.model)] != []
    assert torch.equal(repaired.encode(PROMPTS[:3]).targets, teacher.encode(PROMPTS[:3]).targets)

    class Rotary(torch.nn.Module):  # a table with no rope function to recompute it from
        def __init__(self, table):
            super().__init__()
            self.register_buffer("inv_freq", table, persistent=False)

    plain = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    assert lt.repair_rotary_tables(torch.nn.Sequential(Rotary(plain))) == []
    with pytest.raises(TeacherError, match=r"0\.inv_freq.*not used"):
        lt.repair_rotary_tables(torch.nn.Sequential(Rotary(torch.full((4,), float("nan")))))


def test_parts_load_strictly_naming_the_tensor_and_the_file(repo, tmp_path):
    import shutil

    broken = tmp_path / "pipeline"
    shutil.copytree(repo / "queryformer", broken / "queryformer")
    weights = broken / "queryformer" / lt.PARTS_WEIGHTS
    tensors = load_file(str(weights))
    tensors["query_blocks.0.extra.weight"] = tensors.pop("query_blocks.1.mlp.fc2.bias")
    save_file(tensors, str(weights))
    with pytest.raises(TeacherError) as info:
        lt.load_part(lt.QueryFormer, broken / "queryformer", device=CPU, dtype=torch.float32)
    message = str(info.value)
    assert str(weights) in message and "missing tensors: query_blocks.1.mlp.fc2.bias" in message
    assert "unexpected tensors: query_blocks.0.extra.weight" in message
