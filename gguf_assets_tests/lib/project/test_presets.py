"""Presets change only the keys they name, in the project.yaml text, comments kept."""

from pathlib import Path

import pytest

from gguf_assets.lib.demo.demo import demo_settings
from gguf_assets.lib.project.presets import PRESETS, preset, set_keys
from gguf_assets.lib.project.settings import render_yaml, settings_from_text

TEXT = """# my project
materials:
  teacher: org/teacher   # the big one
  student: org/student
training:
  # how long
  steps: 400   # short for now
  width: 64
"""


def test_set_keys_replaces_values_in_place_and_keeps_every_comment():
    out = set_keys(TEXT, {"training": {"steps": 2000, "validate_every": 250}, "corpus": {"train_prompts": 9}})
    assert "  steps: 2000   # short for now\n" in out and "  teacher: org/teacher   # the big one\n" in out
    assert out.index("validate_every: 250") > out.index("width: 64")  # added at its section's end
    assert out.endswith("\ncorpus:\n  train_prompts: 9\n")  # a missing section is added
    comments = lambda text: [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]  # noqa: E731
    assert comments(out) == comments(TEXT)
    assert set_keys(TEXT, {}) == TEXT


@pytest.mark.parametrize("chosen", PRESETS, ids=lambda p: p.name)
def test_every_preset_applies_to_a_full_project_file_and_validates(chosen, tmp_path):
    text = render_yaml(demo_settings())
    settings = settings_from_text(tmp_path / "project.yaml", set_keys(text, chosen.changes))
    for section, values in chosen.changes.items():
        for key, value in values.items():
            assert getattr(getattr(settings, section), key) == value, (section, key)


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(KeyError, match="first look"):
        preset("fastest")


def test_set_keys_replaces_a_block_list_whole_and_keeps_the_comments_among_its_items():
    text = ("corpus:\n  local_prompt_files:\n    - a.txt\n    # the second file\n    - b.txt\n  train_prompts: 5\n"
            "materials:\n  datasets:\n  - org/prompts\n  student: org/student\n  teacher: org/teacher\n")
    out = set_keys(text, {"corpus": {"local_prompt_files": ["c.txt"]}, "materials": {"datasets": []}})
    assert out == ("corpus:\n  local_prompt_files: [c.txt]\n    # the second file\n  train_prompts: 5\n"
                   "materials:\n  datasets: []\n  student: org/student\n  teacher: org/teacher\n")
    assert settings_from_text(Path("project.yaml"), out).corpus.local_prompt_files == ["c.txt"]
