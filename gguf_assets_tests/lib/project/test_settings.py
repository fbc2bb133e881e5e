"""Tests for the project.yaml schema, renderer, loader and `gguf-trainer init` (gguf_assets.lib.project.settings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from gguf_assets.cli import main as cli_main
from gguf_assets.lib.project import settings as S
from gguf_assets.lib.project.settings import (
    PROJECT_FILE,
    SECTIONS,
    Settings,
    SettingsError,
    load_settings,
    render_yaml,
    replace,
    section_fields,
    settings_from_dict,
    settings_from_text,
    settings_reference_markdown,
    write_project_file,
)

PROMISED_KEYS = {
    "corpus": ["train_prompts", "val_prompts", "empty_fraction", "min_chars", "max_chars", "seed",
               "local_prompt_files"],
    "precompute": ["mode", "shard_size", "val_shard_size", "student_dtype", "teacher_batch", "token_budget",
                   "student_batch", "teacher_placement", "teacher_gpu_memory_gib", "teacher_cpu_memory_gib",
                   "mock_teacher", "device"],
    "training": ["width", "depth", "steps", "batch_size", "learning_rate", "warmup_steps", "weight_decay",
                 "grad_clip", "cosine_weight", "sigma_floor", "grad_checkpoint", "device", "log_every",
                 "validate_every", "checkpoint_every", "seed"],
    "output": ["adapter_name", "output_dir", "also_copy_to", "export_vision_encoder", "evaluate", "auto_resume"],
    "materials": ["teacher", "student", "datasets", "vision_encoder"],
}


def _valid() -> Settings:
    """Defaults plus the materials a real project must fill in (defaults alone do not validate)."""
    return replace(Settings(), materials={"teacher": "org/teacher", "student": "org/student",
                                          "datasets": ["org/prompts"]})


def _all_keys() -> list[str]:
    return [f"{name}.{f.name}" for name in SECTIONS for f in section_fields(name)]


def _write(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / PROJECT_FILE
    path.write_text(text, encoding="utf-8")
    return path


def _edit_line(text: str, section: str, key: str, new_line: str) -> tuple[str, int]:
    """Replace the `  key: ...` line of `section` with new_line; return the text and its 1-based line."""
    lines = text.splitlines()
    current = None
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+:\s*$", line):
            current = line[:-1]
        elif current == section and line.startswith(f"  {key}:"):
            lines[i] = new_line
            return "\n".join(lines) + "\n", i + 1
    raise AssertionError(f"{section}.{key} not found in the rendered YAML")


def _error_for(tmp_path: Path, section: str, key: str, new_line: str) -> tuple[str, Path, int]:
    text, line_no = _edit_line(render_yaml(_valid()), section, key, new_line)
    path = _write(tmp_path / "proj", text)
    with pytest.raises(SettingsError) as info:
        load_settings(path.parent)
    return str(info.value), path, line_no


# -- schema and rendering ----------------------------------------------------------------

def test_render_yaml_round_trips_to_equal_settings():
    original = replace(_valid(), training={"steps": 123, "learning_rate": 3e-5, "sigma_floor": 1e-6},
                       corpus={"local_prompt_files": ["extra.txt", "more/prompts.jsonl"], "empty_fraction": 0.25},
                       materials={"datasets": ["org/a", {"source": "folder/b", "text_field": "caption"}]},
                       output={"adapter_name": "yes", "also_copy_to": "/models/ggk"},
                       precompute={"mode": "student", "student_dtype": "f16", "teacher_gpu_memory_gib": 12.5})
    text = render_yaml(original, header="first line\n\nthird line")
    loaded = settings_from_dict(yaml.safe_load(text), text=text)
    assert loaded == original
    assert loaded.dataset_sources() == [S.DatasetSource("org/a"), S.DatasetSource("folder/b", "caption")]
    assert text.startswith("# first line\n#\n# third line\n")


def test_default_settings_render_to_their_defaults():
    text = render_yaml(Settings())
    assert yaml.safe_load(text) == Settings().to_dict()


def test_every_field_is_rendered_under_a_comment_line():
    text = render_yaml(Settings())
    lines = text.splitlines()
    found: dict[str, str] = {}
    section = None
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+:\s*$", line):
            section = line[:-1]
            continue
        m = re.match(r"^  ([a-z_]+): ", line)
        if m:
            found[f"{section}.{m.group(1)}"] = lines[i - 1]
    assert sorted(found) == sorted(_all_keys())
    for key, above in found.items():
        section, name = key.split(".")
        help_text = next(f.help for f in section_fields(section) if f.name == name)
        assert above.startswith("  # "), f"{key} has no comment above it: {above!r}"
        assert help_text in above, key


def test_choice_fields_list_their_choices_in_the_comment():
    text = render_yaml(Settings())
    assert "[teacher+student | teacher | student]" in text
    assert "[sequential | balanced]" in text
    assert "[bf16 | f16 | f32]" in text


def test_promised_keys_exist_with_these_names():
    for section, keys in PROMISED_KEYS.items():
        names = {f.name for f in section_fields(section)}
        missing = [k for k in keys if k not in names]
        assert not missing, f"{section} lacks {missing}"
    assert set(SECTIONS) == set(PROMISED_KEYS)


def test_trainer8_defaults():
    s = Settings()
    assert s.training.width == 1024
    assert s.training.depth == 6
    assert s.training.steps == 20000
    assert s.training.batch_size == 32
    assert s.training.learning_rate == pytest.approx(2e-4)
    assert s.training.warmup_steps == 1000
    assert s.training.cosine_weight == pytest.approx(0.5)
    assert s.corpus.empty_fraction == pytest.approx(0.01)
    assert s.precompute.teacher_placement == "sequential"
    assert s.precompute.mode == "teacher+student"
    # ggk's adapter: heads of 64, so heads follow from the width (0 = that); the student's final norm; ggk's template.
    assert s.training.width % 64 == 0 and s.training.heads == 0
    assert s.materials.student_layer == -1
    assert (s.precompute.conditioning, s.precompute.prompt_template) == ("llada-image", "{prompt}")


def test_replace_changes_only_the_named_fields():
    base = _valid()
    changed = replace(base, training={"steps": 7})
    assert changed.training.steps == 7
    assert changed.training.width == base.training.width
    assert changed.corpus == base.corpus and changed.materials == base.materials
    assert base.training.steps == 20000  # frozen original untouched


def test_settings_reference_markdown_mentions_every_key():
    md = settings_reference_markdown()
    for key in _all_keys():
        assert f"`{key}`" in md, key
    assert "one of: teacher+student, teacher, student" in md


# -- loading: valid files ----------------------------------------------------------------

def test_load_settings_reads_a_written_project(tmp_path):
    wanted = replace(_valid(), training={"steps": 55}, corpus={"seed": 9})
    write_project_file(tmp_path, wanted, header="hello")
    assert load_settings(tmp_path) == wanted


def test_partial_file_fills_in_defaults(tmp_path):
    _write(tmp_path, "materials:\n  teacher: a/b\n  student: c/d\ntraining:\n  steps: 10\n")
    s = load_settings(tmp_path)
    assert s.training.steps == 10
    assert s.training.width == 1024
    assert s.corpus == Settings().corpus


def test_exponent_float_without_dot_is_a_number(tmp_path):
    # PyYAML (YAML 1.1) reads `2e-4` as a string; the loader must still take it as 2e-4.
    _write(tmp_path, "materials:\n  teacher: a/b\n  student: c/d\ntraining:\n  learning_rate: 2e-4\n"
                     "  sigma_floor: 1E-6\n")
    s = load_settings(tmp_path)
    assert s.training.learning_rate == pytest.approx(2e-4)
    assert s.training.sigma_floor == pytest.approx(1e-6)


def test_int_given_for_float_field_becomes_float(tmp_path):
    _write(tmp_path, "materials:\n  teacher: a/b\n  student: c/d\ntraining:\n  cosine_weight: 1\n")
    value = load_settings(tmp_path).training.cosine_weight
    assert value == 1.0 and isinstance(value, float)


# -- loading: errors name file:line, key, value and the fix ------------------------------

def test_wrong_type_names_key_value_file_and_line(tmp_path):
    msg, path, line = _error_for(tmp_path, "training", "steps", '  steps: "many"')
    assert f"{path}:{line}" in msg
    assert "training.steps" in msg
    assert "'many'" in msg
    assert "integer" in msg


@pytest.mark.parametrize("line", ["  student_layer: -1", "  student_layer: [-1]"])
def test_student_layer_is_the_final_norm(tmp_path, line):
    """-1 and the list [-1] (old projects' forms) load, as -1: the final-norm states ggk feeds the adapter."""
    text, _ = _edit_line(render_yaml(_valid()), "materials", "student_layer", line)
    settings = load_settings(_write(tmp_path / "proj", text).parent)
    assert settings.materials.student_layer == -1
    assert render_yaml(settings).count("student_layer: -1") == 1  # written back as the one value


@pytest.mark.parametrize("line", ["  student_layer: 0", "  student_layer: 5", "  student_layer: [1, -1]",
                                  "  student_layer: [-2]", "  student_layer: []", "  student_layer: [1, two]",
                                  "  student_layer: 1.5", "  student_layer: true"])
def test_any_other_student_layer_names_the_key_line_and_why(tmp_path, line):
    msg, path, line_no = _error_for(tmp_path, "materials", "student_layer", line)
    assert f"{path}:{line_no}: materials.student_layer" in msg
    assert "ggk feeds the adapter the student's final-norm hidden states (layer -1) and nothing else" in msg
    assert "Set it to -1 or remove the key" in msg


def test_float_given_for_int_field_is_rejected(tmp_path):
    msg, path, line = _error_for(tmp_path, "training", "batch_size", "  batch_size: 2.5")
    assert f"{path}:{line}" in msg and "training.batch_size" in msg and "2.5" in msg


def test_a_precision_that_is_not_one_of_the_choices_names_them(tmp_path):
    msg, path, line = _error_for(tmp_path, "training", "precision", "  precision: fp16")
    assert f"{path}:{line}" in msg and "training.precision" in msg and "fp16" in msg
    assert all(choice in msg for choice in ("auto", "fp32", "bf16")), msg


def test_out_of_range_names_key_value_line_and_limit(tmp_path):
    msg, path, line = _error_for(tmp_path, "corpus", "empty_fraction", "  empty_fraction: 2")
    assert f"{path}:{line}" in msg
    assert "corpus.empty_fraction" in msg
    assert "2" in msg and "<= 0.5" in msg


@pytest.mark.parametrize(("section", "key", "number"), [
    ("training", "steps", "9" * 5000), ("training", "steps", "-" + "9" * 5000),
    ("training", "steps", "0x" + "f" * 5000),
    ("training", "learning_rate", "9" * 5000), ("materials", "student_layer", "9" * 5000)],
    ids=["steps", "negative", "hex", "float-key", "student-layer"])
def test_a_number_too_long_for_python_names_the_file_line_and_key(tmp_path, section, key, number):
    """Python reads no int of over 4,300 digits (a ValueError from YAML's int constructor) and prints no longer
    one: the file's line, the key and the range instead of a traceback, the number cut short."""
    msg, path, line = _error_for(tmp_path, section, key, f"  {key}: {number}")
    assert msg.startswith(f"{path}:{line}: {section}.{key} = {number[:20]}") and "is out of range" in msg, msg
    assert f"({len(number)} characters)" in msg and len(msg) < 600 and "\n" not in msg, msg


def test_a_number_too_long_is_an_error_of_the_cli_not_a_traceback(tmp_path, capsys):
    text, line = _edit_line(render_yaml(_valid()), "training", "steps", "  steps: " + "9" * 5000)
    path = _write(tmp_path / "proj", text)
    assert cli_main(["status", str(path.parent)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and f"{path}:{line}: training.steps" in err and "Traceback" not in err, err


def test_below_minimum_is_rejected(tmp_path):
    msg, path, line = _error_for(tmp_path, "training", "steps", "  steps: 0")
    assert f"{path}:{line}" in msg and "training.steps" in msg and ">= 1" in msg


def test_bad_choice_lists_the_allowed_values(tmp_path):
    msg, path, line = _error_for(tmp_path, "precompute", "mode", "  mode: fast")
    assert f"{path}:{line}" in msg
    assert "precompute.mode" in msg and "'fast'" in msg
    assert "teacher+student, teacher, student" in msg


def test_bad_device_is_rejected(tmp_path):
    msg, path, line = _error_for(tmp_path, "training", "device", "  device: gpu0")
    assert f"{path}:{line}" in msg and "training.device" in msg and "cuda:N" in msg


def test_unknown_key_suggests_the_right_one(tmp_path):
    msg, path, line = _error_for(tmp_path, "training", "learning_rate", "  lerning_rate: 0.0002")
    assert f"{path}:{line}" in msg
    assert "training.lerning_rate" in msg
    assert "Did you mean training.learning_rate?" in msg


def test_unknown_section_suggests_the_right_one(tmp_path):
    text = render_yaml(_valid()) + "\ntrainig:\n  steps: 5\n"
    line = text.splitlines().index("trainig:") + 1
    path = _write(tmp_path, text)
    with pytest.raises(SettingsError) as info:
        load_settings(tmp_path)
    msg = str(info.value)
    assert f"{path}:{line}" in msg
    assert "'trainig'" in msg and "Did you mean 'training'?" in msg


def test_section_that_is_not_a_mapping(tmp_path):
    path = _write(tmp_path, "materials:\n  teacher: a/b\n  student: c/d\ntraining: 5\n")
    with pytest.raises(SettingsError, match=re.escape(f"{path}:4")):
        load_settings(tmp_path)


def test_top_level_not_a_mapping(tmp_path):
    path = _write(tmp_path, "- just\n- a list\n")
    with pytest.raises(SettingsError, match="top level must be a mapping") as info:
        load_settings(tmp_path)
    assert str(path) in str(info.value)


def test_invalid_yaml_gives_file_and_line(tmp_path):
    path = _write(tmp_path, "materials:\n  teacher: a/b\ntraining:\n  steps: [1, 2\n  width: 8\n")
    with pytest.raises(SettingsError) as info:
        load_settings(tmp_path)
    msg = str(info.value)
    assert "not valid YAML" in msg
    m = re.search(re.escape(str(path)) + r":(\d+)", msg)
    assert m, msg
    assert 4 <= int(m.group(1)) <= 6  # the unclosed list on line 4 is reported where the parser gives up


def test_a_tab_is_named_in_the_message_and_libyaml_reads_files_as_the_python_loader_does(tmp_path):
    """The file is read by libyaml (fast); a refusal is worded by the pure-Python loader, which names the
    character (libyaml's text leaves it out), and a valid file gives the same settings either way."""
    # PyYAML's wheels include libyaml; without it the speed-up is gone
    assert issubclass(S._FAST_LOADER, yaml.CSafeLoader)
    path = _write(tmp_path, "training:\n\tsteps: 1\n")
    with pytest.raises(SettingsError) as info:
        load_settings(tmp_path)
    assert str(info.value) == f"{path}:2: not valid YAML (found character '\\t' that cannot start any token)"
    text = render_yaml(replace(Settings(), materials={"teacher": "a/b", "student": "c/d"}, training={"steps": 7}))
    assert yaml.load(text, Loader=S._FAST_LOADER) == yaml.safe_load(text)
    assert settings_from_text(path, text).to_dict() == settings_from_dict(yaml.safe_load(text)).to_dict()


def test_bool_given_as_string_is_rejected(tmp_path):
    msg, path, line = _error_for(tmp_path, "precompute", "mock_teacher", '  mock_teacher: "true"')
    assert f"{path}:{line}" in msg
    assert "precompute.mock_teacher" in msg and "'true'" in msg and "true or false" in msg


def test_width_must_be_a_multiple_of_ggks_head_dim(tmp_path):
    msg, path, line = _error_for(tmp_path, "training", "width", "  width: 100")
    assert f"{path}:{line}: training.width" in msg and "is 100, not a multiple of 64" in msg
    assert "use 64 or 128" in msg
    msg, path, line = _error_for(tmp_path, "training", "width", "  width: 32")
    assert f"{path}:{line}: training.width" in msg and ">= 64" in msg


@pytest.mark.parametrize(("width", "heads"), [(64, 4), (1024, 8), (128, 1)])
def test_heads_other_than_width_over_64_are_refused(tmp_path, width, heads):
    text, _ = _edit_line(render_yaml(_valid()), "training", "width", f"  width: {width}")
    text, line = _edit_line(text, "training", "heads", f"  heads: {heads}")
    path = _write(tmp_path, text)
    with pytest.raises(SettingsError) as info:
        load_settings(tmp_path)
    msg = str(info.value)
    assert f"{path}:{line}: training.heads" in msg and f"is {heads}, but ggk runs heads of 64" in msg
    assert f"width {width} has {width // 64}" in msg and "remove the key" in msg


@pytest.mark.parametrize(("width", "heads"), [(64, 0), (64, 1), (1024, 16), (1024, 0), (192, 3)])
def test_heads_of_width_over_64_or_zero_load(tmp_path, width, heads):
    text, _ = _edit_line(render_yaml(_valid()), "training", "width", f"  width: {width}")
    text, _ = _edit_line(text, "training", "heads", f"  heads: {heads}")
    _write(tmp_path, text)
    assert load_settings(tmp_path).training.heads == heads


def test_heads_and_layer_fusion_change_no_training_run():
    """heads follow from the width and layer_fusion has one layer to fuse: old project files that set them load,
    and keep their adapter."""
    from gguf_assets.lib.training.training_run import training_fingerprint

    base = replace(_valid(), training={"width": 1024})
    same = [replace(base, training={"heads": 16}), replace(base, training={"layer_fusion": "mix"})]
    assert {training_fingerprint(s, ["t"], ["v"]) for s in same} == {training_fingerprint(base, ["t"], ["v"])}
    assert training_fingerprint(replace(base, training={"width": 512}), ["t"], ["v"]) != training_fingerprint(
        base, ["t"], ["v"])


@pytest.mark.parametrize("template", ["plain", "{text}", "llada image", ""])
def test_a_prompt_template_without_the_prompt_is_refused(tmp_path, template):
    msg, path, line = _error_for(tmp_path, "precompute", "prompt_template", f"  prompt_template: '{template}'")
    assert f"{path}:{line}: precompute.prompt_template" in msg and "must contain {prompt} or be llada-image" in msg


@pytest.mark.parametrize("template", ["{prompt}", "a photo of {prompt}", "llada-image"])
def test_the_teachers_template_holds_the_prompt_or_is_ggks(tmp_path, template):
    """The template is the teacher's alone (the student's text is always ggk's template, whatever it says)."""
    from gguf_assets.lib.precompute.shards_run import half_settings

    text, _ = _edit_line(render_yaml(_valid()), "precompute", "prompt_template", f"  prompt_template: '{template}'")
    _write(tmp_path, text)
    settings = load_settings(tmp_path)
    assert settings.precompute.prompt_template == template
    assert half_settings("student", settings) == half_settings("student", _valid())


def test_conditioning_is_ggks_llada_image_only(tmp_path):
    msg, path, line = _error_for(tmp_path, "precompute", "conditioning", "  conditioning: sd3")
    assert f"{path}:{line}: precompute.conditioning" in msg and "'sd3'" in msg and "llada-image" in msg
    text, _ = _edit_line(render_yaml(_valid()), "precompute", "conditioning", "  conditioning: llada-image")
    _write(tmp_path / "ok", text)
    assert load_settings(tmp_path / "ok").precompute.conditioning == "llada-image"


def test_target_standardization_offers_its_choices_and_isotropic_loads(tmp_path):
    field = next(f for f in section_fields("training") if f.name == "target_standardization")
    assert "isotropic" in field.choices and Settings().training.target_standardization == field.choices[0]
    msg, path, line = _error_for(tmp_path, "training", "target_standardization", "  target_standardization: rows")
    assert f"{path}:{line}: training.target_standardization" in msg and ", ".join(field.choices) in msg
    text, _ = _edit_line(render_yaml(_valid()), "training", "target_standardization",
                         "  target_standardization: isotropic")
    _write(tmp_path / "ok", text)
    assert load_settings(tmp_path / "ok").training.target_standardization == "isotropic"


def test_min_chars_above_max_chars(tmp_path):
    text, line = _edit_line(render_yaml(_valid()), "corpus", "min_chars", "  min_chars: 500")
    text, _ = _edit_line(text, "corpus", "max_chars", "  max_chars: 100")
    path = _write(tmp_path, text)
    with pytest.raises(SettingsError, match=re.escape(f"{path}:{line}: corpus.min_chars")):
        load_settings(tmp_path)


@pytest.mark.parametrize("name", ["a/b", "..", ".", "x\\y", "", "c:d"])
def test_adapter_name_must_be_a_plain_file_name(tmp_path, name):
    value = yaml.safe_dump(name).splitlines()[0]  # quoted where YAML needs it
    msg, path, line = _error_for(tmp_path, "output", "adapter_name", f"  adapter_name: {value}")
    assert f"{path}:{line}" in msg
    assert "output.adapter_name" in msg and repr(name) in msg


def test_adapter_name_plain_is_accepted(tmp_path):
    text, _ = _edit_line(render_yaml(_valid()), "output", "adapter_name", "  adapter_name: my-adapter.v2")
    _write(tmp_path, text)
    assert load_settings(tmp_path).output.adapter_name == "my-adapter.v2"


@pytest.mark.parametrize("url, said", [
    ("ftp://hooks.example.com/T0KEN", "must start with http:// or https:// (not ftp:)"),
    ("hooks.example.com/T0KEN", "must start with http:// or https://"),
    ("https:///T0KEN", "names no host"),
    ("'https://hooks.example.com:port/T0KEN'", "is not a URL"),
])
def test_a_notify_url_that_is_no_web_address_is_refused_without_repeating_it(tmp_path, url, said):
    """output.notify_url (#65): http or https only, named at its line; the message never repeats the URL, which may
    hold a token (a run that stops on it logs the message)."""
    msg, path, line = _error_for(tmp_path, "output", "notify_url", f"  notify_url: {url}")
    assert msg.startswith(f"{path}:{line}: output.notify_url {said}"), msg
    assert "T0KEN" not in msg


def test_a_change_of_the_notify_url_is_said_by_scheme_and_host_only():
    from gguf_assets.lib.project.settings_history import changed_keys

    old = _valid()
    new = replace(old, output={"notify_url": "https://hooks.example.com:8443/services/T0KEN?key=secret"})
    assert new.output.notify_url.endswith("key=secret")  # the file keeps it whole: only what is printed is cut
    assert changed_keys(old, new, lambda s: s.to_dict()) == ['output.notify_url "" → https://hooks.example.com:8443']


def test_empty_materials_are_named(tmp_path):
    # The teacher is checked first; with the teacher unneeded the student is named.
    path = _write(tmp_path, "materials:\n  teacher: ''\n  student: ''\n")
    with pytest.raises(SettingsError, match=re.escape(f"{path}:2: materials.teacher")):
        load_settings(tmp_path)
    _write(tmp_path, "materials:\n  teacher: ''\n  student: ''\nprecompute:\n  mock_teacher: true\n")
    with pytest.raises(SettingsError, match=re.escape(f"{path}:3: materials.student")):
        load_settings(tmp_path)
    _write(tmp_path, "materials:\n  student: ''\nprecompute:\n  mode: student\n")
    with pytest.raises(SettingsError, match=re.escape(f"{path}:2: materials.student")):
        load_settings(tmp_path)


def test_bad_dataset_entries(tmp_path):
    _write(tmp_path, "materials:\n  teacher: a/b\n  student: c/d\n  datasets:\n    - {source: x, field: t}\n")
    with pytest.raises(SettingsError, match="unknown keys \\['field'\\]"):
        load_settings(tmp_path)
    _write(tmp_path, "materials:\n  teacher: a/b\n  student: c/d\n  datasets: org/prompts\n")
    with pytest.raises(SettingsError, match="materials.datasets"):
        load_settings(tmp_path)


def test_missing_project_file_points_at_init(tmp_path):
    with pytest.raises(SettingsError) as info:
        load_settings(tmp_path / "nowhere")
    msg = str(info.value)
    assert "gguf-trainer init" in msg and str(tmp_path / "nowhere") in msg


# -- gguf-trainer init ---------------------------------------------------------------------

@pytest.fixture
def restore_env(monkeypatch):
    """init points DAGSTER_HOME / GGUF_ASSETS_PROJECT at the project; put them back afterwards."""
    for var in ("DAGSTER_HOME", "GGUF_ASSETS_PROJECT"):
        monkeypatch.setenv(var, "placeholder")
    return monkeypatch


def test_init_writes_defaults_that_must_be_filled_in(tmp_path, restore_env, capsys):
    project = tmp_path / "new-project"
    assert cli_main(["init", str(project)]) == 0
    path = project / PROJECT_FILE
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# gguf_assets project settings.")
    assert yaml.safe_load(text) == Settings().to_dict()
    assert (project / ".dagster" / "dagster.yaml").is_file()
    assert "materials.student" in capsys.readouterr().out
    # The reference run's practical figures sit under the section they are about.
    for section, figures in (("corpus", ("3.7 h", "4.5 prompts/s")), ("precompute", ("2.4 prompts/s", "balanced")),
                             ("training", ("0.965", "55 min", "RTX 5090"))):
        block = text.split(f"\n{section}:\n")[1].split("\n\n")[0]
        assert all(f in " ".join(block.replace("#", "").split()) for f in figures), (section, block)

    # Materials are empty, so the fresh project does not validate until they are filled in.
    with pytest.raises(SettingsError) as info:
        load_settings(project)
    teacher_line = text.splitlines().index("  teacher: ''") + 1
    assert f"{path}:{teacher_line}: materials.teacher" in str(info.value)

    filled = text.replace("  teacher: ''", "  teacher: org/teacher")
    path.write_text(filled, encoding="utf-8")
    with pytest.raises(SettingsError) as info:
        load_settings(project)
    student_line = text.splitlines().index("  student: ''") + 1
    assert f"{path}:{student_line}: materials.student" in str(info.value)

    path.write_text(filled.replace("  student: ''", "  student: org/student"), encoding="utf-8")
    assert load_settings(project) == replace(Settings(), materials={"teacher": "org/teacher",
                                                                    "student": "org/student"})


def test_second_init_refuses_without_force(tmp_path, restore_env, capsys):
    project = tmp_path / "p"
    assert cli_main(["init", str(project)]) == 0
    path = project / PROJECT_FILE
    edited = path.read_text(encoding="utf-8").replace("  steps: 20000", "  steps: 5")
    path.write_text(edited, encoding="utf-8")
    before = path.stat()
    capsys.readouterr()

    assert cli_main(["init", str(project)]) != 0
    assert "--force" in capsys.readouterr().err
    assert path.read_text(encoding="utf-8") == edited
    assert path.stat().st_mtime_ns == before.st_mtime_ns and path.stat().st_ino == before.st_ino

    assert cli_main(["init", "--force", str(project)]) == 0
    assert yaml.safe_load(path.read_text(encoding="utf-8"))["training"]["steps"] == 20000


def test_run_with_bad_project_file_exits_2_with_message(tmp_path, restore_env, capsys):
    _write(tmp_path, "training:\n  steps: many\n")
    assert cli_main(["run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / PROJECT_FILE}:2" in err and "training.steps" in err


@pytest.mark.parametrize("name", ["report", "mine.report"])
def test_adapter_names_that_collide_with_reports_are_refused(tmp_path, name):
    msg, path, line = _error_for(tmp_path, "output", "adapter_name", f"  adapter_name: {name}")
    assert f"{path}:{line}: output.adapter_name" in msg and "would overwrite a report" in msg


def test_a_key_set_twice_names_both_lines(tmp_path):
    text = render_yaml(_valid())
    text, line = _edit_line(text, "training", "width", "  width: 512\n  steps: 10\n  width: 256")
    path = _write(tmp_path, text)
    with pytest.raises(SettingsError, match=re.escape(f"{path}:{line + 2}: training.width is set twice "
                                                      f"(lines {line} and {line + 2})")):
        load_settings(tmp_path)
    # A whole section twice: its keys would be dropped without a word.
    path = _write(tmp_path, render_yaml(_valid()) + "\ntraining:\n  steps: 5\n")
    with pytest.raises(SettingsError, match=r"project.yaml:\d+: training is set twice"):
        load_settings(tmp_path)


@pytest.mark.parametrize("section,key,value", [("training", "learning_rate", ".nan"),
                                               ("training", "learning_rate", ".inf"),
                                               ("training", "sigma_floor", "-.inf")])
def test_nan_and_infinity_are_refused_by_name(tmp_path, section, key, value):
    msg, path, line = _error_for(tmp_path, section, key, f"  {key}: {value}")
    assert f"{path}:{line}: {section}.{key}" in msg and "must be a finite number" in msg


def test_a_byte_that_is_not_utf8_names_line_and_offset(tmp_path):
    text = render_yaml(_valid())
    text, line = _edit_line(text, "output", "adapter_name", "  adapter_name: caf\udce9")
    path = tmp_path / PROJECT_FILE
    data = text.encode("utf-8", "surrogateescape")  # a Latin-1 é, as an old editor saves it
    path.write_bytes(data)
    offset = data.index(b"\xe9")
    with pytest.raises(SettingsError, match=re.escape(f"{path}:{line}: byte 0xe9 at byte offset {offset}")):
        load_settings(tmp_path)
