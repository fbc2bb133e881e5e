"""Presets change only the keys they name, in the project.yaml text, comments kept."""

from pathlib import Path

import pytest

from gguf_assets.lib.demo.demo import demo_settings
from gguf_assets.lib.project.presets import PRESETS, preset, set_keys
from gguf_assets.lib.project.settings import SettingsError, render_yaml, settings_from_text

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


def test_set_keys_edits_a_flow_style_section_in_place():
    """YAML's parser finds the values: a flow section is edited, not followed by a second `training:` block
    (which the settings check refuses as a key set twice)."""
    text = "materials: {student: org/student}\ntraining: {steps: 5,   # short\n  width: 64}  # small\n"
    out = set_keys(text, {"training": {"steps": 7, "depth": 2}, "materials": {"teacher": "org/t"}})
    assert out == ("materials: {student: org/student, teacher: org/t}\ntraining: {steps: 7,   # short\n"
                   "  width: 64, depth: 2}  # small\n")
    assert set_keys("training: {}\n", {"training": {"steps": 7}}) == "training: {steps: 7}\n"


def test_set_keys_edits_an_anchored_section_and_keeps_the_anchor():
    text = "training: &t\n  steps: 5   # short\n  width: 64\nlater: *t\n"
    out = set_keys(text, {"training": {"steps": 7, "depth": 2}})
    assert out == "training: &t\n  steps: 7   # short\n  width: 64\n  depth: 2\nlater: *t\n"
    # A value other keys read through an alias would change them too: refused, not done behind the user's back.
    with pytest.raises(SettingsError, match=r"project.yaml:2: training.steps: its value is anchored as &s"):
        set_keys("training:\n  steps: &s 5\n  depth: *s\n", {"training": {"steps": 7}})


def test_a_hash_inside_quotes_is_the_value_not_a_comment():
    text = 'output:\n  adapter_name: "my # adapter"   # the name\n  output_dir: out\n'
    out = set_keys(text, {"output": {"adapter_name": "ours"}})
    assert out == "output:\n  adapter_name: ours   # the name\n  output_dir: out\n"  # no stray `adapter"`
    out = set_keys(out, {"output": {"adapter_name": "a # b"}})
    assert out == "output:\n  adapter_name: 'a # b'   # the name\n  output_dir: out\n"
    full = f"materials:\n  teacher: org/t\n  student: org/s\n{out}"
    assert settings_from_text(Path("project.yaml"), full).output.adapter_name == "a # b"


def test_a_preset_changes_only_its_lines_of_a_full_project_file_and_every_comment_stays():
    text = render_yaml(demo_settings()).replace("\n", "\r\n")  # CRLF kept too
    chosen = preset("seed reference (trainer8)")
    out = set_keys(text, chosen.changes)
    before, after = text.split("\r\n"), out.split("\r\n")
    assert len(before) == len(after) and "\n" not in out.replace("\r\n", "")
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert changed and all(a.split(":")[0] == b.split(":")[0] and "#" not in a + b for a, b in changed)
    assert [line for line in after if line.lstrip().startswith("#")] == \
        [line for line in before if line.lstrip().startswith("#")]


def test_set_keys_fills_an_empty_section_and_refuses_what_it_cannot_edit():
    assert set_keys("training:   # soon\ncorpus:\n  train_prompts: 9\n", {"training": {"steps": 7}}) == \
        "training:   # soon\n  steps: 7\ncorpus:\n  train_prompts: 9\n"
    assert set_keys("", {"training": {"steps": 7}}) == "training:\n  steps: 7\n"
    with pytest.raises(SettingsError, match=r"^p.yaml:1: training is not a mapping of settings"):
        set_keys("training: 5\n", {"training": {"steps": 7}}, path="p.yaml")
    with pytest.raises(SettingsError, match=r"^p.yaml:3: not valid YAML"):
        set_keys("training:\n  steps: [5\n", {"training": {"steps": 7}}, path="p.yaml")
