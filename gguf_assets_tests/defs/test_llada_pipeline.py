"""An LLaDA-Image pipeline folder as the teacher (materials.teacher alone names it), pinned by the parts it reads.

The folder is the tiny pipeline built from the real published files (real_llada.py); the hub path, the whole
pipeline and the checks before the weights are test_real_teacher.py's.
"""

from __future__ import annotations

import shutil

import pytest
from llada_repo import isolated_remote_code, remote_code_files
from real_llada import build_real_llada_repo
from real_llada import pipeline_project as _project
from real_llada import pipeline_settings as _settings

from gguf_assets.lib.materials.materials_run import MaterialsError
from gguf_assets.lib.materials.pinning.resolve import resolve_materials
from gguf_assets.lib.precompute.shards_run import half_fingerprint
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file

REPO = "inclusionAI/LLaDA-Image-Turbo"


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory):
    return build_real_llada_repo(tmp_path_factory.mktemp("llada") / "LLaDA-Image-Turbo")


@pytest.fixture(autouse=True)
def remote_code_cache(tmp_path):
    with isolated_remote_code(tmp_path / "hf-modules"):  # resolve_materials imports the code to check it
        yield


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
