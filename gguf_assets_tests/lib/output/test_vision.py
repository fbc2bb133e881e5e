"""The vision encoder → the SigVQ GGUF ggk loads with --llm_vision, on the demo's tiny SigVQ checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from safetensors.numpy import load_file, save_file

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.demo.demo import build_demo_sigvq
from gguf_assets.lib.output import export, vision
from gguf_assets.lib.output.report import build_report


# ggk's SigVQ tensors for one block (sigvq.hpp), numpy shapes, for h 32, MLP 64, p 16, G 4, K 16, D 16, S.
def ggk_shapes(s: int) -> dict[str, tuple[int, ...]]:
    b = "visual.blocks.0."
    return {"visual.patch_embed.proj.weight": (32, 3, 16, 16), "visual.patch_embed.proj.bias": (32,),
            "visual.embeddings.position_embedding.weight": (16, 32),
            b + "norm1.weight": (32,), b + "norm1.bias": (32,), b + "norm2.weight": (32,), b + "norm2.bias": (32,),
            b + "attn.qkv.weight": (96, 32), b + "attn.qkv.bias": (96,), b + "attn.proj.weight": (32, 32),
            b + "attn.proj.bias": (32,), b + "mlp.fc1.weight": (64, 32), b + "mlp.fc1.bias": (64,),
            b + "mlp.fc2.weight": (32, 64), b + "mlp.fc2.bias": (32,),
            "vqmodel.quant_conv.weight": (16, 32, 1, 1), "vqmodel.quant_conv.bias": (16,),
            "vqmodel.quantize.embedding.weight": (16, 16), "prior_token_embedding.weight": (16, s),
            "prior_projector.net.0.proj.weight": (s, s), "prior_projector.net.0.proj.bias": (s,),
            "prior_projector.net.2.weight": (s, s), "prior_projector.net.2.bias": (s,)}


# ggk holds these two in f32 whatever the file has: they stay F32; the other matrices are F16.
F32_MATRICES = {"visual.embeddings.position_embedding.weight", "vqmodel.quantize.embedding.weight"}


def convert(folder: Path, out: Path) -> dict:
    return vision.write_vision_gguf(folder, out, name="tiny-vision", source="org/sigvq", commit="abc123")


def edit_checkpoint(src: Path, dst: Path, change) -> Path:
    """A copy of the checkpoint folder whose tensors ``change(dict)`` edited in place."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def sigvq_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_sigvq(tmp_path_factory.mktemp("sigvq"), 0)


def test_demo_checkpoint_is_deterministic_and_has_exactly_ggks_tensors(sigvq_dir: Path, tmp_path: Path) -> None:
    again = build_demo_sigvq(tmp_path / "again", 0)
    other = build_demo_sigvq(tmp_path / "other", 1, semantic_dim=48)
    assert (again / "model.safetensors").read_bytes() == (sigvq_dir / "model.safetensors").read_bytes()
    assert (again / "config.json").read_bytes() == (sigvq_dir / "config.json").read_bytes()
    assert {k: v.shape for k, v in load_file(str(sigvq_dir / "model.safetensors")).items()} == ggk_shapes(64)
    assert {k: v.shape for k, v in load_file(str(other / "model.safetensors")).items()} == ggk_shapes(48)
    assert json.loads((other / "config.json").read_text())["semantic_dim"] == 48


@pytest.mark.parametrize("semantic_dim", [64, 48])
def test_tensors_keep_their_names_shapes_and_values(tmp_path: Path, semantic_dim: int) -> None:
    folder = build_demo_sigvq(tmp_path / "sigvq", 0, semantic_dim=semantic_dim)
    summary = convert(folder, tmp_path / "v.gguf")
    original = load_file(str(folder / "model.safetensors"))
    tensors = {t.name: t for t in GGUFReader(tmp_path / "v.gguf").tensors}
    assert list(tensors) == list(ggk_shapes(semantic_dim))  # exactly ggk's, in forward order
    for name, want in ggk_shapes(semantic_dim).items():
        t = tensors[name]
        assert tuple(int(x) for x in t.shape) == want[::-1], name  # ggml ne: the numpy shape reversed
        f16 = len(want) >= 2 and name not in F32_MATRICES
        assert t.tensor_type == (GGMLQuantizationType.F16 if f16 else GGMLQuantizationType.F32), name
        stored = np.array(t.data).reshape(want)
        np.testing.assert_array_equal(stored, original[name].astype(stored.dtype), err_msg=name)
    assert summary["tensor_count"] == 23 and summary["f16_count"] == 9 and summary["f32_count"] == 14
    assert summary["skipped"] == [] and summary["unmapped"] == [] and summary["kept_f32"] == []
    assert summary["sha256"] == atomic.sha256_file(tmp_path / "v.gguf")
    assert summary["bytes"] == (tmp_path / "v.gguf").stat().st_size


def test_metadata_names_the_architecture_provenance_and_sizes(sigvq_dir: Path, tmp_path: Path) -> None:
    summary = convert(sigvq_dir, tmp_path / "v.gguf")
    fields = {k: f for k, f in GGUFReader(tmp_path / "v.gguf").fields.items() if not k.startswith("GGUF.")}
    S, U32 = GGUFValueType.STRING, GGUFValueType.UINT32
    sizes = {"hidden": 32, "patch": 16, "pos_grid": 4, "codebook_size": 16, "codebook_dim": 16, "semantic_dim": 64,
             "blocks": 1, "heads": 16}
    expected = {"general.architecture": (S, "sigvq"), "general.name": (S, "tiny-vision"),
                "sigvq.source": (S, "org/sigvq"), "sigvq.commit": (S, "abc123"),
                **{f"sigvq.{k}": (U32, v) for k, v in sizes.items()}}
    assert list(fields) == list(expected)
    for key, (vtype, value) in expected.items():
        assert fields[key].types == [vtype], key
        assert fields[key].contents() == value, key
    assert summary["architecture"] == "sigvq" and summary["hparams"] == sizes


def test_extra_tensors_are_skipped_and_listed(sigvq_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "full"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((sigvq_dir / "model.safetensors").read_bytes())
    extras = {"vqmodel.decoder.conv_in.weight": np.ones((8, 16, 3, 3), np.float32),
              "vqmodel.post_quant_conv.bias": np.ones(16, np.float32),
              "visual.post_layernorm.weight": np.ones(32, np.float32)}
    save_file(extras, str(folder / "decoder.safetensors"))  # a second file: every *.safetensors is read
    summary = convert(folder, tmp_path / "v.gguf")
    names = [t.name for t in GGUFReader(tmp_path / "v.gguf").tensors]
    assert names == list(ggk_shapes(64))
    assert summary["skipped"] == sorted(extras)
    assert summary["tensor_count"] == 23


def test_a_missing_tensor_is_refused_by_name(sigvq_dir: Path, tmp_path: Path) -> None:
    folder = edit_checkpoint(sigvq_dir, tmp_path / "broken", lambda t: t.pop("vqmodel.quant_conv.bias"))
    with pytest.raises(vision.VisionExportError, match=r"model\.safetensors\): missing tensor "
                                                       r"vqmodel\.quant_conv\.bias .*sigvq/ folder") as info:
        convert(folder, tmp_path / "v.gguf")
    assert isinstance(info.value, UserError) and str(folder) in str(info.value)
    assert not (tmp_path / "v.gguf").exists()


def test_a_gap_in_the_blocks_is_a_missing_tensor(sigvq_dir: Path, tmp_path: Path) -> None:
    def add_block_2(t: dict) -> None:  # ggk counts blocks as the highest index + 1, so block 1 must exist too
        t.update({k.replace("blocks.0.", "blocks.2."): v for k, v in list(t.items()) if "blocks.0." in k})
    folder = edit_checkpoint(sigvq_dir, tmp_path / "gap", add_block_2)
    with pytest.raises(vision.VisionExportError, match=r"visual\.blocks\.1\.attn\.proj\.bias.*12 of the 47 .*3 "
                                                       r"blocks"):
        convert(folder, tmp_path / "v.gguf")


def test_a_non_square_position_table_is_refused(sigvq_dir: Path, tmp_path: Path) -> None:
    def pos_rows_15(t: dict) -> None:
        t["visual.embeddings.position_embedding.weight"] = t["visual.embeddings.position_embedding.weight"][:15]
    folder = edit_checkpoint(sigvq_dir, tmp_path / "pos", pos_rows_15)
    with pytest.raises(vision.VisionExportError, match=r"model\.safetensors: tensor 'visual\.embeddings\."
                                                       r"position_embedding\.weight' has 15 rows, not a square grid"):
        convert(folder, tmp_path / "v.gguf")
    assert not (tmp_path / "v.gguf").exists()


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("visual.blocks.0.mlp.fc2.weight", (32, 48), r"'visual\.blocks\.0\.mlp\.fc2\.weight' has shape \[32, 48\], "
                                                 r"expected \[32, 64\]"),
    ("vqmodel.quant_conv.weight", (16, 32), r"'vqmodel\.quant_conv\.weight' has shape \[16, 32\]; ggk reads "
                                            r"codebook_dim from it as a 4-D tensor"),
    ("vqmodel.quantize.embedding.weight", (16, 8), r"'vqmodel\.quantize\.embedding\.weight' has shape \[16, 8\], "
                                                   r"expected \[16, 16\]"),
])
def test_inconsistent_shapes_are_refused_by_tensor(sigvq_dir: Path, tmp_path: Path, name: str, shape: tuple,
                                                   message: str) -> None:
    folder = edit_checkpoint(sigvq_dir, tmp_path / "bad", lambda t: t.update({name: np.zeros(shape, np.float32)}))
    with pytest.raises(vision.VisionExportError, match=message):
        convert(folder, tmp_path / "v.gguf")


def test_hidden_size_must_fit_ggks_sixteen_heads(tmp_path: Path) -> None:
    shapes = vision.sigvq_tensor_shapes(hidden=24, intermediate=48, patch=16, pos_grid=2, codebook_size=4,
                                        codebook_dim=4, semantic_dim=8, blocks=1)
    (tmp_path / "h24").mkdir()
    save_file({k: np.zeros(v, np.float32) for k, v in shapes.items()}, str(tmp_path / "h24" / "model.safetensors"))
    with pytest.raises(vision.VisionExportError, match=r"hidden size 24 .* not a multiple of ggk's fixed 16"):
        convert(tmp_path / "h24", tmp_path / "v.gguf")


def test_values_beyond_f16(sigvq_dir: Path, tmp_path: Path) -> None:
    """A Linear weight stays F32 (ggk takes the file's type); a conv kernel is refused (ggk makes it f16)."""
    def big_linear(t: dict) -> None:
        t["visual.blocks.0.mlp.fc1.weight"][0, 0] = 1e5
    convert(edit_checkpoint(sigvq_dir, tmp_path / "lin", big_linear), tmp_path / "v.gguf")
    fc1 = next(t for t in GGUFReader(tmp_path / "v.gguf").tensors if t.name == "visual.blocks.0.mlp.fc1.weight")
    assert fc1.tensor_type == GGMLQuantizationType.F32 and float(fc1.data[0, 0]) == 1e5

    def big_conv(t: dict) -> None:
        t["visual.patch_embed.proj.weight"][0, 0, 0, 0] = 1e5
    with pytest.raises(vision.VisionExportError, match=r"'visual\.patch_embed\.proj\.weight' has \|value\| 100000 "
                                                       r"beyond the f16 range"):
        convert(edit_checkpoint(sigvq_dir, tmp_path / "conv", big_conv), tmp_path / "v2.gguf")


def test_no_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(vision.VisionExportError, match=r"no \*\.safetensors weights in .*empty"):
        convert(tmp_path / "empty", tmp_path / "v.gguf")


@pytest.mark.parametrize("enabled", [True, False])
def test_export_report_and_ggk_command_include_the_vision_gguf(sigvq_dir: Path, tmp_path: Path,
                                                                enabled: bool) -> None:
    # Imported here: test_export's helpers pull in the training code, which the other tests need not.
    from test_export import MATERIALS, fake_run, project
    from test_gguf_format import make_adapter

    ggk_dir = tmp_path / "ggk"
    paths, settings = project(tmp_path, also_copy_to=str(ggk_dir), export_vision_encoder=enabled)
    materials = dataclasses.replace(MATERIALS, vision_encoder={"source": "org/sigvq", "path": str(sigvq_dir),
                                                               "commit": "abc123"})
    sidecar = export.export_adapter(paths, settings, materials, fake_run(paths, make_adapter(0)))
    report = build_report(paths, settings, materials, sidecar, None, fingerprint="x")
    vision_file = paths.root / "output" / "adapter-vision.gguf"
    if not enabled:
        assert sidecar.vision is None and not vision_file.exists() and report.vision_gguf is None
        assert "--llm_vision" not in report.ggk_command
        return
    copy = ggk_dir / "adapter-vision.gguf"
    assert sidecar.vision["path"] == str(vision_file) and sidecar.vision["architecture"] == "sigvq"
    assert sidecar.vision["name"] == "adapter-vision" and sidecar.vision["commit"] == "abc123"
    assert copy.read_bytes() == vision_file.read_bytes()
    # Files inside the project are named relative to it; the copies elsewhere keep their absolute path.
    assert [f["path"] for f in report.files if f["role"] == "vision_encoder"] == ["output/adapter-vision.gguf",
                                                                                   str(copy)]
    assert {f["path"]: f["sha256"] for f in report.files}[str(copy)] == atomic.sha256_file(copy)
    assert report.vision_gguf == "output/adapter-vision.gguf"
    assert report.ggk_command.count("--llm_vision") == 1 and f"--llm_vision {copy} " in report.ggk_command
