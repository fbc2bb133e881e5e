"""The studio's settings forms, generated from the settings schema (lib/project/settings.py): one section per
form, each field with its help, bounds, choices and the value project.yaml holds now.

project.yaml stays the one source of truth: the form is built from the file's text on every page load (a
hand edit shows), and a save changes only the keys the user changed, in that text (``set_keys`` keeps
comments and order), then checks the result as every run does (``settings_from_text``: the file's line,
the key and the fix), before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml

from gguf_assets.lib.project.presets import set_keys
from gguf_assets.lib.project.settings import (
    EXPONENT_FLOAT,
    INT64_MAX,
    INT64_MIN,
    SECTION_CLASSES,
    SECTIONS,
    LongNumber,
    Settings,
    SettingsError,
    load_yaml,
    settings_from_text,
    yaml_value,
)

TITLES = {"materials": "Materials", "corpus": "Corpus", "precompute": "Precompute", "training": "Training",
          "output": "Output"}
# Shown under their own heading inside their section, as the seed app's form has them.
SUBSECTIONS = {"corpus.local_prompt_files": "Extra local prompt files"}
# What any number field can hold, as settings.py reads and checks it: the page checks each number field on the
# field itself with these (and the field's own bounds) before a Save is sent; the server checks again.
NUMBER_RULES = {"int_min": INT64_MIN, "int_max": INT64_MAX, "exponent_float": EXPONENT_FLOAT.pattern}


@dataclass(frozen=True)
class FormField:
    """One project.yaml key as a form field. ``value`` is what the form shows: text for numbers and strings
    (as YAML writes them), a bool for a checkbox, one line per item for a list."""

    section: str
    name: str
    kind: str  # int, float, bool, choice, text, list, mapping (a one-line YAML mapping, e.g. materials.query_rows),
    # value (one of several YAML forms on one line, e.g. materials.student_layer: -1 or [9, 18, 27])
    help: str
    value: Any
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    exclusive_max: bool = False  # lt, not le

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def changed(self) -> bool:
        """The value differs from the schema's default (both as the form shows them): the page marks it."""
        return self.value != self.default

    @property
    def subsection(self) -> str | None:
        return SUBSECTIONS.get(self.key)

    @property
    def bounds(self) -> str:
        """The bounds in words: "1 or more", "0 to 0.5", "0 to below 1"."""
        low, high = self.minimum, self.maximum
        upper = "" if high is None else (f"below {_number(high)}" if self.exclusive_max else _number(high))
        if low is not None and high is not None:
            return f"{_number(low)} to {upper}"
        if low is not None:
            return f"{_number(low)} or more"
        return f"at most {upper}" if high is not None else ""


@dataclass(frozen=True)
class FormSection:
    name: str
    title: str
    fields: list[FormField]


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _kind(annotation) -> str:
    if get_origin(annotation) is Literal:
        return "choice"
    if annotation is bool:
        return "bool"
    if annotation is int:
        return "int"
    if annotation is float:
        return "float"
    if annotation is list or get_origin(annotation) is list:
        return "list"
    if annotation is dict or get_origin(annotation) is dict:
        return "mapping"
    if get_origin(annotation) in (Union, UnionType):
        return "value"
    return "text"


def _bounds(metadata: list) -> tuple[float | None, float | None]:
    low = high = None
    for m in metadata:
        if isinstance(m, (annotated_types.Ge, annotated_types.Gt)):
            low = m.ge if isinstance(m, annotated_types.Ge) else m.gt
        if isinstance(m, (annotated_types.Le, annotated_types.Lt)):
            high = m.le if isinstance(m, annotated_types.Le) else m.lt
    return low, high


def shown(kind: str, value: Any) -> Any:
    """A project.yaml value as its form field shows it."""
    if kind == "bool":
        return value if isinstance(value, bool) else bool(value)
    if kind == "list":
        items = value if isinstance(value, list) else ([] if value in (None, "") else [value])
        return "\n".join(item if isinstance(item, str) else yaml_value(item) for item in items)
    if kind in ("text", "choice"):
        return "" if value is None else str(value)
    if kind == "mapping":
        return "" if value in (None, "", {}) else yaml_value(value)
    if kind == "value":
        return yaml_value(value)
    return "" if value is None else yaml_value(value)


def _file_values(text: str) -> dict:
    """The sections as the file holds them (also when they do not validate: the form shows what is there)."""
    try:
        raw = load_yaml(text)
    except yaml.YAMLError:
        return {}
    return {name: section for name, section in raw.items() if isinstance(section, dict)} \
        if isinstance(raw, dict) else {}


def form_sections(text: str) -> list[FormSection]:
    """The five settings forms for a project.yaml text: every key of the schema, the file's value or its default."""
    in_file, defaults = _file_values(text), Settings()
    out = []
    for section in SECTIONS:
        fields = []
        for name, info in SECTION_CLASSES[section].model_fields.items():
            kind = _kind(info.annotation)
            default = getattr(getattr(defaults, section), name)
            value = in_file.get(section, {}).get(name, default)
            low, high = _bounds(list(info.metadata))
            fields.append(FormField(section, name, kind, info.description or "", shown(kind, value),
                                    shown(kind, default), low, high,
                                    tuple(get_args(info.annotation)) if kind == "choice" else (),
                                    any(isinstance(m, annotated_types.Lt) for m in info.metadata)))
        out.append(FormSection(section, TITLES[section], fields))
    return out


def form_values(text: str) -> dict[str, Any]:
    """{section.key: shown value} of every field: what the page fills its form with after a save or a preset."""
    return {f.key: f.value for s in form_sections(text) for f in s.fields}


def _flow_mapping(line: str) -> Any:
    """A list line written as a YAML mapping (`{source: org/ds, text_field: body}`), or the line as is when it
    is no YAML: the settings check says what an item must be."""
    try:
        return load_yaml(line)
    except yaml.YAMLError:
        return line


def _typed(kind: str, value: Any) -> Any:
    """A submitted field as the YAML value to write. A number field's text is read as YAML reads the file, and
    kept as text when it is no number, so the check that follows says what a hand edit would get
    (``training.steps = 'abc' must be an integer``)."""
    if kind == "bool":
        return value
    if kind == "list":
        if not isinstance(value, (str, list)):
            return value  # the settings check says what the key must be
        lines = value.splitlines() if isinstance(value, str) else value
        items = []
        for line in (str(item).strip() for item in lines):
            if line:
                items.append(_flow_mapping(line) if line.startswith("{") else line)
        return items
    if kind == "mapping" and isinstance(value, str):
        if not value.strip():
            return {}
        try:  # `{source: org/t2i, file: f.safetensors, tensor: t}`; anything else goes to the settings check as is
            parsed = load_yaml(value)
        except yaml.YAMLError:
            return value
        return parsed if isinstance(parsed, dict) else value
    if kind == "value" and isinstance(value, str):
        try:  # `[9, 18, 27]` or `-1`; anything else goes to the settings check as is
            return load_yaml(value)
        except yaml.YAMLError:
            return value
    if kind in ("int", "float") and isinstance(value, str):
        if kind == "float" and EXPONENT_FLOAT.match(value.strip()):
            return float(value)  # `2e-3`, which YAML 1.1 would leave a string (settings.py reads it so too)
        try:
            parsed = load_yaml(value)
        except yaml.YAMLError:
            return value
        if isinstance(parsed, LongNumber):
            return parsed  # a 5,000-digit number: the settings check says it is out of range (not a 500)
        if isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
            if kind == "float" and isinstance(parsed, int):
                return parsed  # as the file would hold it; the settings check bounds it (no float overflow here)
            return float(parsed) if kind == "float" else parsed
        return value.strip()
    return value


@dataclass(frozen=True)
class FormSave:
    text: str  # the new project.yaml text (not written yet)
    settings: Settings  # what it holds, checked as `load_settings` checks the file
    changes: dict[str, dict]  # {section: {key: value}} that were set


def apply_form(path: Path, text: str, submitted: dict[str, Any]) -> FormSave:
    """project.yaml ``text`` with the submitted fields ({section.key: form value}) that differ from it set in
    place; SettingsError (file:line, key, the fix) when the result would not load, or a key is unknown."""
    fields = {f.key: f for s in form_sections(text) for f in s.fields}
    changes: dict[str, dict] = {}
    for key, value in submitted.items():
        field = fields.get(key)
        if field is None:
            raise SettingsError(f"{path}: the form sent an unknown key {key!r}; reload the studio page")
        if shown(field.kind, _typed(field.kind, value)) != field.value:
            changes.setdefault(field.section, {})[field.name] = _typed(field.kind, value)
    new_text = set_keys(text, changes)
    return FormSave(new_text, settings_from_text(path, new_text), changes)
