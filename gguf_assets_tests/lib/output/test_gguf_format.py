"""GGUF export (ggk's seedless-resampler layout) and the torch-free evaluator: round trip, names, dtype rules,
atomicity, numpy vs torch."""

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
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

from gguf_assets.lib.core import atomic, metrics, safetensors_io
from gguf_assets.lib.core.f16 import F16_MAX
from gguf_assets.lib.core.ggk_contract import ADAPTER_HEAD_DIM, ADAPTER_LAYER_NORM_EPS, ADAPTER_PREFIX
from gguf_assets.lib.output import export, gguf_eval, gguf_format
from gguf_assets.lib.training.adapter import MLP_RATIO, Adapter, AdapterShape, centred_cosine_rows

# Two heads of ggk's 64 (so a head split in the wrong order shows), two blocks.
SHAPE = AdapterShape(student_dim=12, query_rows=8, target_dim=10, width=128, depth=2)
PROVENANCE = {
    "conditioning": "llada-image",
    "student.repo": "org/student", "student.commit": "abc123", "student.hidden_size": 12,
    "student.gguf": "adapter-student.gguf",
    "teacher.repo": "org/teacher", "teacher.commit": "def456", "teacher.layer": 30,
    "training.steps": 1234, "training.planned_steps": 2000, "training.checkpoint": "final", "training.seed": 7,
    "training.val_centred_cosine": 0.8734567891234, "training.fingerprint": "0123456789abcdef",
    "trainer": "gguf_assets test",
}


def make_adapter(seed: int = 0, shape: AdapterShape = SHAPE) -> Adapter:
    """A random adapter far from its init: attention far from uniform, norms away from 1, and statistics that
    make the standardization matter (std away from 1, centre away from 0, each row its own)."""
    torch.manual_seed(seed)
    adapter = Adapter(shape).eval()
    with torch.no_grad():
        for name, p in adapter.named_parameters():
            module, _, param = name.rpartition(".")
            if name == "query":
                p.copy_(torch.randn_like(p))
            elif p.ndim == 2:  # linear weights: logits of about unit scale per head
                p.copy_(torch.randn_like(p) * (1.5 / p.shape[1] ** 0.5))
            elif module.rpartition(".")[2].startswith("ln_") and param == "weight":
                p.copy_(1.0 + torch.randn_like(p) * 0.3)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
        adapter.target_centre.copy_(torch.randn(shape.query_rows, shape.target_dim) * 2.0)
        adapter.target_std.copy_(torch.rand(shape.target_dim) + 0.5)
    return adapter


def hparams(shape: AdapterShape = SHAPE) -> dict:
    return gguf_format.hparams_of(student_dim=shape.student_dim, query_rows=shape.query_rows,
                                  target_dim=shape.target_dim, width=shape.width, depth=shape.depth,
                                  mlp_ratio=MLP_RATIO)


def numpy_state(adapter: Adapter) -> dict[str, np.ndarray]:
    """The tensors the file holds, as float32 numpy: the export's (standardization folded into out_proj)."""
    return {k: v.detach().float().numpy().copy() for k, v in export.ggk_tensors(adapter).items()}


def f16_rounded(adapter: Adapter) -> Adapter:
    """A torch adapter computing exactly what the GGUF holds: its matrices through f16, and its out_proj such that
    out_proj folded with the same statistics is the file's (the folded weight rounded to f16, the bias f32)."""
    clone = Adapter(adapter.shape).eval()
    state = {k: (v.half().float() if gguf_format.is_f16_tensor(k) else v.clone())
             for k, v in adapter.state_dict().items()}
    weight, bias = adapter.folded_out_proj()
    std, mean = adapter.target_std.float(), adapter.target_mean.float()
    state["out_proj.weight"] = weight.detach().half().float() / std[:, None]
    state["out_proj.bias"] = (bias.detach() - mean) / std
    clone.load_state_dict(state)
    return clone


def write(path: Path, adapter: Adapter, **overrides) -> gguf_format.WrittenGguf:
    kwargs = {"tensors": numpy_state(adapter), "hparams": hparams(), "provenance": PROVENANCE, "name": "test-adapter"}
    kwargs.update(overrides)
    return gguf_format.write_adapter_gguf(path, **kwargs)


def torch_predict(adapter: Adapter, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Standardized [B, Q, D] for prompts of varying length (padded + masked, as training batches them)."""
    longest = max(p.shape[0] for p in prompts)
    states = torch.zeros(len(prompts), longest, adapter.shape.student_dim)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for i, p in enumerate(prompts):
        states[i, :p.shape[0]] = p
        mask[i, :p.shape[0]] = True
    with torch.no_grad():
        return adapter(states, mask)


# --- names and layout -----------------------------------------------------------------


def test_tensor_names_cover_the_adapter_and_invert() -> None:
    state = Adapter(SHAPE).state_dict()
    trained = [k for k in state if k not in gguf_format.TRAINING_ONLY]
    # Every buffer is a training statistic, none a tensor ggk reads: the file leaves them all out.
    buffers = {name for name, _ in Adapter(SHAPE).named_buffers()}
    assert set(gguf_format.TRAINING_ONLY) == buffers and {"target_centre", "target_std"} <= buffers
    expected = gguf_format.expected_tensor_shapes(hparams())
    assert list(expected) == trained  # the file's order is the module's
    assert all(tuple(state[k].shape) == shape for k, shape in expected.items())
    # ggk's names: the state-dict key under adapter. (ggk_contract.ADAPTER_PREFIX), no renaming table.
    assert ADAPTER_PREFIX == "adapter."
    assert gguf_format.tensor_name("blocks.1.cross_attn.q.weight") == "adapter.blocks.1.cross_attn.q.weight"
    assert gguf_format.tensor_name("blocks.0.mlp.0.weight") == "adapter.blocks.0.mlp.0.weight"
    assert gguf_format.tensor_name("query") == "adapter.query"
    names = [gguf_format.tensor_name(k) for k in trained]
    assert names == [ADAPTER_PREFIX + k for k in trained]
    assert all(len(n) <= gguf_format.MAX_TENSOR_NAME for n in names)
    assert all(gguf_format.state_dict_key(gguf_format.tensor_name(k)) == k for k in trained)
    # The training statistics never reach the file, and names ggk does not know are refused both ways.
    for key in (*gguf_format.TRAINING_ONLY, "target_mean", "blocks.0.new_thing.weight", "blocks.01.ln_q.weight",
                "blocks.0.mlp.1.weight", "null_memory", "blocks.0.cross_norm.weight"):
        with pytest.raises(ValueError, match="unknown"):
            gguf_format.tensor_name(key)
    for name in ("blocks.0.ln_q.weight", "blk.0.cross_attn.q.weight", "adapter.target_std", "llm_adapter.query"):
        with pytest.raises(ValueError, match="unknown"):
            gguf_format.state_dict_key(name)


def test_dtype_rule_is_f16_for_2d_linear_weights_only() -> None:
    state = Adapter(SHAPE).state_dict()
    f16 = {k for k in state if k not in gguf_format.TRAINING_ONLY and gguf_format.is_f16_tensor(k)}
    linears = {f"{name}.weight" for name, m in Adapter(SHAPE).named_modules() if isinstance(m, torch.nn.Linear)}
    assert f16 == linears and len(f16) == 2 + 10 * SHAPE.depth
    # query is an F32 parameter in ggk; norms and biases stay F32.
    assert not gguf_format.is_f16_tensor("query")
    assert not gguf_format.is_f16_tensor("blocks.0.ln_kv.weight") and not gguf_format.is_f16_tensor("ln_out.weight")
    assert not gguf_format.is_f16_tensor("blocks.0.mlp.0.bias") and not gguf_format.is_f16_tensor("out_proj.bias")


def test_hparams_are_ggks() -> None:
    hp = hparams()
    assert list(hp) == list(gguf_format.HPARAM_TYPES)
    assert hp == {"in_dim": 12, "out_dim": 10, "width": 128, "depth": 2, "heads": SHAPE.heads, "head_dim": 64,
                  "query_count": 8, "mlp_hidden": 512, "layer_norm_epsilon": ADAPTER_LAYER_NORM_EPS}
    assert SHAPE.heads == 128 // ADAPTER_HEAD_DIM == 2
    assert gguf_format.validate_hparams(hp) == hp
    with pytest.raises(ValueError, match="head dim 64"):
        gguf_format.validate_hparams({**hp, "heads": 4})
    with pytest.raises(ValueError, match="head dim 64"):
        gguf_format.validate_hparams({**hp, "width": 96, "heads": 1})
    with pytest.raises(ValueError, match="positive integer"):
        gguf_format.validate_hparams({**hp, "depth": 0})
    with pytest.raises(ValueError, match="positive integer"):
        gguf_format.validate_hparams({**hp, "depth": True})
    with pytest.raises(ValueError, match="positive finite"):
        gguf_format.validate_hparams({**hp, "layer_norm_epsilon": float("nan")})


def test_roundtrip_keys_and_tensors(tmp_path: Path) -> None:
    adapter = make_adapter()
    out = tmp_path / "adapter.gguf"
    summary = write(out, adapter)
    state = numpy_state(adapter)
    assert summary.path == str(out)
    assert summary.bytes == out.stat().st_size
    assert summary.sha256 == atomic.sha256_file(out)
    assert summary.tensor_count == len(state) == 7 + 28 * SHAPE.depth  # as docs/gguf_layout.md says
    assert summary.kept_f32 == ()
    assert (summary.architecture, summary.format_version, summary.name) == ("llm_adapter", 3, "test-adapter")
    n_f16 = sum(gguf_format.is_f16_tensor(k) for k in state)
    assert (summary.f16_count, summary.f32_count) == (n_f16, len(state) - n_f16)
    assert n_f16 == 2 + 10 * SHAPE.depth  # in/out_proj, 10 matrices per block

    meta = gguf_format.read_gguf_metadata(out)
    assert meta["general.architecture"] == "llm_adapter"
    assert meta["general.name"] == "test-adapter"
    assert meta["adapter.format_version"] == gguf_format.FORMAT_VERSION == 3
    assert meta["adapter.variant"] == "resampler"
    assert meta["adapter.heads"] == 2 and meta["adapter.head_dim"] == 64 and meta["adapter.mlp_hidden"] == 512
    assert gguf_format.hparams_from_metadata(meta) == pytest.approx(hparams())
    assert np.float32(meta["adapter.layer_norm_epsilon"]) == np.float32(ADAPTER_LAYER_NORM_EPS)
    assert gguf_format.provenance_from_metadata(meta) == PROVENANCE  # ints and float64 exact
    assert list(meta) == ["general.architecture", "general.name", "adapter.format_version", "adapter.variant",
                          *(f"adapter.{k}" for k in [*gguf_format.HPARAM_TYPES, *PROVENANCE])]

    reader = GGUFReader(out)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["adapter.width"].types == [GGUFValueType.UINT32]
    assert fields["adapter.layer_norm_epsilon"].types == [GGUFValueType.FLOAT32]
    assert fields["adapter.training.steps"].types == [GGUFValueType.INT64]
    by_name = {t.name: t for t in reader.tensors}
    assert list(by_name) == [gguf_format.tensor_name(k) for k in state]
    for key, value in state.items():
        t = by_name[gguf_format.tensor_name(key)]
        assert [int(x) for x in t.shape] == list(reversed(value.shape))  # ne order
        if gguf_format.is_f16_tensor(key):
            assert t.tensor_type == GGMLQuantizationType.F16 and value.ndim == 2
            np.testing.assert_array_equal(np.asarray(t.data), value.astype(np.float16))
        else:
            assert t.tensor_type == GGMLQuantizationType.F32
            np.testing.assert_array_equal(np.asarray(t.data), value)
    # linear weight [out, in] -> ne [in, out], as ggml_mul_mat wants; query [Q, W] -> ne [W, Q], F32 as ggk makes it
    assert [int(x) for x in by_name["adapter.blocks.0.mlp.0.weight"].shape] == [SHAPE.width, MLP_RATIO * SHAPE.width]
    assert [int(x) for x in by_name["adapter.in_proj.weight"].shape] == [SHAPE.student_dim, SHAPE.width]
    assert [int(x) for x in by_name["adapter.query"].shape] == [SHAPE.width, SHAPE.query_rows]
    assert by_name["adapter.query"].tensor_type == GGMLQuantizationType.F32
    # and read back through the plain reader, by GGUF name in numpy orientation
    tensors = gguf_format.read_gguf_tensors(out)
    assert tensors["adapter.out_proj.weight"].shape == (SHAPE.target_dim, SHAPE.width)
    assert not any("target" in name for name in tensors)


def test_numpy_forward_matches_torch(tmp_path: Path) -> None:
    adapter = make_adapter(1)
    out = tmp_path / "adapter.gguf"
    write(out, adapter)
    loaded = gguf_eval.load_adapter_gguf(out)
    assert loaded.hparams == pytest.approx(hparams()) and loaded.name == "test-adapter"
    assert loaded.provenance == PROVENANCE
    reference = f16_rounded(adapter)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randn(n, SHAPE.student_dim, generator=gen) * 2 for n in (5, 1, 9, 2)]
    expected = reference.to_target_space(torch_predict(reference, prompts)).numpy()
    assert np.abs(expected).max() > 1.0  # not a degenerate output
    for i, p in enumerate(prompts):
        got = loaded.forward(p.numpy())
        assert got.shape == (SHAPE.query_rows, SHAPE.target_dim) and got.dtype == np.float32
        assert np.abs(got - expected[i]).max() < 1e-4, f"prompt {i} (L={p.shape[0]})"
    # The f16 rounding is real: the unrounded torch adapter differs measurably, but within the f16 error.
    unrounded = adapter.to_target_space(torch_predict(adapter, prompts)).numpy()
    assert 1e-5 < np.abs(unrounded - expected).max() < 5e-2
    # Each prompt is its own: padding in the torch batch is masked, and another prompt gives another output.
    assert np.abs(loaded.forward(prompts[0].numpy()) - loaded.forward(prompts[3].numpy())).max() > 1e-2
    with pytest.raises(ValueError, match=r"states must be \[L, 12\]"):
        loaded.forward(np.zeros((2, SHAPE.student_dim + 1), np.float32))


def test_f16_overflow_is_kept_f32(tmp_path: Path) -> None:
    state = numpy_state(make_adapter())
    state["blocks.1.mlp.0.weight"][3, 4] = 7e4
    state["in_proj.weight"][0, 0] = -7e4
    state["query"][0, 0] = 7e4  # F32 anyway: not a "kept" tensor
    out = tmp_path / "big.gguf"
    summary = gguf_format.write_adapter_gguf(out, tensors=state, hparams=hparams(), provenance=PROVENANCE, name="big")
    assert sorted(summary.kept_f32) == ["adapter.blocks.1.mlp.0.weight", "adapter.in_proj.weight"]
    tensors = gguf_format.read_gguf_tensors(out)
    for name in summary.kept_f32:
        assert tensors[name].dtype == np.float32
    assert tensors["adapter.blocks.1.mlp.0.weight"][3, 4] == np.float32(7e4)
    assert tensors["adapter.in_proj.weight"][0, 0] == np.float32(-7e4)
    assert tensors["adapter.query"][0, 0] == np.float32(7e4)
    assert tensors["adapter.blocks.0.mlp.0.weight"].dtype == np.float16
    assert all(np.isfinite(t).all() for t in tensors.values())
    assert summary.f16_count == sum(t.dtype == np.float16 for t in tensors.values()) == 2 + 10 * SHAPE.depth - 2
    # The limit both the export and the precompute check (lib/core/f16.py, numpy-free) is numpy's own.
    assert F16_MAX == float(np.finfo(np.float16).max)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("key, given_as", [("blocks.0.self_attn.q.weight", np.float16),  # already cast by export
                                           ("blocks.0.self_attn.q.weight", np.float32),
                                           ("blocks.0.ln_self.bias", np.float32), ("query", np.float32)])
def test_non_finite_tensor_raises_naming_it(tmp_path: Path, bad: float, key: str, given_as) -> None:
    state = numpy_state(make_adapter())
    state[key] = state[key].astype(given_as)
    state[key].reshape(-1)[2] = bad
    with pytest.raises(ValueError, match=re.escape(key) + r".*NaN or inf"):
        gguf_format.write_adapter_gguf(tmp_path / "x.gguf", tensors=state, hparams=hparams(),
                                       provenance=PROVENANCE, name="x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("provenance, key", [
    ({**PROVENANCE, "student.commit": ""}, "adapter.student.commit"),
    ({**PROVENANCE, "tags": []}, "adapter.tags"),
])
def test_empty_metadata_values_raise(tmp_path: Path, provenance: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        write(tmp_path / "x.gguf", make_adapter(), provenance=provenance)
    with pytest.raises(ValueError, match="general.name"):
        write(tmp_path / "x.gguf", make_adapter(), name="")
    assert list(tmp_path.iterdir()) == []


def test_metadata_validation(tmp_path: Path) -> None:
    adapter = make_adapter()
    for reserved in ("width", "format_version", "variant", "layer_norm_epsilon"):
        with pytest.raises(ValueError, match="collides"):
            write(tmp_path / "x.gguf", adapter, provenance={**PROVENANCE, reserved: 3})
    with pytest.raises(ValueError, match=r"missing \['blocks\.2\."):
        write(tmp_path / "x.gguf", adapter, hparams={**hparams(), "depth": 3})
    with pytest.raises(ValueError, match="unexpected"):
        write(tmp_path / "x.gguf", adapter, hparams={**hparams(), "dropout": 0.1})
    with pytest.raises(ValueError, match=r"unexpected \['target_std'\]"):
        write(tmp_path / "x.gguf", adapter, tensors={**numpy_state(adapter), "target_std": np.ones(10, np.float32)})
    with pytest.raises(ValueError, match="lowercase dotted"):
        write(tmp_path / "x.gguf", adapter, provenance={**PROVENANCE, "Student.Repo": "x"})
    state = numpy_state(adapter)
    state["out_proj.weight"] = state["out_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match="out_proj.weight"):
        write(tmp_path / "x.gguf", adapter, tensors=state)
    with pytest.raises(ValueError, match="expected floating point"):
        write(tmp_path / "x.gguf", adapter, tensors={**numpy_state(adapter), "query": np.zeros((8, 128), np.int32)})
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "arr.gguf"
    write(out, adapter, provenance={**PROVENANCE, "tags": ["a", "b"], "flag": True})
    assert gguf_format.provenance_from_metadata(gguf_format.read_gguf_metadata(out)) == {
        **PROVENANCE, "tags": ["a", "b"], "flag": True}


@pytest.mark.parametrize("metadata", [
    {"general.architecture": "llm_adapter", "llm_adapter.format_version": 1},  # version 1's own key
    {"general.architecture": "llm_adapter", "llm_adapter.format_version": 2, "llm_adapter.student_layers": 3},
    {"general.architecture": "llm_adapter", "adapter.format_version": 1, "adapter.variant": "resampler"},
    {"general.architecture": "llm_adapter", "adapter.format_version": 2, "adapter.variant": "resampler"},
])
def test_a_version_1_or_2_file_is_refused_saying_to_export_again(metadata: dict) -> None:
    with pytest.raises(ValueError, match="export again"):
        gguf_format.check_header(metadata)
    with pytest.raises(ValueError, match="export again"):
        gguf_format.hparams_from_metadata(metadata)


def test_an_old_file_on_disk_is_refused_by_the_evaluator(tmp_path: Path) -> None:
    """A version 1 file as the product wrote it (its own key names and tensor names) does not load."""
    old = tmp_path / "old.gguf"
    kvs = [gguf_format.KV("general.architecture", GGUFValueType.STRING, "llm_adapter"),
           gguf_format.KV("general.name", GGUFValueType.STRING, "old"),
           gguf_format.KV("llm_adapter.format_version", GGUFValueType.UINT32, 1),
           gguf_format.KV("llm_adapter.student_dim", GGUFValueType.UINT32, 4)]
    gguf_format.write_verified_gguf(old, kvs, {"query": np.zeros((2, 4), np.float16),
                                               "target.mean": np.zeros((2, 3), np.float32)})
    with pytest.raises(ValueError, match="export again"):
        gguf_eval.load_adapter_gguf(old)


def test_other_headers_are_refused() -> None:
    good = {"general.architecture": "llm_adapter", "adapter.format_version": 3, "adapter.variant": "resampler"}
    gguf_format.check_header(good)  # no error
    with pytest.raises(ValueError, match="expected 'llm_adapter'"):
        gguf_format.check_header({**good, "general.architecture": "qwen3"})
    with pytest.raises(ValueError, match="adapter.variant"):
        gguf_format.check_header({**good, "adapter.variant": "seeded"})
    with pytest.raises(ValueError, match="format_version is 4"):
        gguf_format.check_header({**good, "adapter.format_version": 4})
    with pytest.raises(ValueError, match="lacks hyperparameter keys"):
        gguf_format.hparams_from_metadata(good)


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
        # out_proj.bias (D f32) is the last tensor: a byte of it, before the file's closing padding.
        "tensor byte": (lambda fh, layout: flip(fh, -((-4 * SHAPE.target_dim) % layout.alignment) - 3, 2),
                        "bytes differ"),
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
    hashes = set()
    for seed, keep in ((0, ()), (1, ("blocks.0.cross_attn.o.weight",))):
        out = tmp_path / f"adapter-{seed}.gguf"
        summary = write(out, make_adapter(seed), keep_f32=keep)
        assert summary.kept_f32 == tuple(gguf_format.tensor_name(k) for k in keep)
        assert summary.sha256 == atomic.sha256_file(out)
        assert summary.bytes == out.stat().st_size
        hashes.add(summary.sha256)
    assert len(hashes) == 2


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
    """A shard folder; targets = the adapter's own prediction plus noise, so cosines are mid-range.

    Every prompt has at least one token: ggk always feeds the template's tokens, the empty prompt's too."""
    assert min(lengths) >= 1
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    prompts = [(torch.randn(n, adapter.shape.student_dim, generator=gen) * 2).to(hidden_dtype) for n in lengths]
    with torch.no_grad():
        pred = adapter.to_target_space(torch_predict(adapter, [p.float() for p in prompts]))
    targets = (pred + torch.randn(pred.shape, generator=gen) * adapter.target_std * 1.5).to(targets_dtype)
    save_shard(folder, texts=texts, prompts=prompts, targets=targets)
    return targets, prompts


def save_shard(folder: Path, *, texts: list[str], prompts: list[torch.Tensor], targets: torch.Tensor) -> None:
    """A shard folder as precompute writes it: the prompts' texts, their student states [L_i, Ds] and the teacher's
    targets [n, Q, D]."""
    folder.mkdir(parents=True, exist_ok=True)
    offsets = torch.tensor([0, *np.cumsum([len(p) for p in prompts])], dtype=torch.int64)
    save_file({"targets": targets.contiguous()}, str(folder / "teacher.safetensors"))
    save_file({"hidden": torch.cat(prompts).contiguous(), "offsets": offsets,
               "token_ids": torch.arange(int(offsets[-1]), dtype=torch.int32)}, str(folder / "student.safetensors"))
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def centre_of(adapter: Adapter) -> np.ndarray:
    return adapter.target_centre.numpy().copy()


def test_training_centre_is_read_from_the_checkpoint_without_torch(tmp_path: Path) -> None:
    adapter = make_adapter(3)
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in adapter.state_dict().items()}, str(weights))
    centre = gguf_eval.training_centre(weights)
    assert centre.dtype == np.float32 and centre.shape == (SHAPE.query_rows, SHAPE.target_dim)
    np.testing.assert_array_equal(centre, centre_of(adapter))


def test_evaluate_matches_torch(tmp_path: Path) -> None:
    adapter = make_adapter(2)
    out = tmp_path / "adapter.gguf"
    write(out, adapter)
    reference = f16_rounded(adapter)
    specs = [
        ("a", ["hello", "", "a longer prompt", "x"], [4, 3, 11, 1], torch.float16, torch.float32),
        ("b", ["bf16 one", "bf16 two", "", "three"], [3, 7, 2, 5], torch.bfloat16, torch.bfloat16),
    ]
    shards, per_shard, all_cos, empty_cos, rows = [], [], [], [], []
    raw_preds, raw_targets, checkpoint = [], [], {}
    for i, (name, texts, lengths, t_dtype, h_dtype) in enumerate(specs):
        folder = tmp_path / "shards" / name
        targets, prompts = write_shard(folder, adapter=adapter, texts=texts, lengths=lengths, targets_dtype=t_dtype,
                                       hidden_dtype=h_dtype, seed=10 + i)
        pred = torch_predict(reference, [p.float() for p in prompts])
        cos = centred_cosine_rows(pred, targets.float(), reference)
        raw_preds.append(reference.to_target_space(pred).numpy())
        raw_targets.append(targets.float().numpy())
        # The f32 checkpoint's own outputs (the GGUF holds f16 matrices), as checkpoint_outputs gives them.
        checkpoint[folder] = list(adapter.to_target_space(torch_predict(adapter, [p.float() for p in prompts])).numpy())
        shards.append(folder)
        per_shard.append(float(cos.mean()))
        all_cos += cos.tolist()
        empty_cos += [c for c, t in zip(cos.tolist(), texts) if t == ""]
        rows += [(c, t, str(folder), j) for j, (c, t) in enumerate(zip(cos.tolist(), texts))]

    result = gguf_eval.evaluate_gguf(out, shards, centre_of(adapter))
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
    assert result["seconds"] >= 0 and result["gguf"] == str(out)
    # The centre matters: scored around zero instead of the rows' train mean, the cosines differ.
    uncentred = gguf_eval.evaluate_gguf(out, shards, np.zeros_like(centre_of(adapter)))
    assert abs(uncentred["val_centred_cosine"] - result["val_centred_cosine"]) > 1e-2

    # The other scores, over all prompts pooled, by hand from the torch predictions in the raw target space.
    p, t, c = np.concatenate(raw_preds).astype(np.float64), np.concatenate(raw_targets).astype(np.float64), \
        centre_of(adapter).astype(np.float64)
    assert result[metrics.VAL_REL_MSE] == pytest.approx(((p - t) ** 2).sum() / ((t - c) ** 2).sum(), rel=1e-3)
    plain = (p * t).sum(-1) / np.linalg.norm(p, axis=-1) / np.linalg.norm(t, axis=-1)  # RMSNorm: a per-row scale
    assert result[metrics.VAL_RMS_COSINE] == pytest.approx(plain.mean(), abs=1e-4)
    per_row = ((p - c) * (t - c)).sum(-1) / np.linalg.norm(p - c, axis=-1) / np.linalg.norm(t - c, axis=-1)
    assert result[metrics.WORST_ROW] == int(per_row.mean(0).argmin())
    assert result[metrics.WORST_ROW_COSINE] == pytest.approx(per_row.mean(0).min(), abs=1e-4)
    assert result[metrics.GGUF_VS_CHECKPOINT] is None  # no checkpoint given

    # Against the checkpoint's outputs: close (f16 matrices against f32), not identical.
    agreed = gguf_eval.evaluate_gguf(out, shards, centre_of(adapter), checkpoint=lambda f: checkpoint[f])
    agree = agreed[metrics.GGUF_VS_CHECKPOINT]
    assert 0.999 < agree[metrics.MIN_ROW_COSINE] <= agree[metrics.MEAN_ROW_COSINE] < 1.0
    assert 0 < agree[metrics.MAX_ABS_DIFF] and agree[metrics.MAX_ABS_DIFF_RELATIVE] < 1e-2
    assert agreed[metrics.VAL_CENTRED_COSINE] == result[metrics.VAL_CENTRED_COSINE]
    # Another model's outputs (each prompt's shifted by one) are told apart, and a count that differs is refused.
    shifted = gguf_eval.evaluate_gguf(out, shards, centre_of(adapter),
                                      checkpoint=lambda f: checkpoint[f][1:] + checkpoint[f][:1])
    assert shifted[metrics.GGUF_VS_CHECKPOINT][metrics.MIN_ROW_COSINE] < 0.9
    with pytest.raises(ValueError, match="the checkpoint's outputs end before prompt 3"):
        gguf_eval.evaluate_gguf(out, shards, centre_of(adapter), checkpoint=lambda f: checkpoint[f][:3])
    with pytest.raises(ValueError, match="more outputs than the shard has prompts"):
        gguf_eval.evaluate_gguf(out, shards, centre_of(adapter), checkpoint=lambda f: checkpoint[f] * 2)


def test_evaluate_small_groups_and_no_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouping of student rows must not change scores; no empty prompt -> None."""
    adapter = make_adapter(4)
    out = tmp_path / "adapter.gguf"
    write(out, adapter)
    folder = tmp_path / "s"
    write_shard(folder, adapter=adapter, texts=[f"p{i}" for i in range(6)], lengths=[3, 1, 8, 2, 5, 1],
                targets_dtype=torch.float32, hidden_dtype=torch.float16, seed=5)
    whole = gguf_eval.evaluate_gguf(out, [folder], centre_of(adapter))
    monkeypatch.setattr(gguf_eval, "GROUP_TOKENS", 4)
    grouped = gguf_eval.evaluate_gguf(out, [folder], centre_of(adapter))
    assert whole["empty_prompt_cosine"] is None
    assert grouped["val_centred_cosine"] == pytest.approx(whole["val_centred_cosine"], abs=1e-6)
    assert [w["index"] for w in grouped["worst"]] == [w["index"] for w in whole["worst"]]


def test_evaluate_rejects_mismatched_shard_or_centre(tmp_path: Path) -> None:
    adapter = make_adapter()
    out = tmp_path / "adapter.gguf"
    write(out, adapter)
    folder = tmp_path / "s"
    write_shard(folder, adapter=adapter, texts=["a", "b"], lengths=[2, 3], targets_dtype=torch.float32,
                hidden_dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"the centre has shape \[10, 8\], expected \[8, 10\]"):
        gguf_eval.evaluate_gguf(out, [folder], centre_of(adapter).T)
    (folder / "prompts.jsonl").write_text(json.dumps({"text": "a"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="targets shape"):
        gguf_eval.evaluate_gguf(out, [folder], centre_of(adapter))


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
    forbidden = ("torch", "gguf_assets.lib.training")
    bad = sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden))
    assert bad == []
    third_party = {m.split(".")[0] for m in modules if m.split(".")[0] not in sys.stdlib_module_names}
    assert third_party <= {"numpy", "gguf", "gguf_assets"}
    layout_names = {"gguf_assets.lib.project.layout"} | {f"gguf_assets.lib.project.layout.{n}" for n in
                                                         ("TEACHER_FILE", "STUDENT_FILE", "PROMPTS_FILE")}
    reader = {"gguf_assets.lib.core.safetensors_io"} | {f"gguf_assets.lib.core.safetensors_io.{n}" for n in
                                                        ("SafetensorsFile", "to_float32")}
    packages = {"gguf_assets.lib", "gguf_assets.lib.output", "gguf_assets.lib.project", "gguf_assets.lib.core"}
    names = {"gguf_assets.lib.core.metrics"}  # the scores' names only (no code)
    assert {m for m in modules if m.startswith("gguf_assets")} <= {*packages, "gguf_assets.lib.output.gguf_format",
                                                                   *layout_names, *reader, *names}
    # And at run time: reading a GGUF and the shards loads no torch, transformers nor training code.
    loaded = subprocess.run([sys.executable, "-c", "import sys, gguf_assets.lib.output.gguf_eval; "
                             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
                             "or m.startswith('gguf_assets.lib.training')))"],
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_gguf_eval_does_not_pull_in_torch_transitively() -> None:
    code = "import sys, gguf_assets.lib.output.gguf_eval; sys.exit(int(any(m == 'torch' or m.startswith('torch.') " \
           "for m in sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3], timeout=60)
    assert proc.returncode == 0, "importing gguf_eval imported torch"
