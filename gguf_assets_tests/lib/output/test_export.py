"""Export (metadata completeness, names, output folder, verified copies), the numpy-vs-torch
agreement carried in report.json, the report itself, and the exact-bytes golden file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType
from safetensors.torch import save_file
from test_gguf_format import SHAPE, make_adapter, write_shard

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.f16 import F16_MAX
from gguf_assets.lib.output import export, gguf_eval, gguf_format
from gguf_assets.lib.output.report import build_report, ggk_command
from gguf_assets.lib.project.layout import FINAL_DIR, META_FILE, REPORT_JSON, REPORT_MD, WEIGHTS_FILE, ProjectPaths
from gguf_assets.lib.project.manifests import ExportSidecar, MaterialsManifest
from gguf_assets.lib.project.settings import Settings, replace
from gguf_assets.lib.training import train

GOLDEN = Path(__file__).parents[2] / "golden" / "tiny_adapter.gguf"
REGEN_ENV = "GGUF_GOLDEN_REGEN"  # set to 1 to rewrite the golden file after a deliberate format change

MATERIALS = MaterialsManifest(
    student={"source": "org/student", "commit": "0123abcd" * 5, "path": "/models/student dir"},
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
    meta = {"shape": SHAPE.to_dict(), "step": step, "fingerprint": "fp-test", "val_centred_cosine": 0.5,
            "empty_prompt_cosine": None, "per_shard": []}
    if val_folders:
        scores = train.evaluate(adapter, val_folders, device=torch.device("cpu"), cosine_weight=0.5)
        meta.update({k: scores[k] for k in ("val_centred_cosine", "empty_prompt_cosine", "per_shard")})
    atomic.write_json(final / META_FILE, meta)
    return {"run_dir": run_rel, "fingerprint": "fp-test"}


def project(tmp_path: Path, **output) -> tuple[ProjectPaths, Settings]:
    settings = replace(Settings(), materials={"student_layer": -3, "teacher_layer": 12}, training={"seed": 11},
                       output=output)
    return ProjectPaths.of(tmp_path / "proj"), settings


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
        "llm_adapter.format_version": (U32, gguf_format.FORMAT_VERSION),
        "llm_adapter.student_dim": (U32, SHAPE.student_dim), "llm_adapter.query_rows": (U32, SHAPE.query_rows),
        "llm_adapter.target_dim": (U32, SHAPE.target_dim), "llm_adapter.width": (U32, SHAPE.width),
        "llm_adapter.depth": (U32, SHAPE.depth), "llm_adapter.heads": (U32, SHAPE.heads),
        "llm_adapter.mlp_ratio": (U32, 4), "llm_adapter.layer_norm_epsilon": (F32, pytest.approx(1e-5)),
        "llm_adapter.student.repo": (S, "org/student"), "llm_adapter.student.commit": (S, "0123abcd" * 5),
        "llm_adapter.student.hidden_size": (I64, SHAPE.student_dim), "llm_adapter.student.layer": (I64, -3),
        "llm_adapter.teacher.repo": (S, "org/teacher"), "llm_adapter.teacher.commit": (S, "fedc9876" * 5),
        "llm_adapter.teacher.layer": (I64, 12),
        "llm_adapter.training.steps": (I64, 321), "llm_adapter.training.seed": (I64, 11),
        "llm_adapter.training.val_centred_cosine": (F64, 0.5),
        "llm_adapter.training.fingerprint": (S, "fp-test"),
        "llm_adapter.prompt_template": (S, settings.precompute.prompt_template),
    }
    for key, (vtype, value) in expected.items():
        assert key in fields, key
        assert fields[key].types == [vtype], (key, fields[key].types)
        assert fields[key].contents() == value, key
    assert set(gguf_format.REQUIRED_PROVENANCE) <= {k.removeprefix("llm_adapter.") for k in fields}
    assert sidecar.provenance["student.layer"] == -3
    # docs/gguf_layout.md's tables are generated from gguf_format's: they list exactly what an export writes, in
    # its order, with its types.
    assert written_keys(fields) == documented_keys(version=1)


# The keys only a file of several student layers (format version 2) holds, and the one it holds no more.
VERSION_2_ONLY = {f"llm_adapter.{k}" for k in [*gguf_format.LAYER_HPARAM_TYPES, "student.layers"]}
VERSION_1_ONLY = {"llm_adapter.student.layer"}
# The keys only a file whose query rows are a material of their own (materials.query_rows) holds.
QUERY_ROWS_ONLY = {f"llm_adapter.{k}" for k in gguf_format.PROVENANCE_HELP if k.startswith("query_rows.")}


def documented_keys(*, version: int, query_rows_material: bool = False) -> list[tuple[str, str]]:
    """(key, type) of docs/gguf_layout.md's generated tables that a file of this format version holds, in order."""
    fixed, provenance = gguf_format.metadata_key_rows()
    left_out = VERSION_2_ONLY if version == 1 else VERSION_1_ONLY
    left_out = left_out if query_rows_material else left_out | QUERY_ROWS_ONLY
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
                       ({"student.hidden_size": SHAPE.student_dim + 1}, "student_dim"),
                       ({"training.val_centred_cosine": 1.5}, "not a cosine")):
        with pytest.raises(ValueError, match=match):
            write(tmp_path / "x.gguf", make_adapter(), provenance={**PROVENANCE, **bad})


# --- names, folders, copies -----------------------------------------------------------


@pytest.mark.parametrize("name", ["../escape", "a/b", "a\\b", "..", ".", "", "  ", "x\0y"])
def test_export_refuses_unsafe_adapter_names(tmp_path: Path, name: str) -> None:
    # replace() skips settings validation, as a hand-built Settings would.
    paths, settings = project(tmp_path, adapter_name=name)
    manifest = fake_run(paths, make_adapter(0))
    with pytest.raises(export.ExportError, match="output.adapter_name"):
        export.export_adapter(paths, settings, MATERIALS, manifest)
    assert not (paths.root / "output").exists() and not (tmp_path / "escape.gguf").exists()


def test_also_copy_to_is_verified_and_a_failed_copy_keeps_the_old_one(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ggk_dir = tmp_path / "ggk models"
    paths, settings = project(tmp_path, also_copy_to=str(ggk_dir), output_dir="out")
    sidecar = export.export_adapter(paths, settings, MATERIALS, fake_run(paths, make_adapter(0)))
    copy = ggk_dir / "adapter.gguf"
    assert Path(sidecar.path) == paths.root / "out" / "adapter.gguf"
    assert sidecar.copies == [str(copy)]
    assert copy.read_bytes() == Path(sidecar.path).read_bytes()
    assert [f["role"] for f in sidecar.files] == ["adapter", "adapter"]
    assert sidecar.files[1] == {"role": "adapter", "path": str(copy), "bytes": copy.stat().st_size,
                                   "mtime_ns": copy.stat().st_mtime_ns, "inode": copy.stat().st_ino,
                                   "sha256": atomic.sha256_file(copy), "copy_of": sidecar.path}
    good = copy.read_bytes()

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
    assert copy.read_bytes() == good
    assert sorted(p.name for p in ggk_dir.iterdir()) == ["adapter.gguf"]  # no temp file left behind
    # The sidecar still describes the old export, so the stage is not mistaken for done.
    assert atomic.read_json(paths.root / "out" / "adapter.json")["sha256"] == sidecar.sha256


def test_a_changed_export_or_a_copy_shared_with_another_project_is_not_current(tmp_path: Path, caplog) -> None:
    """Exported files are checked by stamp: a same-size bit flip (new mtime) or another project
    writing the same also_copy_to file makes the export not current, and the export says so."""
    from gguf_assets.lib.output.export_run import exported_files_unchanged

    shared = tmp_path / "ggk models"
    first_paths, settings = project(tmp_path, also_copy_to=str(shared))
    export.export_adapter(first_paths, settings, MATERIALS, fake_run(first_paths, make_adapter(0)))
    assert exported_files_unchanged(first_paths, settings)

    gguf = first_paths.root / "output" / "adapter.gguf"
    data = bytearray(gguf.read_bytes())
    data[-7] ^= 0x01
    gguf.write_bytes(bytes(data))
    assert not exported_files_unchanged(first_paths, settings)
    export.export_adapter(first_paths, settings, MATERIALS, {"run_dir": "checkpoints/fp-test",
                                                              "fingerprint": "fp-test"})
    assert exported_files_unchanged(first_paths, settings)

    second_paths = ProjectPaths.of(tmp_path / "second")
    with caplog.at_level("WARNING", logger="gguf_assets"):
        export.export_adapter(second_paths, settings, MATERIALS, fake_run(second_paths, make_adapter(1)))
    assert f"replacing {shared / 'adapter.gguf'}, which this project's last export did not write" in caplog.text
    assert not exported_files_unchanged(first_paths, settings)  # its copy now holds the second's tensors


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
        assert f"{name}.gguf" in (shared / f"{name}.report.md").read_text(encoding="utf-8")
    assert atomic.read_json(shared / REPORT_JSON) == reports["second"].to_json()
    assert reports["first"].gguf_sha256 != reports["second"].gguf_sha256


def test_ggk_command_fills_and_quotes_placeholders() -> None:
    template = "ggk --llm {student} --llm_adapter {adapter_gguf} --llm_vision {vision_gguf} -p x"
    assert ggk_command(template, student="/m/s t", adapter_gguf="/o/a.gguf", vision_gguf="/o/v.gguf") == \
        "ggk --llm '/m/s t' --llm_adapter /o/a.gguf --llm_vision /o/v.gguf -p x"
    assert ggk_command(template, student="/s", adapter_gguf="/o/a.gguf", vision_gguf=None) == \
        "ggk --llm /s --llm_adapter /o/a.gguf -p x"
    assert ggk_command("ggk --llm {student} --llm_adapter {adapter_gguf}", student="/s", adapter_gguf="/a",
                       vision_gguf="/v") == "ggk --llm /s --llm_adapter /a --llm_vision /v"


# --- evaluation and report ------------------------------------------------------------


def test_numpy_evaluation_agrees_with_torch_and_report_carries_both(tmp_path: Path) -> None:
    paths, settings = project(tmp_path)
    adapter = make_adapter(2)
    shards = []
    for i, n in enumerate((7, 6)):
        folder = paths.root / "shards" / "val" / f"{i:05d}"
        texts = [f"prompt {i}-{j} | with a pipe" for j in range(n - 1)] + [""]
        write_shard(folder, adapter=adapter, texts=texts, lengths=[1 + (j * 5) % 9 for j in range(n - 1)] + [0],
                    targets_dtype=torch.float32, hidden_dtype=torch.float32, seed=20 + i)
        shards.append(folder)
    sidecar = export.export_adapter(paths, settings, MATERIALS, fake_run(paths, adapter, val_folders=shards))
    evaluation = gguf_eval.evaluate_gguf(Path(sidecar.path), shards)
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
    # Paths inside the project are stored relative to it, so a copied project is independent.
    assert report.files == [{"role": "adapter", "path": "output/adapter.gguf",
                                "bytes": Path(sidecar.path).stat().st_size,
                                "sha256": atomic.sha256_file(sidecar.path)}]
    assert report.ggk_command == "ggk --llm '/models/student dir' --llm_adapter output/adapter.gguf -p \"a cat\""
    assert report.vision_gguf is None

    md = (paths.root / "output" / REPORT_MD).read_text(encoding="utf-8")
    for needle in ("## Exported files", "## Use it in ggk", "### Per shard", "### The 10 worst val prompts",
                   report.gguf_sha256, report.ggk_command, report.verdict, "`org/student`",
                   "layer -3"):
        assert needle in md, needle
    assert "\\| with a pipe" in md  # a pipe in a prompt must not break the table


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


# --- format stability -----------------------------------------------------------------

GOLDEN_HPARAMS = {"student_dim": 4, "query_rows": 2, "target_dim": 3, "width": 4, "depth": 1, "heads": 2,
                  "mlp_ratio": 4, "layer_norm_epsilon": 1e-5}
GOLDEN_PROVENANCE = {
    "student.repo": "org/student", "student.commit": "c0ffee", "student.layer": -2, "student.hidden_size": 4,
    "teacher.repo": "org/teacher", "teacher.commit": "beef", "teacher.layer": 7, "prompt_template": "{prompt}",
    "training.steps": 100, "training.seed": 1, "training.val_centred_cosine": 0.875, "training.fingerprint": "f0",
}


def golden_tensors() -> dict[str, np.ndarray]:
    """Seeded numpy weights (platform-independent), with one value beyond f16 to pin the f32 fallback."""
    rng = np.random.default_rng(1234)
    tensors = {k: rng.standard_normal(shape).astype(np.float32)
               for k, shape in gguf_format.expected_tensor_shapes(GOLDEN_HPARAMS).items()}
    tensors["out_proj.weight"][0, 0] = 7.0e4
    tensors["target_std"] = np.abs(tensors["target_std"]) + 0.5
    return tensors


def test_golden_bytes_and_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "tiny_adapter.gguf"
    tensors = golden_tensors()
    summary = gguf_format.write_adapter_gguf(out, tensors=tensors, hparams=GOLDEN_HPARAMS,
                                             provenance=GOLDEN_PROVENANCE, name="tiny")
    assert summary.kept_f32 == ("out_proj.weight",)
    if os.environ.get(REGEN_ENV) == "1":
        atomic.write_bytes(GOLDEN, out.read_bytes())
    assert out.read_bytes() == GOLDEN.read_bytes(), (
        f"the adapter GGUF bytes changed (sha256 {summary.sha256} vs {atomic.sha256_file(GOLDEN)}). If this "
        f"is deliberate: bump gguf_format.FORMAT_VERSION if a loader would notice, update docs/gguf_layout.md, "
        f"and rerun with {REGEN_ENV}=1.")
    # The export casts in torch before writing: the same bytes (f16 rounding, the f32 fallback).
    cast = export._cast_once({k: torch.from_numpy(v) for k, v in tensors.items()})
    assert cast["in_proj.weight"].dtype == np.float16 and cast["out_proj.weight"].dtype == np.float32
    via_torch = tmp_path / "via_torch.gguf"
    assert gguf_format.write_adapter_gguf(via_torch, tensors=cast, hparams=GOLDEN_HPARAMS,
                                          provenance=GOLDEN_PROVENANCE, name="tiny").kept_f32 == ("out_proj.weight",)
    assert via_torch.read_bytes() == GOLDEN.read_bytes()

    # The golden file read back: every key and every tensor.
    metadata = gguf_format.read_gguf_metadata(GOLDEN)
    assert gguf_format.hparams_from_metadata(metadata) == {**GOLDEN_HPARAMS,
                                                           "layer_norm_epsilon": pytest.approx(1e-5)}
    assert gguf_format.provenance_from_metadata(metadata) == GOLDEN_PROVENANCE
    assert metadata["general.name"] == "tiny"
    assert len(metadata) == 3 + len(gguf_format.HPARAM_TYPES) + len(GOLDEN_PROVENANCE)
    read = gguf_format.read_gguf_tensors(GOLDEN)
    assert list(read) == [gguf_format.tensor_name(k) for k in tensors]
    for key, array in tensors.items():
        got = read[gguf_format.tensor_name(key)]
        f16 = gguf_format.is_f16_tensor(key) and key != "out_proj.weight"
        assert got.dtype == (np.float16 if f16 else np.float32), key
        np.testing.assert_array_equal(got, array.astype(got.dtype), err_msg=key)


def test_matrices_whose_inputs_overflow_f16_on_the_val_states_are_stored_f32(tmp_path: Path) -> None:
    """The f16 rule protects weights; a runtime also rounds a f16 product's inputs to f16. Here in_proj is scaled
    so the memory rows it makes (the inputs of every cross-attention k and v) reach far past 65504 / 4 while every
    weight still fits f16: k and v are stored F32 (seen by gguf-py's reader), q and the rest stay F16."""
    paths, settings = project(tmp_path)
    adapter = make_adapter(4)
    with torch.no_grad():
        adapter.in_proj.weight.mul_(8000.0)
        adapter.in_proj.bias.mul_(8000.0)
    assert float(adapter.in_proj.weight.detach().abs().max()) < F16_MAX  # the weights alone would pass
    folder = paths.root / "shards" / "val" / "00000"
    write_shard(folder, adapter=adapter, texts=["a", "b", "c"], lengths=[3, 5, 2], targets_dtype=torch.float32,
                hidden_dtype=torch.float32, seed=5)
    peaks = export.input_peaks(adapter, export.val_batches([folder]))
    memory_inputs = [f"blocks.{b}.cross_attn.{p}.weight" for b in range(SHAPE.depth) for p in "kv"]
    assert all(peaks[name] > F16_MAX / export.ACTIVATION_HEADROOM for name in memory_inputs), peaks
    rule = export.activation_rule(peaks)
    # k and v read the memory; o reads their weighted sum; q and the MLP read LayerNorm outputs.
    assert set(memory_inputs) <= set(rule) and "in_proj.weight" not in rule
    assert not any(name.endswith(("cross_attn.q.weight", "mlp_up.weight")) for name in rule), rule

    sidecar = export.export_adapter(paths, settings, MATERIALS, fake_run(paths, adapter), val_folders=[folder])
    types = {t.name: t.tensor_type.name for t in GGUFReader(sidecar.path).tensors}
    matrices = [k for k in adapter.state_dict() if gguf_format.is_f16_tensor(k)]
    assert {k for k in matrices if types[gguf_format.tensor_name(k)] == "F32"} == set(rule)
    assert set(sidecar.kept_f32) == {gguf_format.tensor_name(n) for n in rule}
    # Without val states (or with small inputs) nothing is kept f32 for its inputs.
    assert export.activation_rule({"in_proj.weight": F16_MAX / export.ACTIVATION_HEADROOM}) == []
