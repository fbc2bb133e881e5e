"""materials.student as a GGUF file (ggk's --llm layout): converted once into a transformers Qwen3 folder.

The demo student is exported with the product's own writer (f16), and rewritten with its matrices in q8_0 (where a
row is a multiple of 32 wide) and bf16 (the others); the materials stage converts either back, and the folder runs
as the original within that rounding.
"""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gguf_assets.lib.materials.ggk_tokenizer import ggk_tokenizer_problem
from gguf_assets.lib.materials.hub import HubOptions
from gguf_assets.lib.materials.materials_run import MaterialsError, manifest_is_current
from gguf_assets.lib.materials.pinning.resolve import resolve_materials
from gguf_assets.lib.materials.student import from_gguf as sg
from gguf_assets.lib.materials.student.contract import student_contract_problem
from gguf_assets.lib.output.student_gguf import write_student_gguf
from gguf_assets.lib.project.settings import SettingsError, load_settings

TOKENIZER = "materials/demo/student"  # the demo student's folder, as the tokenizer's (relative to the project)


def _f16_gguf(demo_materials_root: Path, out: Path) -> Path:
    write_student_gguf(demo_materials_root / "student", out, name="pig_clip", source="demo", commit="local:demo")
    return out


def _rewrite(src: Path, out: Path, *, quantize: bool = False, drop: tuple[str, ...] = (),
             rename=lambda name: name) -> Path:
    """``src`` again, with its 2-D tensors in q8_0 (rows a multiple of 32 wide) or bf16 when ``quantize``."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), "qwen3")
    for t in reader.tensors:
        if t.name in drop:
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])
        if quantize and values.ndim == 2:
            qtype = Q.Q8_0 if values.shape[1] % 32 == 0 else Q.BF16
            writer.add_tensor(rename(t.name), gguf.quants.quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(rename(t.name), np.ascontiguousarray(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _hidden(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(input_ids=ids).last_hidden_state


def _ids(folder: Path) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return torch.tensor([tok.encode("a red cat sits on a small wooden table").ids])


def _project(make_project, student: Path, **materials):
    return make_project(materials={"student": str(student), "student_tokenizer": TOKENIZER, **materials})


def test_f16_gguf_student_is_converted_once_and_runs_as_the_original(make_project, demo_materials_root, tmp_path):
    student_gguf = _f16_gguf(demo_materials_root, tmp_path / "pig_clip-f16.gguf")
    paths = _project(make_project, student_gguf)
    settings = load_settings(paths.root)

    manifest = resolve_materials(paths, settings)

    folder = Path(manifest.student["path"])
    assert folder.parent == paths.materials_dir / sg.CONVERTED_DIR
    sha = manifest.student["gguf"]["file"]["sha256"]
    assert folder.name.startswith(sha[:16]) and manifest.student["commit"].startswith("local:")
    assert student_contract_problem(folder) is None and ggk_tokenizer_problem(folder) is None
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (48, 2, 2, 1, 96, 1000)
    assert config["tie_word_embeddings"] is True and config["pad_token_id"] == config["eos_token_id"] == 999
    ids = _ids(folder)
    original, converted = _hidden(demo_materials_root / "student", ids), _hidden(folder, ids)
    scale = original.abs().max().item()
    assert torch.allclose(converted, original, atol=2e-3 * scale, rtol=0)
    # The export writes the same student GGUF back, tensor for tensor.
    again = write_student_gguf(folder, tmp_path / "again.gguf", name="pig_clip", source="x", commit="y")
    first, second = gguf.GGUFReader(str(student_gguf)), gguf.GGUFReader(str(again["path"]))
    assert [t.name for t in first.tensors] == [t.name for t in second.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(first.tensors, second.tensors, strict=True))
    # Stored relative to the project; current until the file changes.
    stored = json.loads(paths.materials_manifest.read_text())["student"]
    assert stored["path"].startswith("materials/student-gguf/") and stored["gguf"]["path"] == str(student_gguf)
    assert manifest_is_current(paths, settings)

    # A rerun reuses the conversion: nothing is written again.
    weights = folder / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert resolve_materials(paths, settings).student["commit"] == manifest.student["commit"]
    assert weights.stat().st_mtime_ns == mtime

    # A changed GGUF (the same student in q8_0/bf16) is converted again, into a folder of its own.
    _rewrite(student_gguf, tmp_path / "q8.gguf", quantize=True).replace(student_gguf)
    assert not manifest_is_current(paths, settings)
    changed = resolve_materials(paths, settings)
    assert changed.student["commit"] != manifest.student["commit"]
    assert Path(changed.student["path"]) != folder and not folder.exists()
    assert manifest_is_current(paths, settings)


def test_q8_0_and_bf16_gguf_student_runs_as_the_original_within_rounding(make_project, demo_materials_root,
                                                                        tmp_path):
    f16 = _f16_gguf(demo_materials_root, tmp_path / "f16.gguf")
    q8 = _rewrite(f16, tmp_path / "pig_clip-q8_0.gguf", quantize=True)
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(q8)).tensors}
    assert {"Q8_0", "BF16", "F32"} <= types
    paths = _project(make_project, q8)

    folder = Path(resolve_materials(paths, load_settings(paths.root)).student["path"])

    record = json.loads((folder / sg.SOURCE_RECORD).read_text())
    assert record["stored_dtypes"] == {"BF16": record["gguf_types"]["BF16"],
                                       "F32": record["gguf_types"]["Q8_0"] + record["gguf_types"]["F32"]}
    ids = _ids(folder)
    original, converted = _hidden(demo_materials_root / "student", ids), _hidden(folder, ids)
    scale = original.abs().max().item()
    assert torch.allclose(converted, original, atol=1e-2 * scale, rtol=0)
    # Each stored tensor is exactly what gguf-py dequantizes (no second rounding).
    from safetensors.numpy import load_file

    stored = load_file(folder / "model.safetensors") if "BF16" not in record["stored_dtypes"] else None
    if stored is None:
        from safetensors.torch import load_file as load_torch

        stored = {k: v.float().numpy() for k, v in load_torch(folder / "model.safetensors").items()}
    for t in gguf.GGUFReader(str(q8)).tensors:
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(stored[t.name].shape)
        assert np.array_equal(stored[t.name], expected), t.name


def test_gguf_student_without_student_tokenizer_is_refused_at_load(make_project, demo_materials_root, tmp_path):
    student_gguf = _f16_gguf(demo_materials_root, tmp_path / "pig_clip-f16.gguf")
    paths = make_project(materials={"student": str(student_gguf)})
    line = next(i for i, text in enumerate(paths.project_file.read_text().splitlines(), 1)
                if text.strip().startswith("student:"))
    with pytest.raises(SettingsError) as err:
        load_settings(paths.root)
    assert str(err.value).startswith(f"{paths.project_file}:{line}: materials.student = ")
    assert "materials.student_tokenizer" in str(err.value)


def test_student_tokenizer_beside_a_model_folder_is_refused_at_load(make_project):
    paths = make_project(materials={"student_tokenizer": TOKENIZER})
    line = next(i for i, text in enumerate(paths.project_file.read_text().splitlines(), 1)
                if text.strip().startswith("student_tokenizer:"))
    with pytest.raises(SettingsError, match=f"^{paths.project_file}:{line}: materials.student_tokenizer = .* only"):
        load_settings(paths.root)


def test_gguf_without_the_final_norm_is_refused_naming_the_tensor(make_project, demo_materials_root, tmp_path):
    f16 = _f16_gguf(demo_materials_root, tmp_path / "f16.gguf")
    broken = _rewrite(f16, tmp_path / "no-norm.gguf", drop=("model.norm.weight",))
    paths = _project(make_project, broken)
    with pytest.raises(MaterialsError, match=f"{broken}: tensor model.norm.weight .* is missing"):
        resolve_materials(paths, load_settings(paths.root))
    assert not any((paths.materials_dir / sg.CONVERTED_DIR).glob("*"))  # nothing half-written is left


def test_gguf_that_is_not_ggks_qwen3_is_refused(demo_materials_root, tmp_path):
    f16 = _f16_gguf(demo_materials_root, tmp_path / "f16.gguf")
    llama = _rewrite(f16, tmp_path / "llama.gguf",
                     rename=lambda n: n.replace("model.embed_tokens", "token_embd").replace("model.", "blk."))
    with pytest.raises(sg.StudentGgufError, match="llama.cpp's names"):
        sg.read_student_gguf(llama)
    short = _rewrite(f16, tmp_path / "short.gguf", drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(sg.StudentGgufError, match=f"{short}: tensor model.layers.1.mlp.up_proj.weight is missing"):
        sg.read_student_gguf(short)
    # q_proj 192 rows: 1.5 heads of 128.
    writer = gguf.GGUFWriter(str(tmp_path / "head.gguf"), "qwen3")
    for t in gguf.GGUFReader(str(f16)).tensors:
        data = np.array(t.data)
        writer.add_tensor(t.name, data[:192] if t.name.endswith("q_proj.weight") else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(sg.StudentGgufError, match="q_proj.weight has 192 rows, not a multiple of 128.*head dim"):
        sg.read_student_gguf(tmp_path / "head.gguf")


def test_missing_gguf_and_tokenizer_folder_without_tokenizer_json(make_project, demo_materials_root, tmp_path):
    paths = _project(make_project, tmp_path / "absent.gguf")
    with pytest.raises(MaterialsError, match="no such file .*a hub-hosted GGUF is not fetched"):
        resolve_materials(paths, load_settings(paths.root))
    f16 = _f16_gguf(demo_materials_root, tmp_path / "f16.gguf")
    (tmp_path / "empty").mkdir()
    paths = _project(make_project, f16, student_tokenizer=str(tmp_path / "empty"))
    with pytest.raises(MaterialsError, match="materials.student_tokenizer = .* has no tokenizer.json"):
        resolve_materials(paths, load_settings(paths.root))


def test_student_tokenizer_from_a_hub_repo_fetches_only_its_tokenizer(make_project, loopback_hub, demo_materials_root,
                                                                       tmp_path):
    loopback_hub.add_repo("org/student-src", demo_materials_root / "student")  # weights and all
    student_gguf = _f16_gguf(demo_materials_root, tmp_path / "pig_clip-f16.gguf")
    paths = _project(make_project, student_gguf, student_tokenizer="org/student-src")
    settings = load_settings(paths.root)
    fast = HubOptions(api_timeout_s=5, stall_timeout_s=5, attempts=2, retry_wait_s=0.05, disk_reserve_bytes=0)

    manifest = resolve_materials(paths, settings, hub_options=fast)

    tok = manifest.student["gguf"]["tokenizer"]
    assert tok["origin"] == "hub" and tok["commit"] == loopback_hub.head("org/student-src")
    assert sorted(Path(tok["path"]).iterdir()) == sorted(Path(tok["path"]) / n for n in (
        "generation_config.json", "tokenizer.json", "tokenizer_config.json"))
    assert not any(r["path"].endswith(".safetensors") for r in loopback_hub.requests)
    assert ggk_tokenizer_problem(Path(manifest.student["path"])) is None
    assert [d["role"] for d in manifest.downloads] == ["student_tokenizer"]
    # Pinned: a rerun asks the hub nothing.
    assert manifest_is_current(paths, settings)
    before = len(loopback_hub.requests)
    again = resolve_materials(paths, settings, hub_options=fast)
    assert again.student["commit"] == manifest.student["commit"] and len(loopback_hub.requests) == before


def test_estimate_sizes_a_gguf_student_from_its_own_header_before_the_first_run(make_project, demo_materials_root,
                                                                                tmp_path):
    from gguf_assets.lib.planning.estimate import estimate

    student_gguf = _f16_gguf(demo_materials_root, tmp_path / "pig_clip-f16.gguf")
    paths = _project(make_project, student_gguf)
    lines = {line.part: line for line in estimate(paths, load_settings(paths.root), ask_hub=False)}
    student = lines["student"]
    assert student.gib is not None and "from the header of pig_clip-f16.gguf" in student.how, student.how
    assert "config.json" not in student.how
    # The same size the converted folder gives once the materials step has run.
    resolve_materials(paths, load_settings(paths.root))
    after = {line.part: line for line in estimate(paths, load_settings(paths.root), ask_hub=False)}["student"]
    assert after.gib == pytest.approx(student.gib, rel=0.05), (after.how, student.how)
