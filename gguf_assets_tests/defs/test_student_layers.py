"""Several student layers through the whole DAG: the demo project's shards made for one layer, then
`materials.student_layer: [1, -1]` with the learned mix: only the student halves are made again, and the
exported GGUF (format version 2) scores in numpy as the torch checkpoint does."""

import pytest

from gguf_assets.lib.core import atomic
from gguf_assets.lib.corpus.corpus import build_corpus
from gguf_assets.lib.corpus.corpus_run import corpus_fingerprint
from gguf_assets.lib.materials.materials import resolve_materials
from gguf_assets.lib.output import gguf_format
from gguf_assets.lib.precompute.shards import plan_shards, precompute_split
from gguf_assets.lib.project.layout import REPORT_JSON
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.orchestration.launching import run_pipeline

pytestmark = pytest.mark.slow  # a whole pipeline: excluded from the fast loop (-m 'not slow')


def _teacher_files(root):
    """Each teacher half's bytes, inode and mtime: a rewrite of any of them shows."""
    return {f: (atomic.sha256_file(f), f.stat().st_ino, f.stat().st_mtime_ns)
            for f in sorted(root.glob("shards/*/*/teacher.safetensors"))}


def test_a_layer_list_reuses_the_teacher_and_its_gguf_reads_in_numpy_as_torch_scores(make_project):
    paths = make_project(steps=60)
    settings = load_settings(paths.root)  # the demo's one layer (0)
    materials = resolve_materials(paths, settings)
    build_corpus(paths, settings, materials, fingerprint=corpus_fingerprint(paths, settings, materials))
    for split in ("train", "val"):
        precompute_split(paths, settings, materials, split,
                         [p.key for p in plan_shards(paths, settings, materials, split)])
    teacher_before = _teacher_files(paths.root)
    assert len(teacher_before) == 5

    settings = replace(settings, materials={"student_layer": [1, -1]}, training={"layer_fusion": "mix"})
    write_project_file(paths.root, settings)
    status = run_pipeline(paths, echo=lambda _: None)
    assert all(s.state == "current" for s in status), status
    assert _teacher_files(paths.root) == teacher_before  # never recomputed, never rewritten
    for student in paths.root.glob("shards/*/*/student.json"):
        assert atomic.read_json(student)["layers"] == [1, -1]

    report = atomic.read_json(paths.output_dir(settings) / REPORT_JSON)
    # The numpy reading of the GGUF (its own fusion, from the file's tensors) agrees with the torch checkpoint.
    assert abs(report["val_centred_cosine"] - report["val_centred_cosine_torch"]) < 1e-3
    assert report["student"]["layer"] == [1, -1]
    gguf = paths.located(report["gguf_path"])
    metadata = gguf_format.read_gguf_metadata(gguf)
    assert metadata["llm_adapter.format_version"] == gguf_format.LAYERS_FORMAT_VERSION
    assert metadata["llm_adapter.student_layers"] == 2 and metadata["llm_adapter.layer_fusion"] == "mix"
    assert metadata["llm_adapter.student.layers"] == [1, -1] and "llm_adapter.student.layer" not in metadata
    mix = gguf_format.read_gguf_tensors(gguf)["layer_mix"]
    assert mix.shape == (2,) and abs(float(mix[0] - mix[1])) > 1e-4  # learned: no longer the equal start
    run_dir = atomic.read_json(paths.adapter_manifest)["run_dir"]
    untrained = atomic.read_json(paths.root / run_dir / "final" / "meta.json")["untrained_val_centred_cosine"]
    assert report["val_centred_cosine"] > untrained + 0.1, (report["val_centred_cosine"], untrained)
