"""The student → ggk's `--llm` GGUF, on tiny random Qwen3 models built locally with transformers.

The strong check: a numpy forward of ggk's student math (model/te/llm.hpp, arch QWEN3: head dim 128, RMSNorm eps
1e-6, NEOX rope theta 1e6, qk-norm, GQA, causal, SiLU MLP, final norm; sizes from the tensor shapes only) on the
exported file's tensors reproduces transformers' last_hidden_state.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.ggk_contract import GGK_VERSION
from gguf_assets.lib.output import gguf_format
from gguf_assets.lib.output.student_gguf import (
    StudentExportError,
    student_contract_problem,
    student_gguf_path,
    write_student_gguf,
)

TINY = dict(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=128, intermediate_size=96, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
LAYER_LEAVES = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj")
SEQUENCES = ([5], [1, 2, 3, 4, 5, 6, 7], [299, 0, 17, 17, 250, 3, 98, 150, 42, 7, 7, 7, 1, 299, 60, 61, 62, 2, 9, 11])


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3ForCausalLM]:
    """A tiny random Qwen3ForCausalLM, its norms moved away from 1 (so a swapped or skipped norm shows)."""
    folder = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY, initializer_range=0.1, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def exported(student, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder, _ = student
    out = tmp_path_factory.mktemp("gguf") / "tiny-student.gguf"
    return out, write_student_gguf(folder, out, name="tiny-student", source="org/tiny-qwen3", commit="abc123")


def _copy(student, tmp_path: Path) -> Path:
    folder = tmp_path / "student"
    shutil.copytree(student[0], folder)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


# ---------------------------------------------------------------------- ggk's student forward, in numpy (float64)


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope_neox(x, theta):
    """x: [L, H, d]; positions 0..L-1; NEOX pairs (i, i + d/2), all d dims rotated."""
    L, _, d = x.shape
    ang = np.arange(L)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def ggk_student(ids, t: dict[str, np.ndarray], *, theta=1e6, head=128, final_norm=True) -> np.ndarray:
    """Final-norm states [L, hidden]: sizes from shapes only (heads = q_proj rows / 128, layers = highest N + 1)."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    x = t["model.embed_tokens.weight"][np.asarray(ids)]
    L = len(ids)
    causal = np.triu(np.full((L, L), -np.inf), 1)
    for i in range(1 + max(int(k.split(".")[2]) for k in t if k.startswith("model.layers."))):
        p = f"model.layers.{i}."
        h = _rms(x, t[p + "input_layernorm.weight"])
        q, k, v = (h @ t[f"{p}self_attn.{n}_proj.weight"].T for n in "qkv")
        nh, nkv = q.shape[1] // head, k.shape[1] // head
        q = _rope_neox(_rms(q.reshape(L, nh, head), t[p + "self_attn.q_norm.weight"]), theta)
        k = _rope_neox(_rms(k.reshape(L, nkv, head), t[p + "self_attn.k_norm.weight"]), theta)
        k, v = np.repeat(k, nh // nkv, 1), np.repeat(v.reshape(L, nkv, head), nh // nkv, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(head) + causal
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", a, v).reshape(L, nh * head) @ t[p + "self_attn.o_proj.weight"].T
        h = _rms(x, t[p + "post_attention_layernorm.weight"])
        g, u = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ t[p + "mlp.down_proj.weight"].T
    return _rms(x, t["model.norm.weight"]) if final_norm else x


def _float64(model: Qwen3ForCausalLM, *, f16_weights: bool) -> Qwen3ForCausalLM:
    """A float64 copy of the model; with ``f16_weights`` its matrices rounded to f16, as the GGUF stores them."""
    ref = copy.deepcopy(model).double()
    if f16_weights:
        with torch.no_grad():
            for p in ref.parameters():
                if p.ndim >= 2:
                    p.copy_(p.half().double())
    return ref


def _states(model: Qwen3ForCausalLM, ids) -> np.ndarray:
    """transformers' last_hidden_state (after the final norm) for one sequence."""
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].numpy()


# ------------------------------------------------------------------------------------------------------- tests


def test_layout_names_shapes_dtypes_and_metadata(exported) -> None:
    out, summary = exported
    reader = GGUFReader(out)
    expected = {"model.embed_tokens.weight": (300, 48), "model.norm.weight": (48,)}
    shapes = {"input_layernorm": (48,), "self_attn.q_proj": (256, 48), "self_attn.k_proj": (128, 48),
              "self_attn.v_proj": (128, 48), "self_attn.o_proj": (48, 256), "self_attn.q_norm": (128,),
              "self_attn.k_norm": (128,), "post_attention_layernorm": (48,), "mlp.gate_proj": (96, 48),
              "mlp.up_proj": (96, 48), "mlp.down_proj": (48, 96)}
    for i in range(2):
        expected.update({f"model.layers.{i}.{leaf}.weight": shapes[leaf] for leaf in LAYER_LEAVES})
    got = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # ne order → numpy order
    assert got == expected  # no lm_head.weight
    for t in reader.tensors:
        want = GGMLQuantizationType.F16 if len(expected[t.name]) == 2 else GGMLQuantizationType.F32
        assert t.tensor_type == want, t.name
    meta = gguf_format.read_gguf_metadata(out)
    assert next(iter(k for k in reader.fields if not k.startswith("GGUF."))) == "general.architecture"
    assert meta["general.architecture"] == "qwen3"
    assert meta["general.name"] == "tiny-student"
    assert meta["gguf_assets.student.source"] == "org/tiny-qwen3"
    assert meta["gguf_assets.student.commit"] == "abc123"
    assert meta["gguf_assets.student.ggk_version"] == GGK_VERSION
    assert summary == {"path": str(out), "bytes": out.stat().st_size,
                       "sha256": hashlib.sha256(out.read_bytes()).hexdigest(), "tensors": 24, "f16": 15, "f32": 9,
                       "kept_f32": [], "skipped": ["lm_head.weight"]}


def test_weights_are_the_models_rounded_to_f16(student, exported) -> None:
    _, model = student
    tensors = gguf_format.read_gguf_tensors(exported[0])
    state = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(tensors) == set(state)
    for name, want in state.items():
        got = tensors[name]
        if want.ndim == 2:
            np.testing.assert_array_equal(got, want.astype(np.float16), err_msg=name)
        else:
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_ggk_forward_on_the_gguf_reproduces_transformers(student, exported) -> None:
    _, model = student
    tensors = gguf_format.read_gguf_tensors(exported[0])
    rounded, original = _float64(model, f16_weights=True), _float64(model, f16_weights=False)
    for ids in SEQUENCES:
        ggk = ggk_student(ids, tensors)
        same_weights = _states(rounded, ids)
        scale = np.abs(same_weights).max()
        assert scale > 0.1
        # Same (f16-rounded) weights: only rounding between the two (transformers' Qwen3RMSNorm computes in float32
        # even in a float64 model: about 3e-7 of the scale here).
        np.testing.assert_allclose(ggk, same_weights, rtol=0, atol=2e-6 * scale)
        # Against the f32 model: the f16 rounding of the matrices (about 7e-4 of the scale here), and nothing more.
        np.testing.assert_allclose(ggk, _states(original, ids), rtol=0,
                                   atol=3e-3 * scale)


def test_the_forward_check_tells_a_differently_built_student(student, exported) -> None:
    """Each fixed constant ggk would get wrong shows far beyond the tolerance above (the check can fail)."""
    _, model = student
    tensors = gguf_format.read_gguf_tensors(exported[0])
    ids = SEQUENCES[2]
    want = _states(_float64(model, f16_weights=True), ids)
    scale = np.abs(want).max()
    for wrong in (ggk_student(ids, tensors, theta=1e4), ggk_student(ids, tensors, final_norm=False)):
        assert np.abs(wrong - want).max() > 1e-2 * scale


def test_bare_qwen3model_weights_get_the_model_prefix(student, exported, tmp_path: Path) -> None:
    folder = _copy(student, tmp_path)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_file({k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"},
              folder / "model.safetensors")
    _edit_config(folder, architectures=["Qwen3Model"])
    summary = write_student_gguf(folder, tmp_path / "bare.gguf", name="bare", source="org/bare", commit="c0ffee")
    assert summary["skipped"] == []
    ours, theirs = gguf_format.read_gguf_tensors(tmp_path / "bare.gguf"), gguf_format.read_gguf_tensors(exported[0])
    assert list(ours) == list(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_a_bf16_checkpoint_is_widened_exactly(student, tmp_path: Path) -> None:
    """Hub Qwen3 checkpoints are bf16: norms stay exact in f32, matrices are the bf16 values rounded to f16."""
    folder = _copy(student, tmp_path)
    bf16 = {k: v.to(torch.bfloat16).contiguous() for k, v in student[1].state_dict().items()}
    save_torch(bf16, folder / "model.safetensors")
    summary = write_student_gguf(folder, tmp_path / "bf16.gguf", name="bf16", source="org/bf16", commit="beef")
    assert (summary["f16"], summary["f32"]) == (15, 9)
    tensors = gguf_format.read_gguf_tensors(tmp_path / "bf16.gguf")
    for name, value in bf16.items():
        if name == "lm_head.weight":
            continue
        widened = value.float().numpy()
        np.testing.assert_array_equal(tensors[name], widened.astype(np.float16) if widened.ndim == 2 else widened,
                                      err_msg=name)


def test_the_tiny_student_and_an_older_config_meet_the_contract(student, tmp_path: Path) -> None:
    assert student_contract_problem(student[0]) is None
    folder = _copy(student, tmp_path)  # transformers 4 wrote rope_theta at the top level, no layer_types
    _edit_config(folder, rope_parameters=None, layer_types=None, rope_theta=1000000.0, rope_scaling=None)
    assert student_contract_problem(folder) is None


def _drop_norm(folder: Path) -> None:
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors")


REFUSALS = {
    "head_dim": (lambda f: _edit_config(f, head_dim=64), ["head_dim = 64", "128"]),
    "rms_norm_eps": (lambda f: _edit_config(f, rms_norm_eps=1e-5), ["rms_norm_eps = 1e-05", "1e-06"]),
    "rope_theta": (lambda f: _edit_config(f, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                   ["rope_parameters.rope_theta = 10000.0", "1000000"]),
    "legacy_rope_theta": (lambda f: _edit_config(f, rope_parameters=None, rope_theta=10000.0),
                          ["rope_theta = 10000.0", "1000000"]),
    "no_rope_theta": (lambda f: _edit_config(f, rope_parameters=None), ["no rope_theta", "10000", "1000000"]),
    "rope_type": (lambda f: _edit_config(f, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
                  ['rope_parameters.rope_type = "yarn"']),
    "rope_scaling": (lambda f: _edit_config(f, rope_scaling={"type": "linear", "factor": 2.0}),
                     ['rope_scaling.rope_type = "linear"']),
    "architectures": (lambda f: _edit_config(f, architectures=["LlamaForCausalLM"]),
                      ['architectures = ["LlamaForCausalLM"]', "Qwen3ForCausalLM"]),
    "attention_bias": (lambda f: _edit_config(f, attention_bias=True), ["attention_bias = true"]),
    "hidden_act": (lambda f: _edit_config(f, hidden_act="gelu"), ['hidden_act = "gelu"', "SiLU"]),
    "sliding": (lambda f: _edit_config(f, layer_types=["full_attention", "sliding_attention"]),
                ['layer_types = "sliding_attention" for layer 1']),
    "28_layers": (lambda f: _edit_config(f, num_hidden_layers=28), ["num_attention_heads = 2", "16 heads"]),
    "vocab_size": (lambda f: _edit_config(f, vocab_size=400), ["vocab_size = 400", "300 rows", "row 0"]),
    "final_norm": (_drop_norm, ["model.norm.weight", "skips the final norm"]),
    "extra_layer": (lambda f: _edit_config(f, num_hidden_layers=1, layer_types=["full_attention"]),
                    ["num_hidden_layers = 1", "layers up to 1"]),
    "shape": (lambda f: _edit_config(f, intermediate_size=64), ["mlp.gate_proj.weight", "[96, 48]", "[64, 48]"]),
}


@pytest.mark.parametrize("rule", sorted(REFUSALS))
def test_a_student_ggk_would_run_differently_is_refused(rule: str, student, tmp_path: Path) -> None:
    folder = _copy(student, tmp_path)
    change, words = REFUSALS[rule]
    change(folder)
    problem = student_contract_problem(folder)
    assert problem is not None
    for word in words:
        assert word in problem, (word, problem)
    assert ". " not in problem and f"ggk {GGK_VERSION}" in problem  # one sentence, naming the engine
    out = tmp_path / "refused.gguf"
    with pytest.raises(StudentExportError) as caught:
        write_student_gguf(folder, out, name="x", source="org/x", commit="abc")
    assert str(caught.value) == problem and isinstance(caught.value, UserError)
    assert not out.exists() and list(tmp_path.glob("*.gguf*")) == []


def test_student_gguf_path(tmp_path: Path) -> None:
    assert student_gguf_path(tmp_path, "cat-adapter") == tmp_path / "cat-adapter-student.gguf"
