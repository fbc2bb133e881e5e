"""The estimate for an LLaDA-Image pipeline teacher: its text stack's weights (text encoder, QueryFormer, text
projection), the QueryFormer's rows and the projection's width for the adapter, and where the text encoder would go,
before any weight is downloaded."""

from __future__ import annotations

import pytest
from llada_repo import TINY_LLADA, isolated_remote_code
from real_llada import build_real_llada_repo
from safetensors import safe_open

from gguf_assets.lib.planning.estimate import BYTES, GIB, estimate, placement_lines
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    with isolated_remote_code(tmp_path_factory.mktemp("hf-modules")):
        yield build_real_llada_repo(tmp_path_factory.mktemp("llada") / "LLaDA-Image-Turbo")


def _numel(folder) -> int:
    total = 0
    for file in folder.rglob("*.safetensors"):
        with safe_open(str(file), "pt") as fh:
            for key in fh.keys():
                n = 1
                for dim in fh.get_slice(key).get_shape():
                    n *= dim
                total += n
    return total


def _settings(teacher, trust=True) -> Settings:
    return Settings.model_validate({"materials": {"teacher": str(teacher), "trust_remote_code": trust,
                                                  "student": str(teacher / "student")},
                                    "precompute": {"device": "cuda"}})


def test_the_text_stack_is_counted_and_the_adapter_takes_the_queryformers_rows(repo, tmp_path):
    from gguf_assets.lib.demo.demo import _build_student, _train_tokenizer

    tokenizer = _train_tokenizer(["a cat on a mat", "a dog in the fog"] * 20)
    _build_student(tokenizer, 0).save_pretrained(repo / "student")  # any Qwen3 student: its width is read
    try:
        paths = ProjectPaths.of(tmp_path)
        lines = {line.part: line for line in estimate(paths, _settings(repo))}
        stack = sum(_numel(repo / part) for part in ("text_encoder", "queryformer", "text_projection"))
        assert lines["teacher"].gib == pytest.approx(stack * BYTES["bf16"] / GIB)
        assert f"{TINY_LLADA.num_queries} x {TINY_LLADA.projection_dim} out" in lines["adapter training"].how

        # Where the text encoder goes is known from its own code, and only with the setting.
        planned = placement_lines(paths, _settings(repo), [{"index": 0, "mem_total_gib": 24.0, "mem_used_gib": 0.0}],
                                  available_cpu_bytes=8 * GIB)
        assert any(f"cuda:0 {TINY_LLADA.num_hidden_layers} layers" in line for line in planned), planned
        refused = placement_lines(paths, _settings(repo, trust=False),
                                  [{"index": 0, "mem_total_gib": 24.0, "mem_used_gib": 0.0}], available_cpu_bytes=GIB)
        assert refused and "materials.trust_remote_code" in refused[0]
    finally:
        import shutil

        shutil.rmtree(repo / "student")


def test_before_any_download_the_hub_pipeline_is_sized_from_its_configs_and_index(repo, tmp_path, loopback_hub):
    loopback_hub.add_repo("inclusionAI/LLaDA-Image-Turbo", repo)
    settings = Settings.model_validate({"materials": {"teacher": "inclusionAI/LLaDA-Image-Turbo"}})
    lines = {line.part: line for line in estimate(ProjectPaths.of(tmp_path), settings)}
    assert "weights index" in lines["teacher"].how
    parts = sum(_numel(repo / part) for part in ("queryformer", "text_projection"))
    encoder_bytes = sum(f.stat().st_size for f in (repo / "text_encoder").glob("*.safetensors"))
    # The index's total_size counts tensor bytes (f32 here), read as bf16: the headers' few bytes aside.
    assert lines["teacher"].gib * GIB == pytest.approx(parts * 2 + encoder_bytes, rel=0.02)
    assert not [f for f in loopback_hub.served if f.endswith(".safetensors")]
