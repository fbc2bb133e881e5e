"""`gguf-trainer run` end to end with every material from the loopback hub.

The runner (the code the CLI calls) downloads a gated teacher, the student and a parquet
dataset through the real huggingface_hub client, then runs the whole DAG on them.
"""

import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gguf_assets.lib.core import atomic
from gguf_assets.lib.demo.demo import demo_settings, iter_prompts
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.project.layout import REPORT_JSON, ProjectPaths
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.lib.status.stages import STAGES
from gguf_assets.lib.status.states import project_status
from gguf_assets.orchestration.launching import run_pipeline

pytestmark = pytest.mark.slow  # whole pipelines: excluded from the fast loop (-m 'not slow')

TEACHER, STUDENT, DATASET = "org/gated-teacher", "demo/student", "demo/prompts-parquet"
PARQUET_FILE = "data/train-00000-of-00001.parquet"


def _parquet_bytes(dataset_dir: Path, out: Path) -> bytes:
    texts = list(iter_prompts(dataset_dir))
    # A second column, as in real hub datasets: only `text` may be read.
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), out, row_group_size=256)
    return out.read_bytes()


def test_run_downloads_every_material_from_the_hub(tmp_path, demo_materials_root, loopback_hub, monkeypatch):
    loopback_hub.add_repo(TEACHER, demo_materials_root / "teacher", gated=True)
    parquet = _parquet_bytes(demo_materials_root / "dataset", tmp_path / "p.parquet")
    loopback_hub.add_repo(DATASET, {PARQUET_FILE: parquet, "README.md": b"# prompts\n"}, kind="dataset")
    root = tmp_path / "project"
    settings = replace(demo_settings(steps=20),
                       materials={"teacher": TEACHER, "student": STUDENT, "datasets": [DATASET],
                                  "vision_encoder": "demo/sigvq"},
                       corpus={"train_prompts": 400, "val_prompts": 100},
                       precompute={"shard_size": 200, "val_shard_size": 100},
                       training={"validate_every": 10, "checkpoint_every": 10, "log_every": 10})
    write_project_file(root, settings)
    paths = ProjectPaths.of(root)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # the runner re-points it to the project's own
    monkeypatch.setenv("GGUF_ASSETS_PROJECT", str(root))
    monkeypatch.setenv("HF_TOKEN", loopback_hub.token)

    echoed: list[str] = []
    status = run_pipeline(paths, echo=echoed.append)

    assert {s.stage: s.state for s in status} == dict.fromkeys(STAGES, "current")
    settings = load_settings(root)
    assert {s.stage: s.state for s in project_status(paths, settings)} == dict.fromkeys(STAGES, "current")
    assert any("materials" in line for line in echoed)

    manifest = load_manifest(paths)
    stored = atomic.read_json(paths.materials_manifest)
    for entry, repo, kind in ((manifest.teacher, TEACHER, "model"), (manifest.student, STUDENT, "model"),
                              (manifest.datasets[0], DATASET, "dataset")):
        assert entry["origin"] == "hub" and entry["commit"] == loopback_hub.head(repo, kind=kind), repo
        assert Path(entry["path"]).is_relative_to(paths.materials_dir)
    # On disk the downloads are named relative to the project folder, so a copy is independent.
    assert stored["teacher"]["path"].startswith("materials/hub/")
    dataset_files = sorted(p.relative_to(manifest.datasets[0]["path"]).as_posix()
                           for p in Path(manifest.datasets[0]["path"]).rglob("*") if p.is_file())
    assert dataset_files == [PARQUET_FILE]  # the data file only, no README

    corpus = atomic.read_json(paths.corpus_manifest)
    assert [s["format"] for s in corpus["sources"]] == [".parquet"] and corpus["per_source"][DATASET] > 500
    assert corpus["splits"]["train"]["prompts"] == 400 and corpus["splits"]["val"]["prompts"] == 100
    report = atomic.read_json(paths.output_dir(settings) / REPORT_JSON)
    assert paths.located(report["gguf_path"]).is_file() and report["val_centred_cosine"] is not None

    # The gated teacher was fetched with the token; the one stored in HF_HOME was never sent.
    auths = {r["auth"] for r in loopback_hub.requests}
    assert auths <= {"none", "granted"} and "granted" in auths
    assert {r["auth"] for r in loopback_hub.requests if TEACHER + "/resolve/" in r["path"]} == {"granted"}
    # The token is nowhere in the project folder (Dagster's storage lives in <project>/.dagster)
    # nor anywhere else under this test's folders, HF_HOME included.
    assert paths.dagster_home.is_relative_to(root)
    found = subprocess.run(["grep", "-r", "-l", "-a", "-F", loopback_hub.token, str(tmp_path)],
                           capture_output=True, text=True)
    assert found.returncode == 1, found.stdout
    # The same search does find what the runs stored (the teacher's pinned commit in the event log).
    stored = subprocess.run(["grep", "-r", "-l", "-a", "-F", manifest.teacher["commit"], str(paths.dagster_home)],
                            capture_output=True, text=True)
    assert stored.returncode == 0, stored.stderr

    # A second run needs the hub no more: everything is pinned and current.
    before = len(loopback_hub.requests)
    assert all(s.state == "current" for s in run_pipeline(paths, echo=echoed.append))
    assert len(loopback_hub.requests) == before


def test_run_with_query_rows_from_a_tensor_of_a_gated_t2i_repo(tmp_path, demo_materials_root, loopback_hub,
                                                               monkeypatch):
    """A stock LLM teacher (no query rows) and the rows taken by range out of a bigger checkpoint elsewhere."""
    import torch
    from safetensors.torch import load_file, save

    rows = load_file(demo_materials_root / "teacher" / "query_rows.safetensors")["query_rows"]
    checkpoint = save({"blocks.0.weight": torch.randn(512, 512), "text_proj.query_tokens": rows.clone(),
                       "vae.weight": torch.randn(512, 512)})
    teacher = {p.name: p.read_bytes() for p in (demo_materials_root / "teacher").iterdir()
               if p.is_file() and p.name != "query_rows.safetensors"}
    loopback_hub.add_repo("stock/llm", teacher)
    loopback_hub.add_repo("org/t2i", {"transformer/model.safetensors": checkpoint}, gated=True)
    root = tmp_path / "project"
    settings = replace(demo_settings(steps=20),
                       materials={"teacher": "stock/llm", "student": STUDENT, "datasets": [DATASET],
                                  "vision_encoder": "",
                                  "query_rows": {"source": "org/t2i@main", "file": "transformer/model.safetensors",
                                                 "tensor": "text_proj.query_tokens"}},
                       corpus={"train_prompts": 400, "val_prompts": 100},
                       precompute={"shard_size": 200, "val_shard_size": 100},
                       training={"validate_every": 10, "checkpoint_every": 10, "log_every": 10})
    parquet = _parquet_bytes(demo_materials_root / "dataset", tmp_path / "p.parquet")
    loopback_hub.add_repo(DATASET, {PARQUET_FILE: parquet}, kind="dataset")
    write_project_file(root, settings)
    paths = ProjectPaths.of(root)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    monkeypatch.setenv("GGUF_ASSETS_PROJECT", str(root))
    monkeypatch.setenv("HF_TOKEN", loopback_hub.token)

    status = run_pipeline(paths, echo=lambda _line: None)

    assert {s.stage: s.state for s in status} == dict.fromkeys(STAGES, "current")
    entry = load_manifest(paths).query_rows
    assert entry["commit"] == loopback_hub.head("org/t2i") and entry["shape"] == list(rows.shape)
    assert loopback_hub.served["transformer/model.safetensors"] < len(checkpoint) // 4
    assert {r["auth"] for r in loopback_hub.requests if "org/t2i/resolve/" in r["path"]} == {"granted"}
    report = atomic.read_json(paths.output_dir(load_settings(root)) / REPORT_JSON)
    assert paths.located(report["gguf_path"]).is_file() and report["val_centred_cosine"] is not None
    # The GGUF names where its query rows came from, pinned (read by the gguf package's reader, not ours).
    from gguf import GGUFReader

    fields = GGUFReader(paths.located(report["gguf_path"])).fields
    said = {key: fields[f"adapter.query_rows.{key}"].contents() for key in ("source", "tensor", "commit", "sha256")}
    assert said == {"source": "org/t2i@main", "tensor": "text_proj.query_tokens", "commit": entry["commit"],
                    "sha256": entry["tensor_sha256"]}, said
    found = subprocess.run(["grep", "-r", "-l", "-a", "-F", loopback_hub.token, str(tmp_path)],
                           capture_output=True, text=True)
    assert found.returncode == 1, found.stdout
