"""The settings snapshots behind each result's record, and the words `status` uses for what changed."""

from gguf_assets.lib.demo.demo import demo_settings
from gguf_assets.lib.output.export_run import gguf_stage_settings
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.settings import replace
from gguf_assets.lib.training.training_run import adapter_stage_settings


def _adapter(settings):
    return adapter_stage_settings(settings)


def test_a_snapshot_is_kept_once_and_recalled_by_its_hash(tmp_path):
    settings = demo_settings(steps=40)
    digest = settings_history.remember(tmp_path, settings)
    assert settings_history.remember(tmp_path, settings) == digest == settings_history.settings_hash(settings)
    assert len(list((tmp_path / settings_history.SETTINGS_DIR).iterdir())) == 1
    assert settings_history.recall(tmp_path, digest) == settings
    assert settings_history.recall(tmp_path, "0" * 16) is None and settings_history.recall(tmp_path, None) is None


def test_a_damaged_or_edited_snapshot_is_not_trusted(tmp_path):
    digest = settings_history.remember(tmp_path, demo_settings(steps=40))
    file = settings_history.snapshot_file(tmp_path, digest)
    file.write_text(file.read_text().replace('"steps": 40', '"steps": 41'))
    assert settings_history.recall(tmp_path, digest) is None  # no longer what the hash names
    file.write_text("{")
    assert settings_history.recall(tmp_path, digest) is None


def test_changed_keys_names_only_what_alters_the_stage_old_to_new():
    old = demo_settings(steps=400)
    new = replace(old, training={"steps": 600, "log_every": 7}, output={"adapter_name": "edited"})
    # log_every changes no result and adapter_name is the export's: only steps is the adapter's reason.
    assert settings_history.changed_keys(old, new, _adapter) == ["training.steps 400 → 600"]
    assert settings_history.changed_keys(old, replace(old, training={"log_every": 7}), _adapter) == []
    strings = settings_history.changed_keys(old, new, gguf_stage_settings)
    assert strings == ["output.adapter_name demo-adapter → edited"]
