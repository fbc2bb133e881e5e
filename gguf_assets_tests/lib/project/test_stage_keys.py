"""Each stage's settings table lists project.yaml's own keys, derived from what its fingerprint reads."""

from gguf_assets.lib.demo.demo import demo_settings
from gguf_assets.lib.project.pipeline import stage_keys


def test_stage_keys_are_the_project_yaml_keys_each_stage_reads():
    settings = demo_settings()
    adapter = stage_keys(settings, "adapter")
    assert "training.steps" in adapter and "training.width" in adapter
    assert "training.log_every" not in adapter and "training.device" not in adapter  # cadence, not result
    shards = stage_keys(settings, "train_shards")
    assert {"precompute.shard_size", "materials.student_layer", "precompute.target_dtype"} <= set(shards)
    assert "precompute.val_shard_size" not in shards and not any(k.startswith("training.") for k in shards)
    assert set(stage_keys(settings, "gguf")) >= {"output.adapter_name", "output.output_dir", "output.also_copy_to"}
    assert "output.evaluate" in stage_keys(settings, "eval_report")
    assert "output.evaluate" not in stage_keys(settings, "gguf")
