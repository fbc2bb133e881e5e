"""Export (metadata completeness, the folded standardization, the student GGUF and tokenizer pack beside the
adapter, names, output folder, verified copies), the numpy-vs-torch agreement carried in report.json, the report
and its ggk command, and the exact-bytes golden file."""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType
from safetensors.torch import save_file
from test_gguf_format import SHAPE, f16_rounded, make_adapter, save_shard, torch_predict, write_shard

from gguf_assets.lib.core import atomic, metrics
from gguf_assets.lib.core.f16 import F16_MAX
from gguf_assets.lib.core.ggk_contract import GGK_COMMAND, STUDENT_HEAD_DIM, TOKENIZER_PACK_MERGES, USER_FILES
from gguf_assets.lib.materials.ggk_tokenizer import ggk_tokenizer_problem, tokenizer_from_merges
from gguf_assets.lib.materials.student.contract import student_contract_problem
from gguf_assets.lib.output import export, gguf_eval, gguf_format
from gguf_assets.lib.output.checkpoint_outputs import checkpoint_outputs
from gguf_assets.lib.output.report import build_report, ggk_command, score_rows
from gguf_assets.lib.project.layout import FINAL_DIR, META_FILE, REPORT_JSON, REPORT_MD, WEIGHTS_FILE, ProjectPaths
from gguf_assets.lib.project.manifests import ExportSidecar, MaterialsManifest, Report
from gguf_assets.lib.project.settings import Settings, replace
from gguf_assets.lib.training import train
from gguf_assets.lib.training.input_peaks import INPUT_PEAKS, measure_peaks, peaks_record, recorded_peaks
from gguf_assets.lib.training.verdict import GOOD

GOLDEN = Path(__file__).parents[2] / "golden" / "tiny_adapter.gguf"
REGEN_ENV = "GGUF_GOLDEN_REGEN"  # set to 1 to rewrite the golden file after a deliberate format change

# A tiny byte-level BPE numbered as ggk numbers it (256 byte symbols, then one id per merge, then the special).
TINY_MERGES = [("Ġ", "a"), ("c", "a"), ("ca", "t"), ("Ġ", "cat"), ("d", "o"), ("do", "g"), ("Ġ", "dog"),
               ("r", "e"), ("Ġ", "re"), ("Ġre", "d"), ("b", "l"), ("bl", "u"), ("blu", "e"), ("Ġ", "blue"),
               ("i", "m"), ("im", "a"), ("ima", "g"), ("imag", "e")]
TINY_SPECIALS = ["<|endoftext|>"]


def _tiny_student() -> Path:
    """A tiny Qwen3 student ggk runs as transformers does (head dim 128, RMSNorm eps 1e-6, rope theta 1e6), its
    hidden size the adapter's in_dim, with a tokenizer.json in ggk's numbering; built once per test process, in a
    folder whose name holds a space (the report quotes it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="tiny student "))
    atexit.register(shutil.rmtree, folder, True)
    tokenizer = tokenizer_from_merges(TINY_MERGES, specials=TINY_SPECIALS)
    config = Qwen3Config(vocab_size=tokenizer.get_vocab_size(), hidden_size=SHAPE.student_dim, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=STUDENT_HEAD_DIM,
                         intermediate_size=2 * SHAPE.student_dim, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, initializer_range=0.1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


STUDENT_DIR = _tiny_student()
MATERIALS = MaterialsManifest(
    student={"source": "org/student", "commit": "0123abcd" * 5, "path": str(STUDENT_DIR)},
    teacher={"source": "org/teacher", "commit": "fedc9876" * 5, "path": "/models/teacher"},
)


def fake_run(paths: ProjectPaths, adapter: torch.nn.Module, *, val_folders: list[Path] | None = None,
             step: int = 321) -> dict:
    """A finished training run in the layout checkpoints.load_final reads; returns the adapter manifest.

    The scores in meta.json are the torch checkpoint's own, measured by train.evaluate.
    """
    run_rel = "checkpoints/fp-test"
    final = paths.root / run_rel / FINAL_DIR
    final.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in adapter.state_dict().items()}, str(final / WEIGHTS_FILE))
    meta = {"shape": adapter.shape.to_dict(), "step": step, "fingerprint": "fp-test", "val_centred_cosine": 0.5,
            "empty_prompt_cosine": None, "per_shard": []}
    if val_folders:
        scores = train.evaluate(adapter, val_folders, device=torch.device("cpu"), cosine_weight=0.5)
        meta.update({k: scores[k] for k in ("val_centred_cosine", "empty_prompt_cosine", "per_shard")})
    atomic.write_json(final / META_FILE, meta)
    return {"run_dir": run_rel, "fingerprint": "fp-test"}


def project(tmp_path: Path, **output) -> tuple[ProjectPaths, Settings]:
    settings = replace(Settings(), materials={"teacher_layer": 12}, training={"seed": 11, "steps": 900},
                       output=output)
    return ProjectPaths.of(tmp_path / "proj"), settings


def test_the_tiny_student_meets_ggks_contract() -> None:
    """What the export's student and tokenizer-pack steps need: otherwise every export test below fails early."""
    assert student_contract_problem(STUDENT_DIR) is None
    assert ggk_tokenizer_problem(STUDENT_DIR) is None


# --- metadata -------------------------------------------------------------------------


def test_exported_metadata_is_complete_and_typed(tmp_path: Path) -> None:
    paths, settings = project(tmp_path)
    adapter = make_adapter(0)
    sidecar = export.export_adapter(paths, settings, MATERIALS, fake_run(paths, adapter))
    path = Path(sidecar.path)
    assert path == paths.root / "output" / "adapter.gguf"  # output_dir defaults to <project>/output
    fields = {k: f for k, f in GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    S, U32, I64, F32, F64 = (GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.INT64, GGUFValueType.FLOAT32,
                             GGUFValueType.FLOAT64)
    expected = {
        "general.architecture": (S, "llm_adapter"), "general.name": (S, "adapter"),
        "adapter.format_version": (U32, 3), "adapter.variant": (S, "resampler"),
        "adapter.in_dim": (U32, SHAPE.student_dim), "adapter.out_dim": (U32, SHAPE.target_dim),
        "adapter.width": (U32, SHAPE.width), "adapter.depth": (U32, SHAPE.depth), "adapter.heads": (U32, 2),
        "adapter.head_dim": (U32, 64), "adapter.query_count": (U32, SHAPE.query_rows),
        "adapter.mlp_hidden": (U32, 4 * SHAPE.width), "adapter.layer_norm_epsilon": (F32, pytest.approx(1e-5)),
        "adapter.conditioning": (S, "llada-image"),
        "adapter.student.repo": (S, "org/student"), "adapter.student.commit": (S, "0123abcd" * 5),
        "adapter.student.hidden_size": (I64, SHAPE.student_dim), "adapter.student.gguf": (S, "adapter-student.gguf"),
        "adapter.teacher.repo": (S, "org/teacher"), "adapter.teacher.commit": (S, "fedc9876" * 5),
        "adapter.teacher.layer": (I64, 12),
        "adapter.training.steps": (I64, 321), "adapter.training.planned_steps": (I64, 900),
        "adapter.training.checkpoint": (S, "final"), "adapter.training.seed": (I64, 11),
        "adapter.training.val_centred_cosine": (F64, 0.5),
        "adapter.training.fingerprint": (S, "fp-test"), "adapter.trainer": (S, export.TRAINER),
    }
    for key, (vtype, value) in expected.items():
        assert key in fields, key
        assert fields[key].types == [vtype], (key, fields[key].types)
        assert fields[key].contents() == value, key
    assert set(fields) == set(expected)
    assert export.TRAINER.startswith("gguf_assets ")
    assert set(gguf_format.REQUIRED_PROVENANCE) <= {k.removeprefix("adapter.") for k in fields}
    assert sidecar.provenance == gguf_format.provenance_from_metadata(gguf_format.read_gguf_metadata(path))
    assert (sidecar.architecture, sidecar.format_version, sidecar.name) == ("llm_adapter", 3, "adapter")
    # docs/gguf_layout.md's tables are generated from gguf_format's: they list exactly what an export writes, in
    # its order, with its types.
    assert written_keys(fields) == documented_keys()


# The keys only a file whose query rows are a material of their own (materials.query_rows) holds.
QUERY_ROWS_ONLY = {f"adapter.{k}" for k in gguf_format.PROVENANCE_HELP if k.startswith("query_rows.")}


def documented_keys(*, query_rows_material: bool = False) -> list[tuple[str, str]]:
    """(key, type) of docs/gguf_layout.md's generated tables that an export holds, in order."""
    fixed, provenance = gguf_format.metadata_key_rows()
    left_out = set() if query_rows_material else QUERY_ROWS_ONLY
    return [(row[0].strip("`"), row[1]) for row in (*fixed, *provenance) if row[0].strip("`") not in left_out]


def written_keys(fields) -> list[tuple[str, str]]:
    return [(key, fields[key].types[0].name) for key in fields if key != "general.file_type"]


@pytest.mark.parametrize("key", sorted(gguf_format.REQUIRED_PROVENANCE))
def test_missing_required_provenance_is_refused(tmp_path: Path, key: str) -> None:
    from test_gguf_format import PROVENANCE, write

    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        write(tmp_path / "x.gguf", make_adapter(), provenance={k: v for k, v in PROVENANCE.items() if k != key})
    assert not (tmp_path / "x.gguf").exists()


def test_wrongly_typed_provenance_is_refused(tmp_path: Path) -> None:
    from test_gguf_format import PROVENANCE, write

    for bad, match in (({"training.steps": 12.0}, "FLOAT64.*INT64"), ({"student.commit": 7}, "INT64.*STRING"),
                       ({"training.planned_steps": "900"}, "STRING.*INT64"),
                       ({"student.hidden_size": SHAPE.student_dim + 1}, "in_dim"),
                       ({"training.val_centred_cosine": 1.5}, "not a cosine")):
        with pytest.raises(ValueError, match=match):
            write(tmp_path / "x.gguf", make_adapter(), provenance={**PROVENANCE, **bad})
    assert list(tmp_path.iterdir()) == []


# --- what the export writes -----------------------------------------------------------


def test_export_folds_the_standardization_so_the_file_gives_targets(tmp_path: Path) -> None:
    """ggk has no tensor for the standardization: the file's out_proj gives targets directly, so its forward is
    to_target_space of the torch model's, and the training statistics are not in the file."""
    paths, settings = project(tmp_path)
    adapter = make_adapter(5)
    assert float((adapter.target_std - 1).abs().min()) > 1e-3 and float(adapter.target_mean.abs().max()) > 0.5
    sidecar = export.export_adapter(paths, settings, MATERIALS, fake_run(paths, adapter))
    tensors = gguf_format.read_gguf_tensors(Path(sidecar.path))
    assert not any(name.removeprefix("adapter.") in gguf_format.TRAINING_ONLY for name in tensors)
    std, mean = adapter.target_std.detach().numpy(), adapter.target_mean.detach().numpy()
    weight, bias = adapter.out_proj.weight.detach().numpy(), adapter.out_proj.bias.detach().numpy()
    np.testing.assert_array_equal(tensors["adapter.out_proj.weight"], (weight * std[:, None]).astype(np.float16))
    np.testing.assert_allclose(tensors["adapter.out_proj.bias"], bias * std + mean, rtol=1e-6, atol=1e-6)
    # Every other tensor is the checkpoint's own.
    np.testing.assert_array_equal(tensors["adapter.in_proj.weight"],
                                  adapter.in_proj.weight.detach().numpy().astype(np.float16))
    np.testing.assert_array_equal(tensors["adapter.query"], adapter.query.detach().numpy())

    loaded = gguf_eval.load_adapter_gguf(Path(sidecar.path))
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randn(n, SHAPE.student_dim, generator=gen) for n in (6, 3)]
    reference = f16_rounded(adapter)
    targets = reference.to_target_space(torch_predict(reference, prompts)).numpy()
    standardized = torch_predict(reference, prompts).numpy()
    for i, p in enumerate(prompts):
        got = loaded.forward(p.numpy())
        assert np.abs(got - targets[i]).max() < 1e-4
        assert np.abs(got - standardized[i]).max() > 0.1  # an unfolded file would be this far off
    # and against the unrounded torch model, within f16's error
    exact = adapter.to_target_space(torch_predict(adapter, prompts)).numpy()
    assert max(np.abs(loaded.forward(p.numpy()) - exact[i]).max() for i, p in enumerate(prompts)) < 2e-2


def test_export_writes_the_student_gguf_and_the_tokenizer_pack(tmp_path: Path) -> None:
    paths, settings = project(tmp_path)
    sidecar = export.export_adapter(paths, settings, MATERIALS, fake_run(paths, make_adapter(0)))
    out = paths.root / "output"
    student, merges = out / "adapter-student.gguf", out / "adapter-tokenizer" / TOKENIZER_PACK_MERGES
    assert [(f["role"], f["path"]) for f in sidecar.files] == [
        ("adapter", str(out / "adapter.gguf")), ("student", str(student)), ("tokenizer_pack", str(merges))]
    for entry in sidecar.files:
        assert entry["sha256"] == atomic.sha256_file(Path(entry["path"]))
        assert entry["bytes"] == Path(entry["path"]).stat().st_size
    metadata = gguf_format.read_gguf_metadata(student)
    assert metadata["general.architecture"] == "qwen3" and metadata["general.name"] == "adapter-student"
    assert metadata["gguf_assets.student.commit"] == MATERIALS.student["commit"]
    tensor_names = set(gguf_format.read_gguf_tensors(student))
    assert "model.embed_tokens.weight" in tensor_names and "model.norm.weight" in tensor_names
    assert sidecar.provenance["student.gguf"] == student.name
    # ggk rebuilds the tokenizer from the merges alone: one merge a line, in the tokenizer.json's order.
    assert merges.read_text(encoding="utf-8") == "".join(f"{a} {b}\n" for a, b in TINY_MERGES)
    spec = json.loads((STUDENT_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    assert len(spec["model"]["merges"]) == len(TINY_MERGES)
    assert sorted(p.name for p in out.iterdir()) == ["adapter-student.gguf", "adapter-tokenizer", "adapter.gguf",
                                                     "adapter.json"]


# --- names, folders, copies -----------------------------------------------------------


@pytest.mark.parametrize("name", ["../escape", "a/b", "a\\b", "..", ".", "", "  ", "x\0y"])
def test_export_refuses_unsafe_adapter_names(tmp_path: Path, name: str) -> None:
    # replace() skips settings validation, as a hand-built Settings would.
    paths, settings = project(tmp_path, adapter_name=name)
    manifest = fake_run(paths, make_adapter(0))
    with pytest.raises(export.ExportError, match="output.adapter_name"):
        export.export_adapter(paths, settings, MATERIALS, manifest)
    assert not (paths.root / "output").exists() and not (tmp_path / "escape.gguf").exists()


def test_also_copy_to_copies_every_file_verified_and_a_failed_copy_keeps_the_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ggk_dir = tmp_path / "ggk models"
    paths, settings = project(tmp_path, also_copy_to=str(ggk_dir), output_dir="out")
    sidecar = export.export_adapter(paths, settings, MATERIALS, fake_run(paths, make_adapter(0)))
    out = paths.root / "out"
    assert Path(sidecar.path) == out / "adapter.gguf"
    # Each file keeps its place: the tokenizer pack is still a folder holding qwen2/merges.txt.
    copies = [ggk_dir / "adapter.gguf", ggk_dir / "adapter-student.gguf", ggk_dir / "adapter-tokenizer" / "qwen2" /
              "merges.txt"]
    assert TOKENIZER_PACK_MERGES == "qwen2/merges.txt"
    assert sidecar.copies == [str(c) for c in copies]
    originals = [out / c.relative_to(ggk_dir) for c in copies]
    for copy, original in zip(copies, originals):
        assert copy.read_bytes() == original.read_bytes(), copy
    assert [f["role"] for f in sidecar.files] == ["adapter", "student", "tokenizer_pack"] * 2
    for copy, original, entry in zip(copies, originals, sidecar.files[3:]):
        assert entry == {"role": entry["role"], "path": str(copy), "bytes": copy.stat().st_size,
                         "mtime_ns": copy.stat().st_mtime_ns, "inode": copy.stat().st_ino,
                         "sha256": atomic.sha256_file(copy), "copy_of": str(original)}
    good = {c: c.read_bytes() for c in copies}

    real_copy = shutil.copyfile

    def corrupting_copy(src, dst):  # a disk that flips a byte on the way
        real_copy(src, dst)
        with open(dst, "r+b") as fh:
            fh.seek(100)
            byte = fh.read(1)
            fh.seek(100)
            fh.write(bytes([byte[0] ^ 0x01]))

    monkeypatch.setattr(shutil, "copyfile", corrupting_copy)
    (paths.root / "checkpoints").rename(tmp_path / "old-run")
    with pytest.raises(OSError, match="sha256"):
        export.export_adapter(paths, settings, MATERIALS, fake_run(paths, make_adapter(1)))
    assert {c: c.read_bytes() for c in copies} == good
    # no temp file left behind
    assert sorted(str(p.relative_to(ggk_dir)) for p in ggk_dir.rglob("*")) == [
        "adapter-student.gguf", "adapter-tokenizer", "adapter-tokenizer/qwen2", "adapter-tokenizer/qwen2/merges.txt",
        "adapter.gguf"]
    # The sidecar still describes the old export, so the stage is not mistaken for done.
    assert atomic.read_json(out / "adapter.json")["sha256"] == sidecar.sha256


def test_a_changed_export_or_a_copy_shared_with_another_project_is_not_current(tmp_path: Path, caplog) -> None:
    """Exported files are checked by stamp: a same-size bit flip (new mtime) or another project
    writing the same also_copy_to file makes the export not current, and the export says so."""
    from gguf_assets.lib.output.export_run import exported_files_unchanged

    shared = tmp_path / "ggk models"
    first_paths, settings = project(tmp_path, also_copy_to=str(shared))
    export.export_adapter(first_paths, settings, MATERIALS, fake_run(first_paths, make_adapter(0)))
    assert exported_files_unchanged(first_paths, settings)

    for changed in ("adapter.gguf", "adapter-tokenizer/qwen2/merges.txt"):
        target = first_paths.root / "output" / changed
        data = bytearray(target.read_bytes())
        data[-7] ^= 0x01
        target.write_bytes(bytes(data))
        assert not exported_files_unchanged(first_paths, settings), changed
        export.export_adapter(first_paths, settings, MATERIALS, {"run_dir": "checkpoints/fp-test",
                                                                  "fingerprint": "fp-test"})
        assert exported_files_unchanged(first_paths, settings), changed

    second_paths = ProjectPaths.of(tmp_path / "second")
    with caplog.at_level("WARNING", logger="gguf_assets"):
        export.export_adapter(second_paths, settings, MATERIALS, fake_run(second_paths, make_adapter(1)))
    assert f"replacing {shared / 'adapter.gguf'}, which this project's last export did not write" in caplog.text
    # Every copied file warns, each naming the adapter_name the two projects share.
    assert caplog.text.count("another project with output.adapter_name 'adapter' copies there too?") == 3
    assert not exported_files_unchanged(first_paths, settings)  # its copy now holds the second's tensors


def test_a_killed_exports_temp_files_go_from_every_folder_it_writes_and_only_ours(tmp_path: Path) -> None:
    ggk_dir = tmp_path / "ggk models"
    paths, settings = project(tmp_path, also_copy_to=str(ggk_dir))
    out = paths.root / "output"
    ours = [out / ".tmp-adapter.gguf.a1", out / ".tmp-adapter-student.gguf.a2",
            out / "adapter-tokenizer" / "qwen2" / ".tmp-merges.txt.a3", ggk_dir / ".tmp-adapter.gguf.a4",
            ggk_dir / "adapter-tokenizer" / "qwen2" / ".tmp-merges.txt.a5"]
    others = [out / ".tmp-other.gguf.b1", ggk_dir / "adapter-tokenizer" / "qwen2" / ".tmp-vocab.json.b2"]
    for temp in ours + others:
        temp.parent.mkdir(parents=True, exist_ok=True)
        temp.write_bytes(b"left by a killed writer")
    export.export_adapter(paths, settings, MATERIALS, fake_run(paths, make_adapter(0)))
    assert [t for t in ours if t.exists()] == []
    assert all(t.exists() for t in others)  # a shared folder's other temps are not ours to remove


def test_projects_sharing_an_output_dir_keep_their_reports_apart(tmp_path: Path) -> None:
    """Each adapter's report is <adapter_name>.report.json/.md; report.json is the folder's latest."""
    shared = tmp_path / "shared out"
    reports = {}
    for name, seed in (("first", 0), ("second", 1)):
        paths, settings = project(tmp_path / name, output_dir=str(shared), adapter_name=name)
        sidecar = export.export_adapter(paths, settings, MATERIALS, fake_run(paths, make_adapter(seed)))
        reports[name] = build_report(paths, settings, MATERIALS, sidecar, None, fingerprint=f"fp-{name}")
        assert paths.report_json(settings) == shared / f"{name}.report.json"
    for name, report in reports.items():
        assert atomic.read_json(shared / f"{name}.report.json") == report.to_json()
        md = (shared / f"{name}.report.md").read_text(encoding="utf-8")
        assert f"{name}.gguf" in md and f"{name}-student.gguf" in md and f"{name}-tokenizer" in md
        assert report.ggk_files["student"] == str(shared / f"{name}-student.gguf")
    assert atomic.read_json(shared / REPORT_JSON) == reports["second"].to_json()
    assert reports["first"].gguf_sha256 != reports["second"].gguf_sha256


def test_ggk_command_fills_and_quotes_placeholders() -> None:
    dit, vae = (shlex.quote(USER_FILES[k]) for k in ("dit_gguf", "vae_gguf"))
    assert dit == "'<your LLaDA-Image DiT .gguf>'"  # a placeholder to replace, quoted so a shell keeps it whole
    full = ggk_command(GGK_COMMAND, student_gguf="/o/s t.gguf", adapter_gguf="/o/a.gguf", vision_gguf="/o/v.gguf",
                       tokenizer_pack="/o/pack dir")
    assert full == (f"ggk diffuser engine -- --diffusion-model {dit} --vae {vae} --llm '/o/s t.gguf' "
                    "--llm-adapter /o/a.gguf --llm_vision /o/v.gguf --tokenizer-pack '/o/pack dir' -p \"a cat\"")
    assert shlex.split(full)[8:10] == ["--llm", "/o/s t.gguf"]
    # A file the project did not make drops its flag with it.
    assert ggk_command(GGK_COMMAND, student_gguf="/s", adapter_gguf="/a", vision_gguf=None, tokenizer_pack=None) == (
        f"ggk diffuser engine -- --diffusion-model {dit} --vae {vae} --llm /s --llm-adapter /a -p \"a cat\"")
    assert ggk_command("ggk --llm_vision={vision_gguf} --llm {student_gguf}", student_gguf="/s", adapter_gguf="/a",
                       vision_gguf=None, tokenizer_pack=None) == "ggk --llm /s"
    # {student}, the name earlier versions used, is the student GGUF; a path holding a placeholder is not refilled.
    assert ggk_command("ggk --llm {student} --llm-adapter {adapter_gguf}", student_gguf="/x/{adapter_gguf}",
                       adapter_gguf="/a", vision_gguf="/v", tokenizer_pack="/p") == \
        "ggk --llm '/x/{adapter_gguf}' --llm-adapter /a"


# --- evaluation and report ------------------------------------------------------------


def test_numpy_evaluation_agrees_with_torch_and_report_carries_both(tmp_path: Path) -> None:
    paths, settings = project(tmp_path)
    adapter = make_adapter(2)
    shards = []
    for i, n in enumerate((7, 6)):
        folder = paths.root / "shards" / "val" / f"{i:05d}"
        texts = [f"prompt {i}-{j} | with a pipe" for j in range(n - 1)] + [""]
        write_shard(folder, adapter=adapter, texts=texts, lengths=[1 + (j * 5) % 9 for j in range(n - 1)] + [2],
                    targets_dtype=torch.float32, hidden_dtype=torch.float32, seed=20 + i)
        shards.append(folder)
    manifest = fake_run(paths, adapter, val_folders=shards)
    sidecar = export.export_adapter(paths, settings, MATERIALS, manifest)
    centre = gguf_eval.training_centre(paths.root / manifest["run_dir"] / FINAL_DIR / WEIGHTS_FILE)
    evaluation = gguf_eval.evaluate_gguf(Path(sidecar.path), shards, centre,
                                         checkpoint=checkpoint_outputs(paths.root / manifest["run_dir"]))
    report = build_report(paths, settings, MATERIALS, sidecar, evaluation, fingerprint="fp-report")

    on_disk = atomic.read_json(paths.root / "output" / REPORT_JSON)
    assert on_disk == report.to_json()
    assert 0.2 < report.val_centred_cosine < 0.99
    # f16 GGUF read by numpy vs the f32 torch checkpoint: the 1e-3 bound.
    assert abs(report.val_centred_cosine - report.val_centred_cosine_torch) < 1e-3
    assert report.gguf_vs_torch == pytest.approx(abs(report.val_centred_cosine -
                                                     report.val_centred_cosine_torch))
    assert abs(report.empty_prompt_cosine - report.empty_prompt_cosine_torch) < 1e-3
    assert [s["shard"] for s in report.per_shard] == ["00000", "00001"]
    for row in report.per_shard:
        assert abs(row["val_centred_cosine"] - row["val_centred_cosine_torch"]) < 1e-3
    assert len(report.worst) == 10 and report.n_prompts == 13
    assert [w["cosine"] for w in report.worst] == sorted(w["cosine"] for w in report.worst)
    # The other scores, the GGUF's, in the raw target space; the torch checkpoint's outputs agree with the GGUF's.
    for key in (metrics.VAL_REL_MSE, metrics.VAL_RMS_COSINE, metrics.WORST_ROW, metrics.WORST_ROW_COSINE,
                *metrics.RETRIEVAL_KEYS):
        assert on_disk[key] == evaluation[key] is not None, key
    assert report.val_retrieval_prompts == 11  # the two empty prompts are one prompt, the CFG's: left out
    assert 0 < report.val_rel_mse < 2 and -1 <= report.worst_row_cosine < report.val_centred_cosine
    assert report.worst_row in range(SHAPE.query_rows) and isinstance(on_disk["worst_row"], int)
    agree = report.gguf_vs_checkpoint
    assert on_disk[metrics.GGUF_VS_CHECKPOINT] == agree and set(agree) == set(metrics.AGREEMENT_KEYS)
    assert 0.999 < agree[metrics.MIN_ROW_COSINE] <= agree[metrics.MEAN_ROW_COSINE] <= 1.0
    assert 0 < agree[metrics.MAX_ABS_DIFF_RELATIVE] < 1e-2
    # Paths inside the project are stored relative to it, so a copied project is independent.
    files = {"adapter": "output/adapter.gguf", "student": "output/adapter-student.gguf",
             "tokenizer_pack": "output/adapter-tokenizer/qwen2/merges.txt"}
    assert report.files == [{"role": role, "path": path, "bytes": (paths.root / path).stat().st_size,
                             "sha256": atomic.sha256_file(paths.root / path)} for role, path in files.items()]
    assert report.ggk_files == {"adapter": "output/adapter.gguf", "vision_encoder": None,
                                "student": "output/adapter-student.gguf", "tokenizer_pack": "output/adapter-tokenizer"}
    assert report.ggk_command == (
        "ggk diffuser engine -- --diffusion-model '<your LLaDA-Image DiT .gguf>' --vae '<your LLaDA-Image VAE .gguf>'"
        " --llm output/adapter-student.gguf --llm-adapter output/adapter.gguf --tokenizer-pack output/adapter-tokenizer"
        " -p \"a cat\"")
    assert report.vision_gguf is None
    assert report.student == {"repo": "org/student", "commit": "0123abcd" * 5, "path": str(STUDENT_DIR), "layer": -1}

    # The rows say which way each score is better, which number is relative, and which GGUF-vs-checkpoint row
    # compares scores and which outputs (#65).
    rows = score_rows(report)
    assert all("higher is better" in measure or "lower is better" in measure for measure, _ in rows[:-1]), rows
    assert [measure.split(":")[0] for measure, _ in rows if measure.startswith("GGUF")] == [
        "GGUF vs torch checkpoint, scores", "GGUF vs torch checkpoint, outputs", "GGUF vs torch checkpoint, outputs"]
    assert rows[-2][1] == f"{agree[metrics.MAX_ABS_DIFF]:.2e} ({agree[metrics.MAX_ABS_DIFF_RELATIVE]:.2%} of their RMS)"
    md = (paths.root / "output" / REPORT_MD).read_text(encoding="utf-8")
    for needle in (f"| {report.val_rel_mse:.4f} |", f"| {report.val_rms_cosine:.4f} |",
                   f"| row {report.worst_row}: {report.worst_row_cosine:.4f} |",
                   f"| {agree[metrics.MIN_ROW_COSINE]:.6f} / {agree[metrics.MEAN_ROW_COSINE]:.6f} |",
                   "raw target space"):
        assert needle in md, needle
    # A report from before these scores still reads, and shows them as n/a.
    older = Report.from_json({k: v for k, v in on_disk.items() if k not in (
        metrics.VAL_REL_MSE, metrics.VAL_RMS_COSINE, metrics.WORST_ROW, metrics.WORST_ROW_COSINE,
        metrics.GGUF_VS_CHECKPOINT, *metrics.RETRIEVAL_KEYS)})
    assert older.val_rel_mse is None and older.gguf_vs_checkpoint is None and older.val_retrieval_top1 is None
    assert [value for measure, value in score_rows(older) if measure.startswith("GGUF vs torch checkpoint, outputs")] \
        == ["n/a"] * 2
    assert [value for measure, value in score_rows(older) if measure.startswith("prompt retrieval")] == ["n/a"] * 3
    for needle in ("## Exported files", "## Use it in ggk", "### Per shard", "### The 10 worst val prompts",
                   report.gguf_sha256, report.ggk_command, report.verdict, "`org/student`", "`--tokenizer-pack`",
                   "`--llm-adapter`", "`output/adapter-student.gguf`", USER_FILES["dit_gguf"]):
        assert needle in md, needle
    assert "\\| with a pipe" in md  # a pipe in a prompt must not break the table


def test_a_prompt_blind_adapter_is_refused_good_by_retrieval_at_a_cosine_above_the_bar(tmp_path: Path) -> None:
    """An adapter that ignores the prompt (its cross-attention cut: one output for every prompt) on a teacher whose
    targets mostly lean one way from their mean (a few lean far the other way, so the mean stays the centre): its
    centred cosine passes 0.9, since centred cosine scores what the prompts share, but retrieval is at chance, and
    the report refuses "Good" and says why."""
    paths, settings = project(tmp_path)
    blind = make_adapter(5)
    with torch.no_grad():
        for block in blind.blocks:
            block.cross_attn.o.weight.zero_()
            block.cross_attn.o.bias.zero_()
    gen = torch.Generator().manual_seed(3)
    n = 60
    prompts = [torch.randn(1 + i % 7, SHAPE.student_dim, generator=gen) for i in range(n)]
    centre = blind.target_centre
    lean = blind.to_target_space(torch_predict(blind, prompts[:1]))[0].detach() - centre
    sign = torch.tensor([1.0] * (n - 2) + [-(n - 2) / 2] * 2)  # sums to 0: the targets' mean is the centre
    spread = torch.randn(n, SHAPE.query_rows, SHAPE.target_dim, generator=gen) * lean.std() * 0.1
    targets = centre + sign[:, None, None] * lean + (spread - spread.mean(0))
    folder = paths.root / "shards" / "val" / "00000"
    save_shard(folder, texts=[f"prompt {i}" for i in range(n)], prompts=prompts, targets=targets)
    manifest = fake_run(paths, blind)
    sidecar = export.export_adapter(paths, settings, MATERIALS, manifest)
    evaluation = gguf_eval.evaluate_gguf(Path(sidecar.path), [folder], centre.numpy().copy())
    report = build_report(paths, settings, MATERIALS, sidecar, evaluation, fingerprint="fp-report")

    assert report.val_centred_cosine >= GOOD, report.val_centred_cosine
    assert report.val_retrieval_prompts == n and report.val_retrieval_top1 <= 1 / n
    assert report.val_retrieval_margin == pytest.approx(0.0, abs=1e-6)  # one output for all: no prompt's own
    assert report.verdict.startswith(f"Not there yet: val centred cosine {report.val_centred_cosine:.3f} reaches "
                                     f"{GOOD}, but prompt retrieval top-1 {report.val_retrieval_top1:.3f} is below "
                                     f"0.500 (chance {1 / n:.3f})"), report.verdict
    assert "It ignores the prompt" in report.advice
    md = (paths.root / "output" / REPORT_MD).read_text(encoding="utf-8")
    for needle in (f"| prompt retrieval top-1 (own target the nearest, of {n} non-empty val prompts; chance "
                   f"{1 / n:.3f}; higher is better) | {report.val_retrieval_top1:.3f} |",
                   f"| prompt retrieval top-5 (own target among the 5 nearest; chance {5 / n:.3f}; higher is better) |",
                   "| prompt retrieval margin (own centred cosine less the mean to the other prompts' targets; "
                   "higher is better) |",
                   f"for at least 50% of the non-empty val prompts, a count chance gives less than once in 1,000 "
                   f"({n // 2} of these {n})", report.verdict):
        assert needle in md, needle


@pytest.mark.parametrize("score, advice", [(0.62, "Widen the adapter"), (0.95, "Use it")])
def test_report_verdict_and_advice(tmp_path: Path, score: float, advice: str) -> None:
    paths, settings = project(tmp_path, evaluate=False)
    sidecar = ExportSidecar(path="/o/adapter.gguf", bytes=10, sha256="ab" * 32, fingerprint="fp",
                            val_centred_cosine_torch=score,
                            files=[{"role": "adapter", "path": "/o/adapter.gguf", "bytes": 10, "sha256": "ab" * 32}])
    report = build_report(paths, settings, MATERIALS, sidecar, None, fingerprint="x")
    assert report.score_source == "torch" and report.val_centred_cosine is None
    assert advice in report.advice
    if score < 0.9:  # no training curve to read here: the advice is the adapter's size, from its own width
        assert "deepen" in report.advice and "0.9" in report.verdict
        assert f"training.width: {2 * settings.training.width}" in report.advice
    md = (paths.root / "output" / REPORT_MD).read_text(encoding="utf-8")
    assert "not evaluated" in md and advice in md
    # An export that wrote no student GGUF (an old sidecar): the command names the student folder, quoted.
    assert f"--llm {shlex.quote(str(STUDENT_DIR))} " in report.ggk_command
    assert "--tokenizer-pack" not in report.ggk_command


def test_an_unevaluated_report_gives_the_checkpoints_last_validation(tmp_path: Path) -> None:
    """With output.evaluate off, the other scores are the torch checkpoint's at its last step (its history's
    validation of that step), and there is no GGUF-vs-checkpoint comparison."""
    paths, settings = project(tmp_path, evaluate=False)
    last = {"step": 900, metrics.VAL_CENTRED_COSINE: 0.93, metrics.VAL_REL_MSE: 0.125, metrics.VAL_RMS_COSINE: 0.97,
            metrics.WORST_ROW: 5, metrics.WORST_ROW_COSINE: 0.61}
    final = paths.root / "checkpoints" / "fp" / FINAL_DIR
    atomic.write_json(final / META_FILE, {"step": 900, "history": [
        {**last, "step": 450, metrics.VAL_REL_MSE: 0.5}, {"step": 900, "loss": 0.1}, last]})
    atomic.write_json(paths.adapter_manifest, {"run_dir": "checkpoints/fp", "fingerprint": "fp"})
    sidecar = ExportSidecar(path="/o/adapter.gguf", bytes=10, sha256="ab" * 32, fingerprint="fp",
                            val_centred_cosine_torch=0.93,
                            files=[{"role": "adapter", "path": "/o/adapter.gguf", "bytes": 10, "sha256": "ab" * 32}])
    report = build_report(paths, settings, MATERIALS, sidecar, None, fingerprint="x")
    assert (report.val_rel_mse, report.val_rms_cosine, report.worst_row, report.worst_row_cosine) == \
        (0.125, 0.97, 5, 0.61)
    assert report.gguf_vs_checkpoint is None and report.val_centred_cosine is None
    md = (paths.root / "output" / REPORT_MD).read_text(encoding="utf-8")
    assert "| row 5: 0.6100 |" in md and "checkpoint's last validation" in md


# --- format stability -----------------------------------------------------------------

GOLDEN_HPARAMS = {"in_dim": 4, "out_dim": 3, "width": 64, "depth": 1, "heads": 1, "head_dim": 64,
                  "query_count": 2, "mlp_hidden": 256, "layer_norm_epsilon": 1e-5}
GOLDEN_PROVENANCE = {
    "conditioning": "llada-image", "student.repo": "org/student", "student.commit": "c0ffee",
    "student.hidden_size": 4, "student.gguf": "tiny-student.gguf", "teacher.repo": "org/teacher",
    "teacher.commit": "beef", "teacher.layer": 7, "training.steps": 100, "training.planned_steps": 200,
    "training.checkpoint": "best", "training.seed": 1, "training.val_centred_cosine": 0.875,
    "training.fingerprint": "f0", "trainer": "gguf_assets golden",
}


def golden_tensors() -> dict[str, np.ndarray]:
    """Seeded numpy weights (platform-independent), with one value beyond f16 to pin the f32 fallback."""
    rng = np.random.default_rng(1234)
    tensors = {k: rng.standard_normal(shape).astype(np.float32)
               for k, shape in gguf_format.expected_tensor_shapes(GOLDEN_HPARAMS).items()}
    tensors["out_proj.weight"][0, 0] = 7.0e4
    return tensors


def test_golden_bytes_and_round_trip(tmp_path: Path) -> None:
    assert GOLDEN_HPARAMS == gguf_format.hparams_of(student_dim=4, query_rows=2, target_dim=3, width=64, depth=1)
    out = tmp_path / "tiny_adapter.gguf"
    tensors = golden_tensors()
    summary = gguf_format.write_adapter_gguf(out, tensors=tensors, hparams=GOLDEN_HPARAMS,
                                             provenance=GOLDEN_PROVENANCE, name="tiny")
    assert summary.kept_f32 == ("adapter.out_proj.weight",)
    if os.environ.get(REGEN_ENV) == "1":
        atomic.write_bytes(GOLDEN, out.read_bytes())
    assert out.read_bytes() == GOLDEN.read_bytes(), (
        f"the adapter GGUF bytes changed (sha256 {summary.sha256} vs {atomic.sha256_file(GOLDEN)}). If this "
        f"is deliberate: bump gguf_format.FORMAT_VERSION if a loader would notice, update docs/gguf_layout.md, "
        f"and rerun with {REGEN_ENV}=1.")
    # The export casts in torch before writing: the same bytes (f16 rounding, the f32 fallback).
    cast = export._cast_once({k: torch.from_numpy(v) for k, v in tensors.items()})
    assert cast["in_proj.weight"].dtype == np.float16 and cast["out_proj.weight"].dtype == np.float32
    assert cast["query"].dtype == np.float32 and cast["blocks.0.ln_kv.weight"].dtype == np.float32
    via_torch = tmp_path / "via_torch.gguf"
    assert gguf_format.write_adapter_gguf(via_torch, tensors=cast, hparams=GOLDEN_HPARAMS,
                                          provenance=GOLDEN_PROVENANCE, name="tiny").kept_f32 == (
        "adapter.out_proj.weight",)
    assert via_torch.read_bytes() == GOLDEN.read_bytes()

    # The golden file read back: every key and every tensor.
    metadata = gguf_format.read_gguf_metadata(GOLDEN)
    assert gguf_format.hparams_from_metadata(metadata) == {**GOLDEN_HPARAMS,
                                                           "layer_norm_epsilon": pytest.approx(1e-5)}
    assert gguf_format.provenance_from_metadata(metadata) == GOLDEN_PROVENANCE
    assert (metadata["general.name"], metadata["adapter.format_version"], metadata["adapter.variant"]) == (
        "tiny", 3, "resampler")
    assert len(metadata) == 4 + len(gguf_format.HPARAM_TYPES) + len(GOLDEN_PROVENANCE)
    read = gguf_format.read_gguf_tensors(GOLDEN)
    assert list(read) == [gguf_format.tensor_name(k) for k in tensors]
    assert len(read) == 7 + 28
    for key, array in tensors.items():
        got = read[gguf_format.tensor_name(key)]
        f16 = gguf_format.is_f16_tensor(key) and key != "out_proj.weight"
        assert got.dtype == (np.float16 if f16 else np.float32), key
        np.testing.assert_array_equal(got, array.astype(got.dtype), err_msg=key)
    # and it loads as an adapter ggk's numbers describe: one head of 64, 2 query rows of 3
    loaded = gguf_eval.load_adapter_gguf(GOLDEN)
    assert loaded.forward(np.ones((3, 4), np.float32)).shape == (2, 3)


def test_matrices_whose_inputs_overflow_f16_on_the_val_states_are_stored_f32(tmp_path: Path) -> None:
    """The f16 rule protects weights; a runtime also rounds a f16 product's inputs to f16. Here the cross-attention
    values are scaled so their attention-weighted sums (the inputs of every cross_attn.o) reach far past 65504 / 4
    while every weight still fits f16: those o weights are stored F32 (seen by gguf-py's reader), the rest F16."""
    paths, settings = project(tmp_path)
    adapter = make_adapter(4)
    with torch.no_grad():
        for block in adapter.blocks:
            block.cross_attn.v.weight.mul_(8000.0)
            block.cross_attn.v.bias.mul_(8000.0)
    assert max(float(p.detach().abs().max()) for p in adapter.parameters()) < F16_MAX  # the weights alone pass
    folder = paths.root / "shards" / "val" / "00000"
    write_shard(folder, adapter=adapter, texts=["a", "b", "c"], lengths=[3, 5, 2], targets_dtype=torch.float32,
                hidden_dtype=torch.float32, seed=5)
    peaks = measure_peaks(adapter, [folder], device=torch.device("cpu"))
    attended = [f"blocks.{b}.cross_attn.o.weight" for b in range(SHAPE.depth)]
    assert all(peaks[name] > F16_MAX / export.ACTIVATION_HEADROOM for name in attended), peaks
    rule = export.activation_rule(peaks)
    # cross_attn.o reads the weighted sums of the scaled values; v itself reads a LayerNorm output, and every other
    # linear a LayerNorm output, the student's states or values of unscaled weights: their inputs stay small.
    assert rule == attended
    assert len(peaks) == 2 + 10 * SHAPE.depth

    sidecar = export.export_adapter(paths, settings, MATERIALS, fake_run(paths, adapter), val_folders=[folder])
    types = {t.name: t.tensor_type.name for t in GGUFReader(sidecar.path).tensors}
    matrices = [k for k in export.ggk_tensors(adapter) if gguf_format.is_f16_tensor(k)]
    assert {k for k in matrices if types[gguf_format.tensor_name(k)] == "F32"} == set(rule)
    assert set(sidecar.kept_f32) == {gguf_format.tensor_name(n) for n in rule}
    # Without val states (or with small inputs) nothing is kept f32 for its inputs.
    assert export.activation_rule({"in_proj.weight": F16_MAX / export.ACTIVATION_HEADROOM}) == []


def test_recorded_and_batched_input_peaks_are_each_prompts_own_and_decide_the_same(tmp_path: Path) -> None:
    """The f16 check's peaks three ways: recorded by the trainer's validation (train.evaluate, one padded batch), the
    export's own batched measurement, and one prompt at a time as ggk runs them. They agree to float tolerance and
    keep the same matrices f32, on an adapter whose cross_attn.o inputs overflow and whose batch padding would raise
    the k/v peaks if it counted: with in_proj.bias a spike, a padding row's kv is that bias alone, which ln_kv turns
    into a value of about sqrt(width) = 11, beyond any real token's."""
    adapter = make_adapter(4)
    with torch.no_grad():
        for block in adapter.blocks:
            block.cross_attn.v.weight.mul_(8000.0)
            block.cross_attn.v.bias.mul_(8000.0)
            block.ln_kv.weight[0], block.ln_kv.bias[0] = 1.0, 0.0
        adapter.in_proj.bias.zero_()
        adapter.in_proj.bias[0] = 0.5
    folder = tmp_path / "val" / "00000"
    lengths = [3, 9, 1, 5, 2, 7, 4, 6, 8, 2]
    write_shard(folder, adapter=adapter, texts=[f"p{i}" for i in range(len(lengths))], lengths=lengths,
                targets_dtype=torch.float32, hidden_dtype=torch.float32, seed=6)
    cpu = torch.device("cpu")
    per_prompt = measure_peaks(adapter, [folder], device=cpu, batch_size=1)
    batched = measure_peaks(adapter, [folder], device=cpu)
    record = train.evaluate(adapter, [folder], device=cpu, cosine_weight=0.5)[INPUT_PEAKS]
    recorded = recorded_peaks({INPUT_PEAKS: json.loads(json.dumps(record))}, [folder])  # as meta.json keeps it
    assert len(per_prompt) == 2 + 10 * SHAPE.depth
    for name, peak in per_prompt.items():
        assert batched[name] == pytest.approx(peak, rel=1e-5), name
        assert recorded[name] == pytest.approx(peak, rel=1e-5), name
    attended = [f"blocks.{b}.cross_attn.o.weight" for b in range(SHAPE.depth)]
    assert export.activation_rule(per_prompt) == export.activation_rule(batched) == export.activation_rule(
        recorded) == attended
    # The padding rows would have counted: their k/v input is beyond every prompt's own.
    for b, block in enumerate(adapter.blocks):
        with torch.no_grad():
            padding_row = float(block.ln_kv(adapter.in_proj.bias).abs().max())
        assert padding_row > 1.5 * per_prompt[f"blocks.{b}.cross_attn.k.weight"], (padding_row, per_prompt)


def test_the_export_reads_the_input_peaks_its_weights_validation_recorded(tmp_path: Path) -> None:
    """A record for the val shards exported against is what the f16 check decides by (here one that says in_proj's
    inputs overflow, which a measurement would not find); a record of other val shards is ignored and the adapter
    is measured."""
    adapter = make_adapter(0)
    folder = tmp_path / "val" / "00000"
    write_shard(folder, adapter=adapter, texts=["a", "b"], lengths=[3, 5], targets_dtype=torch.float32,
                hidden_dtype=torch.float32, seed=2)
    measured = measure_peaks(adapter, [folder], device=torch.device("cpu"))
    assert export.activation_rule(measured) == []
    overflowing = {**measured, "in_proj.weight": F16_MAX}
    kept = {}
    for recorded_for in (folder, tmp_path / "val" / "00001"):
        paths, settings = project(tmp_path / recorded_for.name)
        manifest = fake_run(paths, adapter)
        meta_file = paths.root / manifest["run_dir"] / FINAL_DIR / META_FILE
        atomic.write_json(meta_file, {**atomic.read_json(meta_file),
                                      INPUT_PEAKS: peaks_record(overflowing, [recorded_for])})
        kept[recorded_for.name] = export.export_adapter(paths, settings, MATERIALS, manifest,
                                                        val_folders=[folder]).kept_f32
    assert kept == {"00000": ["adapter.in_proj.weight"], "00001": []}
