"""Each stage's settings table lists project.yaml's own keys, derived from what its fingerprint reads."""

from pathlib import Path

import pytest

from gguf_assets.lib.demo.demo import demo_settings
from gguf_assets.lib.status.stages import stage_keys


def test_stage_keys_are_the_project_yaml_keys_each_stage_reads():
    settings = demo_settings()
    adapter = stage_keys(settings, "adapter")
    assert "training.steps" in adapter and "training.width" in adapter
    assert "training.log_every" not in adapter and "training.device" not in adapter  # cadence, not result
    shards = stage_keys(settings, "train_shards")
    assert {"precompute.shard_size", "precompute.conditioning", "precompute.target_dtype"} <= set(shards)
    # One value only (ggk feeds the final norm), so it changes nothing a stage makes; heads follow from the width
    # and layer_fusion has nothing left to fuse.
    assert "materials.student_layer" not in shards
    assert "training.heads" not in adapter and "training.layer_fusion" not in adapter
    assert "precompute.val_shard_size" not in shards and not any(k.startswith("training.") for k in shards)
    assert set(stage_keys(settings, "gguf")) >= {"output.adapter_name", "output.output_dir", "output.also_copy_to"}
    assert "output.evaluate" in stage_keys(settings, "eval_report")
    assert "output.evaluate" not in stage_keys(settings, "gguf")


def _fingerprints(paths, settings, materials) -> dict:
    """Each stage's fingerprint from these settings, with everything else it chains held fixed (the pins, the
    prompts, the fingerprints of the stages before it)."""
    from gguf_assets.lib.corpus.corpus_run import corpus_fingerprint
    from gguf_assets.lib.materials.materials_run import materials_fingerprint
    from gguf_assets.lib.output.export_run import gguf_fingerprint
    from gguf_assets.lib.output.report_run import report_fingerprint
    from gguf_assets.lib.precompute.shards_run import HALVES, half_fingerprint
    from gguf_assets.lib.training.training_run import training_fingerprint

    halves = [half_fingerprint(half, settings, materials, "prompts") for half in HALVES]
    return {"materials": materials_fingerprint(settings), "corpus": corpus_fingerprint(paths, settings, materials),
            "train_shards": halves, "val_shards": halves, "adapter": training_fingerprint(settings, ["t"], ["v"]),
            "gguf": gguf_fingerprint(settings, materials, "adapter"),
            "eval_report": report_fingerprint(settings, "gguf", ["v"])}


def test_every_key_a_stage_fingerprint_reads_is_one_of_its_settings(tmp_path):
    """A key that enters a stage's fingerprint is in that stage's settings (settings/<stage> in the UI, the
    words of `status`): the stage's own module defines both, so a new fingerprint key cannot be missed there."""
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.lib.project.manifests import MaterialsManifest
    from gguf_assets.lib.status.stages import STAGES, each_key_changed

    paths, settings = ProjectPaths.of(tmp_path), demo_settings()
    pin = {"source": "s", "commit": "c", "path": str(tmp_path)}
    materials = MaterialsManifest(teacher=pin, student=pin, vision_encoder=pin, datasets=[{**pin, "text_field": None}])
    base = _fingerprints(paths, settings, materials)
    keys = {stage: set(stage_keys(settings, stage)) for stage in STAGES}
    missed = []
    for key, changed in each_key_changed(settings):
        now = _fingerprints(paths, changed, materials)
        missed += [f"{stage}: {key}" for stage in STAGES if now[stage] != base[stage] and key not in keys[stage]]
    assert missed == []


def test_the_stage_list_is_one_list_and_every_per_stage_table_follows_it():
    """STAGES (lib/status/stages.py) is the one list of stages; the jobs' groups are its slices, and each table
    keyed by stage (here its settings; the studio's titles: studio/test_studio_feed.py) has exactly its stages, in
    its order."""
    from gguf_assets.lib.status.stages import INPUT_STAGES, SHARD_STAGES, STAGES, TRAINING_STAGES, stage_settings

    assert STAGES == ("materials", "corpus", "train_shards", "val_shards", "adapter", "gguf", "eval_report")
    assert (*INPUT_STAGES, *SHARD_STAGES, *TRAINING_STAGES) == STAGES
    assert tuple(stage_settings(demo_settings())) == STAGES


def test_the_prompt_formats_are_one_list():
    """The prompt file formats are written once (lib/project/formats.py): the corpus has a reader for each text
    format, the materials select a hub dataset's files by the same suffixes, and the refusal of another file type
    names them all."""
    from gguf_assets.lib.corpus import prompt_files
    from gguf_assets.lib.project import formats

    assert formats.PROMPT_FORMATS == (".txt", ".jsonl", ".json", ".csv", ".parquet")
    assert tuple(prompt_files._READERS) == formats.TEXT_PROMPT_FORMATS
    assert set(formats.PROMPT_FILE_SUFFIXES) == {*formats.PROMPT_FORMATS, ".txt.gz", ".jsonl.gz", ".json.gz",
                                                 ".csv.gz"}
    assert all(prompt_files.prompt_format(Path(f"a/b{suffix.upper()}")) for suffix in formats.PROMPT_FILE_SUFFIXES)
    with pytest.raises(prompt_files.CorpusError) as refused:
        prompt_files.PromptFile(Path("prompts.xml"), "text")
    assert str(refused.value) == ("prompts.xml: unsupported prompt file type. Use .txt (one prompt per line), .jsonl, "
                                  ".json or .csv, optionally gzip-compressed (.gz), or .parquet.")
