"""The studio's settings forms come from the schema, show what project.yaml holds, and save only what changed,
in place, with the file's own validation messages."""

from pathlib import Path

import pytest

from gguf_assets.lib.demo.demo import demo_settings
from gguf_assets.lib.project.settings import SECTION_CLASSES, SECTIONS, SettingsError, render_yaml, settings_from_text
from gguf_assets.studio.settings_form import apply_form, form_sections, form_values

PATH = Path("/p/project.yaml")


@pytest.fixture
def text() -> str:
    return render_yaml(demo_settings(steps=40, mock_teacher=True))


def _fields(text):
    return {f.key: f for s in form_sections(text) for f in s.fields}


def test_every_schema_key_is_a_field_with_its_help_kind_bounds_and_choices(text):
    sections = form_sections(text)
    assert [s.name for s in sections] == list(SECTIONS)
    assert [s.title for s in sections] == ["Materials", "Corpus", "Precompute", "Training", "Output"]
    fields = _fields(text)
    assert set(fields) == {f"{s}.{k}" for s in SECTIONS for k in SECTION_CLASSES[s].model_fields}
    steps = fields["training.steps"]
    assert (steps.kind, steps.value, steps.minimum, steps.maximum, steps.help) == ("int", "40", 1, None,
                                                                                  "optimizer steps")
    assert steps.default == "20000" and steps.bounds == "1 or more"
    empty = fields["corpus.empty_fraction"]
    assert (empty.kind, empty.minimum, empty.maximum, empty.bounds) == ("float", 0.0, 0.5, "0 to 0.5")
    assert fields["training.ema_decay"].bounds == "0 to below 1"
    mode = fields["precompute.mode"]
    assert mode.kind == "choice" and mode.choices == ("teacher+student", "teacher", "student")
    assert (fields["materials.trust_remote_code"].kind, fields["materials.trust_remote_code"].value) == ("bool", False)
    assert fields["precompute.mock_teacher"].value is True
    assert (fields["materials.datasets"].kind, fields["materials.datasets"].value) == ("list", "materials/demo/dataset")
    assert fields["corpus.local_prompt_files"].subsection == "Extra local prompt files"
    assert fields["training.learning_rate"].value == "0.006"


def test_a_hand_edit_shows_and_a_key_the_file_lacks_shows_its_default(text):
    edited = text.replace("  steps: 40", "  steps: 77").replace("  width: 128\n", "")
    values = form_values(edited)
    assert values["training.steps"] == "77" and values["training.width"] == "1024"  # the schema's default


def test_a_save_sets_only_the_changed_keys_in_place_and_keeps_every_comment(text):
    submitted = {**form_values(text), "training.steps": "60", "precompute.mock_teacher": False,
                 "materials.teacher": "materials/demo/teacher", "corpus.local_prompt_files": "a.txt\n\n b.txt \n",
                 "training.learning_rate": "2e-3"}
    saved = apply_form(PATH, text, submitted)
    assert saved.changes == {"training": {"steps": 60, "learning_rate": 0.002}, "precompute": {"mock_teacher": False},
                             "corpus": {"local_prompt_files": ["a.txt", "b.txt"]}}
    assert saved.settings.training.steps == 60 and saved.settings.corpus.local_prompt_files == ["a.txt", "b.txt"]
    changed = {i for i, (a, b) in enumerate(zip(text.splitlines(), saved.text.splitlines())) if a != b}
    assert len(text.splitlines()) == len(saved.text.splitlines()) and len(changed) == 4  # one line per key, in place
    assert "  steps: 60\n" in saved.text and "  # optimizer steps\n  steps: 60\n" in saved.text
    assert settings_from_text(PATH, saved.text) == saved.settings
    assert apply_form(PATH, text, form_values(text)).text == text  # nothing changed: the same bytes


@pytest.mark.parametrize("key, value, said", [
    ("training.steps", "abc", "training.steps = 'abc' must be an integer. (optimizer steps)"),
    ("training.steps", "0", "training.steps = 0 must be >= 1. (optimizer steps)"),
    ("training.heads", "7", "training.heads is 7, but ggk runs heads of 64, so width 128 has 2"),
    ("corpus.empty_fraction", "0.9", "corpus.empty_fraction = 0.9 must be <= 0.5."),
    ("precompute.mode", "both", "precompute.mode = 'both' must be one of: teacher+student, teacher, student."),
])
def test_a_bad_value_is_refused_with_the_files_line_the_key_and_the_fix(text, key, value, said):
    with pytest.raises(SettingsError) as refused:
        apply_form(PATH, text, {key: value})
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith(f"  {key.split('.')[1]}:"))
    assert str(refused.value).startswith(f"{PATH}:{line}: ") and said in str(refused.value), str(refused.value)


def test_an_unknown_key_from_the_form_is_refused(text):
    with pytest.raises(SettingsError, match="unknown key 'training.stepz'"):
        apply_form(PATH, text, {"training.stepz": "1"})


def test_a_dataset_mapping_shows_as_one_flow_line_and_reads_back_as_the_same_mapping(text):
    block = text.replace("  datasets: [materials/demo/dataset]\n",
                         "  datasets:\n  - materials/demo/dataset\n  - source: org/prompts\n    text_field: caption\n")
    shown = form_values(block)["materials.datasets"]
    assert shown == "materials/demo/dataset\n{source: org/prompts, text_field: caption}"
    assert apply_form(PATH, block, {"materials.datasets": shown}).changes == {}  # unchanged: not rewritten
    saved = apply_form(PATH, block, {"materials.datasets": shown + "\norg/more"})
    assert saved.settings.materials.datasets == ["materials/demo/dataset",
                                                 {"source": "org/prompts", "text_field": "caption"}, "org/more"]
    assert "  datasets: [materials/demo/dataset, {source: org/prompts, text_field: caption}, org/more]\n" in saved.text
    assert "    text_field: caption\n" not in saved.text  # the block's lines went with it


def test_the_query_rows_mapping_is_one_flow_line_set_and_cleared_from_the_form(text):
    fields = _fields(text)
    assert (fields["materials.query_rows"].kind, fields["materials.query_rows"].value) == ("mapping", "")
    assert apply_form(PATH, text, {"materials.query_rows": ""}).changes == {}
    line = "{source: org/t2i@main, file: transformer/model.safetensors, tensor: text_proj.query}"
    saved = apply_form(PATH, text, {"materials.query_rows": line})
    assert saved.settings.materials.query_rows == {"source": "org/t2i@main", "file": "transformer/model.safetensors",
                                                   "tensor": "text_proj.query"}
    shown = form_values(saved.text)["materials.query_rows"]
    assert apply_form(PATH, saved.text, {"materials.query_rows": shown}).changes == {}
    assert apply_form(PATH, saved.text, {"materials.query_rows": ""}).settings.materials.query_rows == {}
    with pytest.raises(SettingsError, match="materials.query_rows .*needs a non-empty tensor"):
        apply_form(PATH, text, {"materials.query_rows": "{source: org/t2i}"})
    with pytest.raises(SettingsError, match="materials.query_rows = 'org/t2i' must be a mapping"):
        apply_form(PATH, text, {"materials.query_rows": "org/t2i"})


def test_the_student_layer_is_one_yaml_value_and_only_the_final_norm_is_taken(text):
    field = _fields(text)["materials.student_layer"]
    assert (field.kind, field.value, field.default) == ("int", "-1", "-1")  # ggk feeds the final norm only
    assert apply_form(PATH, text, {"materials.student_layer": "-1"}).changes == {}
    for other in ("0", "[9, 18, 27]"):
        with pytest.raises(SettingsError, match=r"materials.student_layer .*ggk feeds the adapter the student's "
                                                r"final-norm hidden states"):
            apply_form(PATH, text, {"materials.student_layer": other})


@pytest.mark.parametrize("key", ["training.steps", "training.learning_rate", "materials.student_layer",
                                 "materials.query_rows", "materials.datasets"])
def test_a_number_too_long_for_python_is_a_settings_error_naming_the_key_not_a_crash(text, key):
    """Python reads no int of over 4,300 digits (ValueError): the form's Save says the key (the studio's 400),
    and a project.yaml holding such a number still shows in the form, as its text (the page, not a 500)."""
    long = "9" * 5000
    value = {"materials.query_rows": f"{{source: org/t2i, file: f, tensor: {long}}}",
             "materials.datasets": f"{{source: {long}}}"}.get(key, long)
    with pytest.raises(SettingsError) as refused:
        apply_form(PATH, text, {key: value})
    assert str(refused.value).startswith(f"{PATH}:") and key in str(refused.value) and len(str(refused.value)) < 600
    held = text.replace("  steps: 40\n", f"  steps: {long}\n")
    assert _fields(held)["training.steps"].value == long
    assert "training.steps = 999" in str(pytest.raises(SettingsError, apply_form, PATH, held, {}).value)
