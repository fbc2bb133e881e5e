"""The vision encoder → clip/mmproj GGUF, on tiny SigLIP models built locally with transformers."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType
from safetensors.numpy import load_file
from test_export import MATERIALS, fake_run, project
from test_gguf_format import make_adapter
from transformers import (
    SiglipConfig,
    SiglipModel,
    SiglipVisionConfig,
    SiglipVisionModel,
)

from gguf_assets.lib.core import atomic
from gguf_assets.lib.output import export, gguf_format, vision
from gguf_assets.lib.output.report import build_report

# On one worker: the tiny vision encoder is built once (conftest.py).
pytestmark = pytest.mark.xdist_group("vision")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
            patch_size=8, layer_norm_eps=1e-6)
MEAN, STD = [0.5, 0.25, 0.125], [0.5, 0.75, 1.0]


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SiglipVisionModel (random weights, with the attention-pooling head) + preprocessor config."""
    folder = tmp_path_factory.mktemp("siglip")
    torch.manual_seed(0)
    model = SiglipVisionModel(SiglipVisionConfig(**TINY)).eval()
    with torch.no_grad():  # LayerNorms away from identity, so a swapped ln1/ln2 would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    (folder / vision.PREPROCESSOR_FILE).write_text(json.dumps({"image_mean": MEAN, "image_std": STD}))
    return folder


def convert(folder: Path, out: Path) -> dict:
    return vision.write_vision_gguf(folder, out, name="tiny-vision", source="org/siglip", commit="abc123")


def test_metadata_follows_mmproj_conventions(siglip_dir: Path, tmp_path: Path) -> None:
    summary = convert(siglip_dir, tmp_path / "v.gguf")
    fields = {k: f for k, f in GGUFReader(tmp_path / "v.gguf").fields.items() if not k.startswith("GGUF.")}
    S, U32, F32, B = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL
    K = gguf.Keys.ClipVision
    expected = {
        gguf.Keys.General.ARCHITECTURE: ([S], "clip"), gguf.Keys.General.TYPE: ([S], "mmproj"),
        gguf.Keys.General.NAME: ([S], "tiny-vision"), gguf.Keys.General.FILE_TYPE: ([U32], 1),
        gguf.Keys.Clip.HAS_VISION_ENCODER: ([B], True), K.USE_GELU: ([B], True),
        K.IMAGE_SIZE: ([U32], 32), K.PATCH_SIZE: ([U32], 8), K.EMBEDDING_LENGTH: ([U32], 32),
        K.FEED_FORWARD_LENGTH: ([U32], 64), K.BLOCK_COUNT: ([U32], 2), K.Attention.HEAD_COUNT: ([U32], 4),
        K.Attention.LAYERNORM_EPS: ([F32], pytest.approx(1e-6)),
        K.IMAGE_MEAN: ([GGUFValueType.ARRAY, F32], MEAN), K.IMAGE_STD: ([GGUFValueType.ARRAY, F32], STD),
        vision.KEY_SOURCE: ([S], "org/siglip"), vision.KEY_COMMIT: ([S], "abc123"),
        vision.KEY_HIDDEN_ACT: ([S], "gelu_pytorch_tanh"),
    }
    assert list(fields) == list(expected)
    for key, (types, value) in expected.items():
        assert fields[key].types == types, key
        assert fields[key].contents() == value, key
    assert summary["architecture"] == "clip" and summary["sha256"] == atomic.sha256_file(tmp_path / "v.gguf")


def test_tensors_round_trip_under_llama_cpp_names(siglip_dir: Path, tmp_path: Path) -> None:
    summary = convert(siglip_dir, tmp_path / "v.gguf")
    original = load_file(str(siglip_dir / "model.safetensors"))
    read = gguf_format.read_gguf_tensors(tmp_path / "v.gguf")
    assert len(read) == len(original) == summary["tensor_count"]
    head = sorted(k for k in original if k.startswith("head."))
    assert head and summary["unmapped"] == head and summary["skipped"] == []
    for key, array in original.items():
        name = vision.vision_tensor_name(key) or key
        got = read[name]
        assert got.dtype == (np.float16 if array.ndim >= 2 else np.float32), name
        np.testing.assert_array_equal(got, array.astype(got.dtype), err_msg=name)
    for name in ("v.patch_embd.weight", "v.position_embd.weight", "v.blk.1.attn_q.weight", "v.blk.1.attn_k.bias",
                 "v.blk.0.attn_v.weight", "v.blk.0.attn_out.weight", "v.blk.1.ln1.weight", "v.blk.1.ln2.bias",
                 "v.blk.0.ffn_up.weight", "v.blk.0.ffn_down.bias", "v.post_ln.weight", "head.probe"):
        assert name in read, name
    assert read["v.patch_embd.weight"].shape == (32, 3, 8, 8)  # ne = [8, 8, 3, 32] as ggml_conv_2d wants


def test_mapping_matches_gguf_py(siglip_dir: Path) -> None:
    """Our table is llama.cpp's: gguf-py maps the same SigLIP names (under its vision_tower prefix)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, TINY["num_hidden_layers"])
    keys = load_file(str(siglip_dir / "model.safetensors"))
    mapped = [k for k in keys if vision.vision_tensor_name(k)]
    assert len(mapped) == len(keys) - sum(k.startswith("head.") for k in keys)
    for key in mapped:
        assert names.get_name("vision_tower.vision_model." + key, try_suffixes=(".weight", ".bias")) == \
            vision.vision_tensor_name(key), key


def _numpy_siglip(weights: dict[str, np.ndarray], meta: dict, pixels: np.ndarray) -> np.ndarray:
    """The SigLIP tower from the GGUF alone (what a runtime does): [3, H, W] → [patches, hidden]."""
    w = {k: v.astype(np.float32) for k, v in weights.items()}
    p, heads = meta["clip.vision.patch_size"], meta["clip.vision.attention.head_count"]
    eps = meta["clip.vision.attention.layer_norm_epsilon"]
    c, h, wd = pixels.shape
    patches = pixels.reshape(c, h // p, p, wd // p, p).transpose(1, 3, 0, 2, 4).reshape(-1, c * p * p)
    x = patches @ w["v.patch_embd.weight"].reshape(w["v.patch_embd.weight"].shape[0], -1).T + w["v.patch_embd.bias"]
    x = x + w["v.position_embd.weight"]

    def ln(t: np.ndarray, name: str) -> np.ndarray:
        mu = t.mean(-1, keepdims=True)
        var = ((t - mu) ** 2).mean(-1, keepdims=True)
        return (t - mu) / np.sqrt(var + eps) * w[f"{name}.weight"] + w[f"{name}.bias"]

    def lin(t: np.ndarray, name: str) -> np.ndarray:
        return t @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    n, width = x.shape
    dh = width // heads
    for i in range(meta["clip.vision.block_count"]):
        b = f"v.blk.{i}."
        y = ln(x, b + "ln1")
        q, k, v = (lin(y, b + t).reshape(n, heads, dh).transpose(1, 0, 2) for t in ("attn_q", "attn_k", "attn_v"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(dh)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + lin((a @ v).transpose(1, 0, 2).reshape(n, width), b + "attn_out")
        u = lin(ln(x, b + "ln2"), b + "ffn_up")
        u = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        x = x + lin(u, b + "ffn_down")
    return ln(x, "v.post_ln")


def test_the_gguf_alone_runs_the_tower_like_transformers(siglip_dir: Path, tmp_path: Path) -> None:
    convert(siglip_dir, tmp_path / "v.gguf")
    meta = gguf_format.read_gguf_metadata(tmp_path / "v.gguf")
    weights = gguf_format.read_gguf_tensors(tmp_path / "v.gguf")
    model = SiglipVisionModel.from_pretrained(siglip_dir).eval()
    with torch.no_grad():  # the reference with exactly the GGUF's (f16-rounded) matrices
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.copy_(param.half().float())
        pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        want = model(pixel_values=pixels).last_hidden_state[0].numpy()
    got = _numpy_siglip(weights, meta, pixels[0].numpy())
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


def test_composite_checkpoint_exports_only_the_vision_tower(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = SiglipConfig(vision_config={**TINY}, text_config=dict(hidden_size=16, intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=2, vocab_size=50, max_position_embeddings=8))
    SiglipModel(config).save_pretrained(tmp_path / "full")
    summary = convert(tmp_path / "full", tmp_path / "v.gguf")
    keys = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert summary["skipped"] and all(not k.startswith("vision_model.") for k in summary["skipped"])
    assert any(k.startswith("text_model.") for k in summary["skipped"])
    assert summary["tensor_count"] == sum(k.startswith("vision_model.") for k in keys)
    read = gguf_format.read_gguf_tensors(tmp_path / "v.gguf")
    np.testing.assert_array_equal(read["v.blk.1.attn_q.weight"],
                                  keys["vision_model.encoder.layers.1.self_attn.q_proj.weight"].astype(np.float16))
    assert gguf_format.read_gguf_metadata(tmp_path / "v.gguf")["clip.vision.block_count"] == 2


def test_bad_vision_folders_are_refused_by_name(siglip_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(siglip_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "patch_size": None}))
    with pytest.raises(vision.VisionExportError, match=r"config\.json: patch_size = None"):
        convert(broken, tmp_path / "v.gguf")
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(vision.VisionExportError, match=r"v\.blk\.2\.attn_q\.weight"):
        convert(broken, tmp_path / "v.gguf")
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(vision.VisionExportError, match=r"blocks \[1\]"):
        convert(broken, tmp_path / "v.gguf")
    (broken / "config.json").unlink()
    with pytest.raises(vision.VisionExportError, match="config.json is missing"):
        convert(broken, tmp_path / "v.gguf")
    assert not (tmp_path / "v.gguf").exists()


@pytest.mark.parametrize("enabled", [True, False])
def test_export_report_and_ggk_command_include_the_vision_gguf(siglip_dir: Path, tmp_path: Path,
                                                                enabled: bool) -> None:
    ggk_dir = tmp_path / "ggk"
    paths, settings = project(tmp_path, also_copy_to=str(ggk_dir), export_vision_encoder=enabled)
    materials = dataclasses.replace(MATERIALS, vision_encoder={"source": "org/siglip", "path": str(siglip_dir),
                                                               "commit": "abc123"})
    sidecar = export.export_adapter(paths, settings, materials, fake_run(paths, make_adapter(0)))
    report = build_report(paths, settings, materials, sidecar, None, fingerprint="x")
    vision_file = paths.root / "output" / "adapter-vision.gguf"
    if not enabled:
        assert sidecar.vision is None and not vision_file.exists() and report.vision_gguf is None
        assert "--llm_vision" not in report.ggk_command
        return
    copy = ggk_dir / "adapter-vision.gguf"
    assert sidecar.vision["path"] == str(vision_file)
    assert copy.read_bytes() == vision_file.read_bytes()
    # Files inside the project are named relative to it; the copies elsewhere keep their absolute path.
    assert [(f["role"], f["path"]) for f in report.files] == [
        ("adapter", "output/adapter.gguf"), ("vision_encoder", "output/adapter-vision.gguf"),
        ("adapter", str(ggk_dir / "adapter.gguf")), ("vision_encoder", str(copy))]
    assert {f["path"]: f["sha256"] for f in report.files}[str(copy)] == atomic.sha256_file(copy)
    assert report.vision_gguf == "output/adapter-vision.gguf"
    assert report.ggk_command.count("--llm_vision") == 1 and f"--llm_vision {copy} " in report.ggk_command
    md = (paths.root / "output" / "report.md").read_text(encoding="utf-8")
    assert f"`{copy}`" in md and "the paired vision encoder" in md
