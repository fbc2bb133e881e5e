"""An LLaDA-Image pipeline repo as the teacher (materials.teacher alone names it), from the loopback hub.

The repo is a tiny random replica of inclusionAI/LLaDA-Image-Turbo (llada_repo.py): model_index.json, the text
stack, a SigVQ, and a DiT and a VAE that must never be fetched. Its backbone is remote code, so the first run stops
before any weight is fetched or loaded, naming the files and the setting; with the setting the whole pipeline runs
to a GGUF and a vision GGUF.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import cli
from llada_repo import TINY_LLADA, build_tiny_llada_repo, remote_code_files

from gguf_assets.lib.core import atomic
from gguf_assets.lib.demo.demo import demo_settings
from gguf_assets.lib.materials.materials import MaterialsError, load_manifest, resolve_materials
from gguf_assets.lib.precompute.shards import half_fingerprint
from gguf_assets.lib.project.layout import REPORT_JSON, ProjectPaths
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.lib.status.stages import STAGES
from gguf_assets.lib.status.states import project_status
from gguf_assets.orchestration.launching import run_pipeline

REPO = "inclusionAI/LLaDA-Image-Turbo"


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory):
    return build_tiny_llada_repo(tmp_path_factory.mktemp("llada") / "LLaDA-Image-Turbo")


def _settings(teacher: str, **materials):
    return replace(demo_settings(steps=20),
                   materials={"teacher": teacher, "student": "materials/demo/student",
                              "datasets": ["materials/demo/dataset"], "vision_encoder": "", **materials},
                   precompute={"prompt_template": "{prompt}", "shard_size": 200, "val_shard_size": 100},
                   corpus={"train_prompts": 400, "val_prompts": 100},
                   training={"validate_every": 10, "checkpoint_every": 10, "log_every": 10})


def _project(root, demo_materials_root, settings) -> ProjectPaths:
    shutil.copytree(demo_materials_root / "student", root / "materials" / "demo" / "student")
    shutil.copytree(demo_materials_root / "dataset", root / "materials" / "demo" / "dataset")
    write_project_file(root, settings)
    return ProjectPaths.of(root)


@pytest.mark.slow
def test_remote_code_is_refused_before_any_weight_then_allowed_runs_to_a_gguf_without_the_dit(
        tmp_path, tiny_repo, demo_materials_root, loopback_hub, monkeypatch):
    loopback_hub.add_repo(REPO, tiny_repo)
    paths = _project(tmp_path / "project", demo_materials_root, _settings(REPO))

    refused = cli("run", str(paths.root))
    console = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "Traceback" not in console
    commit = loopback_hub.head(REPO)
    for name in ["materials.trust_remote_code", REPO, commit, *remote_code_files(tiny_repo)]:
        assert name in console, name
    assert "sha256" in console
    assert not [f for f in loopback_hub.served if f.endswith(".safetensors")]  # no weight was fetched

    write_project_file(paths.root, _settings(REPO, trust_remote_code=True))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    monkeypatch.setenv("GGUF_ASSETS_PROJECT", str(paths.root))
    status = run_pipeline(paths, echo=lambda line: None)
    assert {s.stage: s.state for s in status} == dict.fromkeys(STAGES, "current")
    assert {s.stage: s.state for s in project_status(paths, load_settings(paths.root))} == \
        dict.fromkeys(STAGES, "current")

    served = set(loopback_hub.served)
    assert not {f for f in served if f.split("/")[0] in ("transformer", "vae", "scheduler")}, served
    assert {f.split("/")[0] for f in served if "/" in f} == {"text_encoder", "queryformer", "text_projection",
                                                            "tokenizer", "sigvq"}
    manifest = load_manifest(paths)
    assert manifest.teacher["kind"] == "llada-image" and manifest.teacher["commit"] == commit
    assert sorted(manifest.teacher["remote_code"]) == remote_code_files(tiny_repo)
    assert manifest.vision_encoder["commit"] == commit and manifest.vision_encoder["path"].endswith("/sigvq")

    settings = load_settings(paths.root)
    report = atomic.read_json(paths.output_dir(settings) / REPORT_JSON)
    assert report["val_centred_cosine"] is not None
    half = atomic.read_json(next(paths.root.glob("shards/val/*/teacher.json")))
    assert (half["query_rows"], half["dim"]) == (TINY_LLADA.num_queries, TINY_LLADA.projection_dim)
    assert (half["teacher_kind"], half["teacher_forward"]) == ("llada-image", 1)
    assert report["ggk_files"]["vision_encoder"] and paths.located(report["ggk_files"]["vision_encoder"]).is_file()


def test_a_changed_modeling_file_makes_the_teacher_halves_stale_and_nothing_else(tmp_path, tiny_repo,
                                                                                 demo_materials_root):
    teacher = tmp_path / "LLaDA-Image-Turbo"
    shutil.copytree(tiny_repo, teacher)
    paths = _project(tmp_path / "project", demo_materials_root, _settings(str(teacher), trust_remote_code=True))
    settings = load_settings(paths.root)

    def fingerprints():
        manifest = resolve_materials(paths, settings)
        return manifest, {half: half_fingerprint(half, settings, manifest, "prompts")
                          for half in ("teacher", "student")}

    before_manifest, before = fingerprints()
    assert before_manifest.teacher["kind"] == "llada-image"
    # The DiT is not the teacher's: a local pipeline is pinned by the parts it reads.
    dit = teacher / "transformer" / "diffusion_pytorch_model.safetensors"
    dit.write_bytes(dit.read_bytes()[:-1] + b"\0")
    assert fingerprints()[1] == before

    modeling = teacher / remote_code_files(tiny_repo)[-1]
    modeling.write_text(modeling.read_text() + "\n# an edit\n")
    after_manifest, after = fingerprints()
    assert after_manifest.teacher["remote_code"] != before_manifest.teacher["remote_code"]
    assert after["teacher"] != before["teacher"] and after["student"] == before["student"]

    # A setting of the query-rows kind that a pipeline would ignore is refused, naming it.
    write_project_file(paths.root, replace(_settings(str(teacher), trust_remote_code=True),
                                           materials={"teacher_layer": 1}))
    with pytest.raises(MaterialsError, match="materials.teacher_layer = 1 would be ignored"):
        resolve_materials(paths, load_settings(paths.root))

    write_project_file(paths.root, _settings(str(teacher)))  # the setting off again: refused, naming the file
    with pytest.raises(MaterialsError) as refused:
        resolve_materials(paths, load_settings(paths.root))
    assert "materials.trust_remote_code" in str(refused.value) and remote_code_files(tiny_repo)[-1] in \
        str(refused.value)
