"""GGUF export and the torch-free evaluator: round trip, dtype rules, atomicity, numpy vs torch."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

from gguf_assets.lib.core import atomic, safetensors_io
from gguf_assets.lib.core.f16 import F16_MAX
from gguf_assets.lib.output import gguf_eval, gguf_format
from gguf_assets.lib.training.adapter import (
    LAYER_FUSIONS,
    MLP_RATIO,
    NORM_EPS,
    Adapter,
    AdapterShape,
    centred_cosine_rows,
)

SHAPE = AdapterShape(student_dim=12, query_rows=8, target_dim=10, width=16, depth=2, heads=4)
PROVENANCE = {
    "student.repo": "org/student", "student.commit": "abc123", "student.layer": -2, "student.hidden_size": 12,
    "teacher.repo": "org/teacher", "teacher.commit": "def456", "teacher.layer": 30,
    "prompt_template": "<|user|>{prompt}", "training.steps": 1234, "training.seed": 7,
    "training.val_centred_cosine": 0.8734567891234, "training.fingerprint": "0123456789abcdef",
}


def make_adapter(seed: int = 0, shape: AdapterShape = SHAPE) -> Adapter:
    torch.manual_seed(seed)
    adapter = Adapter(shape).eval()
    with torch.no_grad():
        # Scales well above the init so attention is far from uniform and every tensor matters.
        for name, p in adapter.named_parameters():
            offset = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 2 else 0.1) + offset)
        adapter.target_mean.copy_(torch.randn(SHAPE.query_rows, SHAPE.target_dim) * 2.0)
        adapter.target_std.copy_(torch.rand(SHAPE.query_rows, SHAPE.target_dim) + 0.5)
    return adapter


def hparams(shape: AdapterShape = SHAPE) -> dict:
    return {**shape.to_dict(), "layer_norm_epsilon": NORM_EPS, "mlp_ratio": MLP_RATIO}


def numpy_state(adapter: Adapter) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in adapter.state_dict().items()}


def f16_rounded(adapter: Adapter) -> Adapter:
    """The adapter with exactly the weights the GGUF holds (matrices through f16)."""
    clone = Adapter(adapter.shape).eval()
    state = {k: (v.half().float() if gguf_format.is_f16_tensor(k) else v.clone())
             for k, v in adapter.state_dict().items()}
    clone.load_state_dict(state)
    return clone


def write(path: Path, adapter: Adapter, **overrides) -> gguf_format.WrittenGguf:
    kwargs = {"tensors": numpy_state(adapter), "hparams": hparams(), "provenance": PROVENANCE, "name": "test-adapter"}
    kwargs.update(overrides)
    return gguf_format.write_adapter_gguf(path, **kwargs)


def torch_predict(adapter: Adapter, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Standardized [B, Q, D] for prompts of varying length (padded + masked)."""
    longest = max(1, max(p.shape[0] for p in prompts))
    states = torch.zeros(len(prompts), longest, adapter.shape.student_dim * adapter.shape.student_layers)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for i, p in enumerate(prompts):
        states[i, :p.shape[0]] = p
        mask[i, :p.shape[0]] = True
    with torch.no_grad():
        return adapter(states, mask)


# --- names and layout -----------------------------------------------------------------


def test_tensor_names_cover_the_adapter_and_invert() -> None:
    state = Adapter(SHAPE).state_dict()
    expected = gguf_format.expected_tensor_shapes(hparams())
    assert set(expected) == set(state)
    assert all(tuple(state[k].shape) == shape for k, shape in expected.items())
    assert gguf_format.tensor_name("blocks.3.cross_attn.q.weight") == "blk.3.cross_attn.q.weight"
    assert gguf_format.tensor_name("target_mean") == "target.mean"
    assert gguf_format.tensor_name("target_std") == "target.std"
    names = [gguf_format.tensor_name(k) for k in state]
    assert len(set(names)) == len(names)
    assert all(len(n) <= gguf_format.MAX_TENSOR_NAME for n in names)
    assert all(gguf_format.state_dict_key(gguf_format.tensor_name(k)) == k for k in state)
    with pytest.raises(ValueError, match="unknown"):
        gguf_format.tensor_name("blocks.0.new_thing.weight")
    with pytest.raises(ValueError, match="unknown"):
        gguf_format.state_dict_key("blk.x.cross_attn.q.weight")


def test_roundtrip_keys_and_tensors(tmp_path: Path) -> None:
    adapter = make_adapter()
    out = tmp_path / "adapter.gguf"
    summary = write(out, adapter)
    state = numpy_state(adapter)
    assert summary.path == str(out)
    assert summary.bytes == out.stat().st_size
    assert summary.sha256 == atomic.sha256_file(out)
    assert summary.tensor_count == len(state) == 12 + 26 * SHAPE.depth  # as docs/gguf_layout.md says
    assert summary.kept_f32 == ()
    n_f16 = sum(gguf_format.is_f16_tensor(k) for k in state)
    assert (summary.f16_count, summary.f32_count) == (n_f16, len(state) - n_f16)
    assert n_f16 == 2 + 2 + 10 * SHAPE.depth  # query, null_memory, in/out_proj, 10 matrices per block

    meta = gguf_format.read_gguf_metadata(out)
    assert meta["general.architecture"] == "llm_adapter"
    assert meta["general.name"] == "test-adapter"
    assert meta["llm_adapter.format_version"] == gguf_format.FORMAT_VERSION
    assert gguf_format.hparams_from_metadata(meta) == pytest.approx(hparams())
    assert np.float32(meta["llm_adapter.layer_norm_epsilon"]) == np.float32(NORM_EPS)
    assert gguf_format.provenance_from_metadata(meta) == PROVENANCE  # ints and float64 exact
    assert set(meta) == {"general.architecture", "general.name", "llm_adapter.format_version"} \
        | {f"llm_adapter.{k}" for k in [*gguf_format.HPARAM_TYPES, *PROVENANCE]}

    reader = GGUFReader(out)
    by_name = {t.name: t for t in reader.tensors}
    assert set(by_name) == {gguf_format.tensor_name(k) for k in state}
    for key, value in state.items():
        t = by_name[gguf_format.tensor_name(key)]
        assert [int(x) for x in t.shape] == list(reversed(value.shape))  # ne order
        if gguf_format.is_f16_tensor(key):
            assert t.tensor_type == GGMLQuantizationType.F16 and value.ndim == 2
            np.testing.assert_array_equal(np.asarray(t.data), value.astype(np.float16))
        else:
            assert t.tensor_type == GGMLQuantizationType.F32
            np.testing.assert_array_equal(np.asarray(t.data), value)
    # linear weight [out, in] → ne [in, out], as ggml_mul_mat wants
    assert [int(x) for x in by_name["blk.0.mlp_up.weight"].shape] == [SHAPE.width, MLP_RATIO * SHAPE.width]
    assert [int(x) for x in by_name["target.mean"].shape] == [SHAPE.target_dim, SHAPE.query_rows]


def test_numpy_forward_matches_torch(tmp_path: Path) -> None:
    adapter = make_adapter(1)
    out = tmp_path / "adapter.gguf"
    write(out, adapter)
    loaded = gguf_eval.load_adapter_gguf(out)
    reference = f16_rounded(adapter)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randn(n, SHAPE.student_dim, generator=gen) * 2 for n in (5, 0, 1, 9)]
    expected = reference.to_target_space(torch_predict(reference, prompts)).numpy()
    for i, p in enumerate(prompts):
        got = loaded.forward(p.numpy())
        assert got.shape == (SHAPE.query_rows, SHAPE.target_dim) and got.dtype == np.float32
        assert np.abs(got - expected[i]).max() < 1e-4, f"prompt {i} (L={p.shape[0]})"
    # and the f16 rounding is real: the unrounded torch adapter differs measurably
    unrounded = adapter.to_target_space(torch_predict(adapter, prompts)).numpy()
    assert np.abs(unrounded - expected).max() > 1e-6


@pytest.mark.parametrize("fusion", ["concat", "mix"])
def test_several_student_layers_are_format_version_2_and_numpy_fuses_them_as_torch(tmp_path: Path,
                                                                                    fusion: str) -> None:
    shape = AdapterShape(**{**SHAPE.to_dict(), "student_layers": 3, "layer_fusion": fusion})
    adapter = make_adapter(4, shape)
    if fusion == "mix":
        with torch.no_grad():
            adapter.layer_mix.copy_(torch.tensor([1.5, -0.5, 0.25]))  # far from the equal mix it starts as
    out = tmp_path / "adapter.gguf"
    provenance = {**{k: v for k, v in PROVENANCE.items() if k != "student.layer"}, "student.layers": [9, 18, -1]}
    summary = write(out, adapter, hparams=hparams(shape), provenance=provenance)
    assert summary.format_version == gguf_format.LAYERS_FORMAT_VERSION == 2

    meta = gguf_format.read_gguf_metadata(out)
    assert meta["llm_adapter.format_version"] == 2
    assert meta["llm_adapter.student_layers"] == 3 and meta["llm_adapter.layer_fusion"] == fusion
    assert meta["llm_adapter.student_dim"] == SHAPE.student_dim  # one layer's width
    assert gguf_format.provenance_from_metadata(meta)["student.layers"] == [9, 18, -1]
    tensors = gguf_format.read_gguf_tensors(out)
    fused = SHAPE.student_dim * (3 if fusion == "concat" else 1)
    assert tensors["in_norm.weight"].shape == (fused,) and tensors["in_proj.weight"].shape == (SHAPE.width, fused)
    assert ("layer_mix" in tensors) == (fusion == "mix")
    if fusion == "mix":
        assert tensors["layer_mix"].dtype == np.float32 and tensors["layer_mix"].shape == (3,)

    loaded = gguf_eval.load_adapter_gguf(out)
    reference = f16_rounded(adapter)
    gen = torch.Generator().manual_seed(5)
    # The layers at very different scales, as a real student's are: each is normalised on its own.
    scales = torch.tensor([0.5] * SHAPE.student_dim + [4.0] * SHAPE.student_dim + [40.0] * SHAPE.student_dim)
    prompts = [torch.randn(n, 3 * SHAPE.student_dim, generator=gen) * scales for n in (5, 0, 1, 9)]
    expected = reference.to_target_space(torch_predict(reference, prompts)).numpy()
    for i, p in enumerate(prompts):
        assert np.abs(loaded.forward(p.numpy()) - expected[i]).max() < 1e-4, f"prompt {i} (L={p.shape[0]})"
    with pytest.raises(ValueError, match=r"states must be \[L, 36\]"):
        loaded.forward(np.zeros((2, SHAPE.student_dim), np.float32))  # one layer's states for a 3-layer adapter

    # Version 2 names the list: the one-layer integer key alone is refused, as is a list of the wrong length.
    with pytest.raises(ValueError, match="student.layers"):
        write(tmp_path / "x.gguf", adapter, hparams=hparams(shape), provenance=PROVENANCE)
    with pytest.raises(ValueError, match="must list 3 layer"):
        write(tmp_path / "x.gguf", adapter, hparams=hparams(shape), provenance={**provenance, "student.layers": [1, 2]})


def test_one_student_layer_is_format_version_1_whatever_the_fusion_setting() -> None:
    """A one-layer adapter is the layout every version 1 runtime reads: no layer keys, no layer_mix."""
    one = AdapterShape(**SHAPE.to_dict())
    assert one.to_dict() == SHAPE.to_dict() and "student_layers" not in one.to_dict()
    assert gguf_format.file_version(gguf_format.validate_hparams(hparams())) == gguf_format.FORMAT_VERSION == 1
    assert "layer_mix" not in Adapter(one).state_dict()
    with pytest.raises(ValueError, match="layer_fusion"):
        gguf_format.validate_hparams({**hparams(), "layer_fusion": "mix"})
    assert LAYER_FUSIONS == gguf_format.LAYER_FUSIONS  # the trainer's and the file's, kept equal


def test_f16_overflow_is_kept_f32(tmp_path: Path) -> None:
    adapter = make_adapter()
    state = numpy_state(adapter)
    state["blocks.1.mlp_up.weight"][3, 4] = 7e4
    state["query"][0, 0] = -7e4
    out = tmp_path / "big.gguf"
    summary = gguf_format.write_adapter_gguf(out, tensors=state, hparams=hparams(), provenance=PROVENANCE, name="big")
    assert sorted(summary.kept_f32) == ["blk.1.mlp_up.weight", "query"]
    tensors = gguf_format.read_gguf_tensors(out)
    for name in summary.kept_f32:
        assert tensors[name].dtype == np.float32
    assert tensors["blk.1.mlp_up.weight"][3, 4] == np.float32(7e4)
    assert tensors["blk.0.mlp_up.weight"].dtype == np.float16
    assert all(np.isfinite(t).all() for t in tensors.values())
    assert summary.f16_count == sum(t.dtype == np.float16 for t in tensors.values())
    # The limit both the export and the precompute check (lib/core/f16.py, numpy-free) is numpy's own.
    assert F16_MAX == float(np.finfo(np.float16).max)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("given_as", [np.float32, np.float16])  # f16: already cast by the caller (export)
def test_non_finite_tensor_raises_naming_it(tmp_path: Path, bad: float, given_as) -> None:
    state = numpy_state(make_adapter())
    key = "blocks.0.self_attn.q.weight" if given_as == np.float16 else "blocks.0.self_norm.bias"
    assert gguf_format.is_f16_tensor(key) == (given_as == np.float16)
    state[key] = state[key].astype(given_as)
    state[key].reshape(-1)[2] = bad
    with pytest.raises(ValueError, match=re.escape(key) + r".*NaN or inf"):
        gguf_format.write_adapter_gguf(tmp_path / "x.gguf", tensors=state, hparams=hparams(),
                                       provenance=PROVENANCE, name="x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("provenance, key", [
    ({**PROVENANCE, "student.commit": ""}, "llm_adapter.student.commit"),
    ({**PROVENANCE, "tags": []}, "llm_adapter.tags"),
])
def test_empty_metadata_values_raise(tmp_path: Path, provenance: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        write(tmp_path / "x.gguf", make_adapter(), provenance=provenance)
    with pytest.raises(ValueError, match="general.name"):
        write(tmp_path / "x.gguf", make_adapter(), name="")
    assert list(tmp_path.iterdir()) == []


def test_metadata_validation(tmp_path: Path) -> None:
    adapter = make_adapter()
    with pytest.raises(ValueError, match="collides"):
        write(tmp_path / "x.gguf", adapter, provenance={**PROVENANCE, "width": 3})
    with pytest.raises(ValueError, match="missing"):
        write(tmp_path / "x.gguf", adapter, hparams={**hparams(), "depth": 3})
    with pytest.raises(ValueError, match="unexpected"):
        write(tmp_path / "x.gguf", adapter, hparams={**hparams(), "dropout": 0.1})
    state = numpy_state(adapter)
    state["out_proj.weight"] = state["out_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match="out_proj.weight"):
        write(tmp_path / "x.gguf", adapter, tensors=state)
    out = tmp_path / "arr.gguf"
    write(out, adapter, provenance={**PROVENANCE, "tags": ["a", "b"], "flag": True})
    assert gguf_format.provenance_from_metadata(gguf_format.read_gguf_metadata(out)) == {
        **PROVENANCE, "tags": ["a", "b"], "flag": True}


def test_failed_verify_keeps_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every byte of the temp file is checked before the rename: a torn tail, a flipped tensor byte,
    a flipped byte in the header and a non-zero padding byte are each refused, the old file kept."""
    out = tmp_path / "adapter.gguf"
    write(out, make_adapter(0))
    good = out.read_bytes()
    real_write = gguf_format._write_file

    def damaged_write(damage):
        def write_then_damage(path: Path, kvs, tensors, pool):
            layout, sha = real_write(path, kvs, tensors, pool)
            sha.result()  # the hash of what was meant to be written, before the damage
            with open(path, "r+b") as fh:
                damage(fh, layout)
            return layout, sha
        return write_then_damage

    def flip(fh, offset: int, whence: int = 0) -> None:
        fh.seek(offset, whence)
        byte = fh.read(1)
        fh.seek(offset, whence)
        fh.write(bytes([byte[0] ^ 0xFF]))

    def padding_after_prefix(layout) -> int:
        pad = (-len(layout.prefix)) % layout.alignment
        assert pad > 0, "this adapter's header happens to end aligned; flip another padding byte"
        return len(layout.prefix)

    damages = {
        "torn tail": (lambda fh, layout: fh.truncate(fh.seek(0, 2) - 100), "cannot re-read|bytes"),
        "tensor byte": (lambda fh, layout: flip(fh, -3, 2), "bytes differ"),
        "header byte": (lambda fh, layout: flip(fh, len(layout.prefix) - 1),
                        "differ|reads back|keys|types|cannot re-read"),
        "padding byte": (lambda fh, layout: flip(fh, padding_after_prefix(layout)), "padding"),
    }
    for what, (damage, message) in damages.items():
        monkeypatch.setattr(gguf_format, "_write_file", damaged_write(damage))
        with pytest.raises(gguf_format.GGUFVerifyError, match=message):
            write(out, make_adapter(1))
        assert out.read_bytes() == good, what
        assert [p.name for p in tmp_path.iterdir()] == ["adapter.gguf"], what


def test_the_hash_computed_during_the_write_is_the_files(tmp_path: Path) -> None:
    """The sha256 comes from memory while the bytes are written (no second read of the file);
    it must equal a hash of the file as it lies on disk, for f16 and kept-f32 tensors alike."""
    for seed in (0, 1):
        out = tmp_path / f"adapter-{seed}.gguf"
        summary = write(out, make_adapter(seed))
        assert summary.sha256 == atomic.sha256_file(out)
        assert summary.bytes == out.stat().st_size


# --- the evaluator --------------------------------------------------------------------


def test_safetensors_reader_dtypes(tmp_path: Path) -> None:
    arrays = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        "f16": (np.arange(4, dtype=np.float16) - 1.5),
        "i32": np.array([1, -2, 3], dtype=np.int32),
        "i64": np.array([[2**40, -1]], dtype=np.int64),
        "u8": np.array([0, 255, 7], dtype=np.uint8),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    save_numpy(arrays, str(tmp_path / "a.safetensors"))
    got = safetensors_io.read_numpy(tmp_path / "a.safetensors")
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        np.testing.assert_array_equal(got[k], v)
    bf = torch.randn(3, 5).to(torch.bfloat16)
    save_file({"bf": bf}, str(tmp_path / "b.safetensors"))
    st = safetensors_io.SafetensorsFile(tmp_path / "b.safetensors")
    assert st.dtype("bf") == "BF16"
    np.testing.assert_array_equal(st.get("bf"), bf.float().numpy())


def write_shard(folder: Path, *, adapter: Adapter, texts: list[str], lengths: list[int], targets_dtype: torch.dtype,
                hidden_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A shard folder; targets = the adapter's own prediction plus noise, so cosines are mid-range."""
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    prompts = [(torch.randn(n, SHAPE.student_dim, generator=gen) * 2).to(hidden_dtype) for n in lengths]
    with torch.no_grad():
        pred = adapter.to_target_space(torch_predict(adapter, [p.float() for p in prompts]))
    targets = (pred + torch.randn(pred.shape, generator=gen) * adapter.target_std * 0.8).to(targets_dtype)
    offsets = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int64)
    hidden = torch.cat(prompts) if prompts else torch.zeros(0, SHAPE.student_dim, dtype=hidden_dtype)
    save_file({"targets": targets.contiguous()}, str(folder / "teacher.safetensors"))
    save_file({"hidden": hidden.contiguous(), "offsets": offsets,
               "token_ids": torch.arange(int(offsets[-1]), dtype=torch.int32)}, str(folder / "student.safetensors"))
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return targets, prompts


def test_evaluate_matches_torch(tmp_path: Path) -> None:
    adapter = make_adapter(2)
    out = tmp_path / "adapter.gguf"
    write(out, adapter)
    reference = f16_rounded(adapter)
    specs = [
        ("a", ["hello", "", "a longer prompt", "x"], [4, 0, 11, 1], torch.float16, torch.float32),
        ("b", ["bf16 one", "bf16 two", "", "three"], [3, 7, 2, 5], torch.bfloat16, torch.bfloat16),
    ]
    shards, per_shard, all_cos, empty_cos, rows = [], [], [], [], []
    for i, (name, texts, lengths, t_dtype, h_dtype) in enumerate(specs):
        folder = tmp_path / "shards" / name
        targets, prompts = write_shard(folder, adapter=adapter, texts=texts, lengths=lengths, targets_dtype=t_dtype,
                                       hidden_dtype=h_dtype, seed=10 + i)
        pred = torch_predict(reference, [p.float() for p in prompts])
        cos = centred_cosine_rows(pred, targets.float(), reference.target_mean, reference.target_std)
        shards.append(folder)
        per_shard.append(float(cos.mean()))
        all_cos += cos.tolist()
        empty_cos += [c for c, t in zip(cos.tolist(), texts) if t == ""]
        rows += [(c, t, str(folder), j) for j, (c, t) in enumerate(zip(cos.tolist(), texts))]

    result = gguf_eval.evaluate_gguf(out, shards)
    assert 0.2 < result["val_centred_cosine"] < 0.99  # a non-degenerate check
    assert result["val_centred_cosine"] == pytest.approx(np.mean(all_cos), abs=1e-4)
    assert result["empty_prompt_cosine"] == pytest.approx(np.mean(empty_cos), abs=1e-4)
    assert result["n_prompts"] == 8
    assert [s["n"] for s in result["per_shard"]] == [4, 4]
    assert [s["shard"] for s in result["per_shard"]] == [str(s) for s in shards]
    for got, want in zip(result["per_shard"], per_shard):
        assert got["val_centred_cosine"] == pytest.approx(want, abs=1e-4)
    assert len(result["worst"]) == 8
    assert [w["cosine"] for w in result["worst"]] == sorted(w["cosine"] for w in result["worst"])
    want_worst = sorted(rows)[0]
    assert (result["worst"][0]["text"], result["worst"][0]["shard"], result["worst"][0]["index"]) == want_worst[1:]
    assert result["seconds"] >= 0


def test_evaluate_small_groups_and_no_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouping of student rows must not change scores; no empty prompt → None."""
    adapter = make_adapter(4)
    out = tmp_path / "adapter.gguf"
    write(out, adapter)
    folder = tmp_path / "s"
    write_shard(folder, adapter=adapter, texts=[f"p{i}" for i in range(6)], lengths=[3, 0, 8, 2, 5, 1],
                targets_dtype=torch.float32, hidden_dtype=torch.float16, seed=5)
    whole = gguf_eval.evaluate_gguf(out, [folder])
    monkeypatch.setattr(gguf_eval, "GROUP_TOKENS", 4)
    grouped = gguf_eval.evaluate_gguf(out, [folder])
    assert whole["empty_prompt_cosine"] is None
    assert grouped["val_centred_cosine"] == pytest.approx(whole["val_centred_cosine"], abs=1e-6)


def test_evaluate_rejects_mismatched_shard(tmp_path: Path) -> None:
    adapter = make_adapter()
    out = tmp_path / "adapter.gguf"
    write(out, adapter)
    folder = tmp_path / "s"
    write_shard(folder, adapter=adapter, texts=["a", "b"], lengths=[2, 3], targets_dtype=torch.float32,
                hidden_dtype=torch.float32, seed=1)
    (folder / "prompts.jsonl").write_text(json.dumps({"text": "a"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="targets shape"):
        gguf_eval.evaluate_gguf(out, [folder])


# --- independence of the evaluator ----------------------------------------------------


def test_gguf_eval_imports_no_training_code() -> None:
    source = Path(gguf_eval.__file__).read_text(encoding="utf-8")
    modules: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module or "")
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
    forbidden = ("torch", "gguf_assets.lib.training.adapter", "gguf_assets.lib.training.train")
    bad = sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden))
    assert bad == []
    third_party = {m.split(".")[0] for m in modules if m.split(".")[0] not in sys.stdlib_module_names}
    assert third_party <= {"numpy", "gguf", "gguf_assets"}
    layout_names = {"gguf_assets.lib.project.layout"} | {f"gguf_assets.lib.project.layout.{n}" for n in
                                                 ("TEACHER_FILE", "STUDENT_FILE", "PROMPTS_FILE")}
    reader = {"gguf_assets.lib.core.safetensors_io"} | {f"gguf_assets.lib.core.safetensors_io.{n}" for n in
                                                   ("SafetensorsFile", "to_float32")}
    packages = {"gguf_assets.lib", "gguf_assets.lib.output", "gguf_assets.lib.project", "gguf_assets.lib.core"}
    assert {m for m in modules if m.startswith("gguf_assets")} <= {*packages, "gguf_assets.lib.output.gguf_format",
                                                                   *layout_names, *reader}
    # And at run time: reading a GGUF and the shards loads no torch (the shard file names come from layout).
    loaded = subprocess.run([sys.executable, "-c", "import sys, gguf_assets.lib.output.gguf_eval; "
                             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"],
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_gguf_eval_does_not_pull_in_torch_transitively() -> None:
    code = "import sys, gguf_assets.lib.output.gguf_eval; sys.exit(int(any(m == 'torch' or m.startswith('torch.') " \
           "for m in sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3], timeout=60)
    assert proc.returncode == 0, "importing gguf_eval imported torch"

