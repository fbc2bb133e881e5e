"""Named sets of project.yaml changes (the studio's Settings panel), and a comment-keeping YAML edit.

A preset changes only the keys it names, in the project.yaml text itself, so the user's comments
and every other setting stay as they are; the result is validated like the file before it is written.
``set_keys`` (also the studio's form and `runs --use`) finds each value with YAML's own parser and
rewrites only that value's text.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gguf_assets.lib.project.settings import PROJECT_FILE, Settings, SettingsError, load_yaml, yaml_value


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    changes: dict[str, dict] = field(default_factory=dict)  # {section: {key: value}}


def _trainer8() -> dict[str, dict]:
    t = Settings().training  # the defaults are the seed's trainer8 recipe (docs/recipe.md)
    keys = ("width", "depth", "heads", "steps", "batch_size", "learning_rate", "warmup_steps", "weight_decay",
            "grad_clip", "cosine_weight", "ema_decay", "sigma_floor", "target_standardization", "relational_weight",
            "init", "query_lr_scale")
    return {"training": {k: getattr(t, k) for k in keys}, "corpus": {"train_prompts": 60000},
            "materials": {"teacher_layer": -1, "student_layer": -1}}


# A short CPU run's start (#68, benchmarks/bench_quality.py --study): the untrained adapter outputs each query row's
# mean, and the query rows learn 10 times as fast as the rest. On the demo's shards at 1,200 steps: +0.005 val centred
# cosine on its pair, +0.02 on an independent one; not measured at the seed's shape, so trainer8 keeps its own.
CPU_START = {"init": "row_means", "query_lr_scale": 10.0}

PRESETS = (
    Preset("first look", "2,000 steps, validating every 250: does this pair learn at all, before the full run? "
           "Nothing else changes.", {"training": {"steps": 2000, "validate_every": 250}}),
    Preset("seed reference (trainer8)", "the seed's reference recipe: 1024 x 6, 20,000 steps, 60k train prompts, "
           "both models read at their last layer (0.965 on an RTX 5090 in about 55 min)", _trainer8()),
    Preset("CPU scale", "a small adapter for a CPU: 128 wide (two of ggk's 64-wide heads), 1 block, batch 16, "
           "lr 6e-3, starting at the query rows' means, the rows at 10 times the lr (the demo's recipe)",
           {"training": {"width": 128, "depth": 1, "batch_size": 16, "learning_rate": 6e-3, **CPU_START,
                         "device": "cpu"}}),
)


def preset(name: str) -> Preset:
    found = next((p for p in PRESETS if p.name == name), None)
    if found is None:
        raise KeyError(f"no preset {name!r}; the presets are {[p.name for p in PRESETS]}")
    return found


def set_keys(text: str, changes: dict[str, dict], *, path: Path | str = PROJECT_FILE) -> str:
    """``text`` (a project.yaml) with each ``section.key`` set to its new value, in place.

    YAML's own parser finds each value: plain, quoted (a ``#`` inside quotes is no comment), flow or block,
    in a block or a flow section (``training: {steps: 5}``), anchored or aliased. Only that value's text is
    rewritten, as one flow value; the comment after it, the comment lines among a block value's items and every
    other byte of the file stay. A key its section lacks is added at the section's end, a section the file
    lacks at the file's end. The result is parsed again and must hold the old settings with just these changed.
    SettingsError (``path``:line) when ``text`` is not YAML, a section to change is not a mapping, or a change
    cannot be made in place (a value that other keys read through an alias).
    """
    changes = {section: values for section, values in changes.items() if values}
    if not changes:
        return text
    try:
        root = yaml.compose(text, Loader=_LOADER)
        tokens = list(yaml.scan(text, Loader=_LOADER))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise SettingsError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)}); fix it in the editor, "
                            "then set the values again.") from None
    edit = _Edit(text, tokens, "\r\n" if "\r\n" in text else "\n", path)
    for section, values in changes.items():
        rendered = {str(key): _flow(value) for key, value in values.items()}
        entry = _entry(root, section)
        if entry is None:
            edit.add(root, section, rendered)
            continue
        key_node, node = entry
        if isinstance(node, yaml.MappingNode):
            missing = {}
            for key, value in rendered.items():
                found = _entry(node, key)
                if found:
                    edit.replace(*found, value, where=f"{path}:{found[0].start_mark.line + 1}: {section}.{key}")
                else:
                    missing[key] = value
            if missing:
                edit.add(node, None, missing)
        elif node.tag == "tag:yaml.org,2002:null" and not edit.is_alias(key_node):
            edit.fill(root, key_node, node, rendered)  # `training:` with nothing under it yet
        else:
            raise SettingsError(f"{path}:{key_node.start_mark.line + 1}: {section} is not a mapping of settings "
                                f"(`{section}:` then one `key: value` a line under it); fix it in the editor.")
    new_text = edit.apply()
    _check(text, new_text, changes, path)
    return new_text


# The pure-Python parser: its marks count characters from the text's start, a BOM included (libyaml's skip the
# BOM). A project.yaml takes it about 10 ms, and an edit is one click.
_LOADER = yaml.SafeLoader


def _flow(value: Any) -> str:
    """``value`` as one line of YAML: yaml_value, or JSON (also YAML) for a string with a line break, which
    yaml_value would fold over lines."""
    text = yaml_value(value)
    return text if "\n" not in text else json.dumps(value, ensure_ascii=False)


def _entry(mapping: yaml.Node | None, key: str) -> tuple[yaml.Node, yaml.Node] | None:
    """The (key node, value node) of ``key`` in a mapping node: the last, as the last one wins on load."""
    if not isinstance(mapping, yaml.MappingNode):
        return None
    return next((pair for pair in reversed(mapping.value)
                 if isinstance(pair[0], yaml.ScalarNode) and pair[0].value == key), None)


class _Edit:
    """Text edits located by the parser's marks (character offsets), applied back to front."""

    def __init__(self, text: str, tokens: list[yaml.Token], newline: str, path: Path | str) -> None:
        self.text, self.tokens, self.nl, self.path = text, tokens, newline, path
        # Comments are the only text between tokens that is not white space.
        self.gaps = [(a.end_mark.index, b.start_mark.index) for a, b in zip(tokens, tokens[1:])
                     if a.end_mark.index < b.start_mark.index]
        self.edits: list[tuple[int, int, int, int, str]] = []  # (start, end, rank, order, new text)

    def _edit(self, lo: int, hi: int, new: str, rank: int = 0) -> None:
        """Replace text[lo:hi] by ``new``. Inserts at one place land in the order made, those of a lower
        ``rank`` first: a key added at a section's end goes before a section added after it."""
        self.edits.append((lo, hi, rank, len(self.edits), new))

    def _token_after(self, index: int) -> yaml.Token | None:
        """The first token with text that starts at or after ``index``."""
        return next((t for t in self.tokens if t.start_mark.index >= index and t.end_mark.index > t.start_mark.index),
                    None)

    def is_alias(self, key_node: yaml.Node) -> bool:
        colon = self._token_after(key_node.end_mark.index)
        after = colon and self._token_after(colon.end_mark.index)
        return isinstance(colon, yaml.ValueToken) and isinstance(after, yaml.AliasToken)

    def _content_end(self, node: yaml.Node) -> int:
        """Where ``node``'s own text ends: its last token's end, white space and line breaks left out."""
        start, end = node.start_mark.index, node.end_mark.index
        last = max((t.end_mark.index for t in self.tokens if start <= t.start_mark.index and t.end_mark.index <= end
                    and t.end_mark.index > t.start_mark.index), default=start)
        while last > start and self.text[last - 1] in " \t\r\n":
            last -= 1
        return last

    def _line_end(self, index: int) -> int:
        end = self.text.find("\n", index)
        end = len(self.text) if end < 0 else end
        return end - 1 if end > 0 and self.text[end - 1] == "\r" else end

    def _comments(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(start, end) of each comment in text[lo:hi]."""
        found = []
        for a, b in self.gaps:
            a, b = max(a, lo), min(b, hi)
            i = self.text.find("#", a, b)
            while 0 <= i:
                end = min(self._line_end(i), b)
                found.append((i, end))
                i = self.text.find("#", end, b)
        return found

    def replace(self, key_node: yaml.Node, node: yaml.Node, value: str, after: str = "", where: str = "") -> None:
        """The value after ``key_node`` becomes ``value`` (its anchor kept). The comment on the key's line stays
        after it; comment lines among a block value's items stay below it (so do lines an item comments out)."""
        colon = self._token_after(key_node.end_mark.index)
        if not isinstance(colon, yaml.ValueToken):  # `{key}` in a flow mapping: no value indicator
            self._edit(key_node.end_mark.index, key_node.end_mark.index, f": {value}")
            return
        lo = colon.end_mark.index
        first = self._token_after(lo)
        anchor = ""
        if isinstance(first, yaml.AliasToken):  # `key: *name`: the alias goes, what it names stays
            hi = first.end_mark.index
        else:
            if isinstance(first, yaml.AnchorToken) and first.start_mark.index < node.end_mark.index:
                anchor = f"&{first.value} "
                if any(isinstance(t, yaml.AliasToken) and t.value == first.value for t in self.tokens):
                    # Other keys read this value through *name: changing it here would change them too.
                    raise SettingsError(f"{where}: its value is anchored as &{first.value}, and *{first.value} "
                                        "uses it elsewhere; set it in the editor.")
            hi = max(lo, self._content_end(node)) if node.start_mark.index >= lo else lo
        line_end = self._line_end(hi)
        rest = self.text[hi:line_end].lstrip()
        if not rest or rest.startswith("#"):
            hi = line_end  # the comment after the value is in the span, and goes back after the new value
        key_line_end = self._line_end(lo)
        trailing, kept = "", []
        for start, end in self._comments(lo, hi):
            if start < key_line_end:  # on the key's line: after the new value, as far from it as it was
                gap_start = start
                while gap_start > lo and self.text[gap_start - 1] in " \t":
                    gap_start -= 1
                trailing = self.text[gap_start:end]
            else:
                line_start = self.text.rfind("\n", 0, start) + 1
                if not self.text[line_start:start].strip():  # a comment line; one after an item goes with it
                    kept.append(self.text[line_start:end])
        new = (" " + anchor + value if value else "") + trailing + after
        self._edit(lo, hi, new + "".join(self.nl + line for line in kept))

    def add(self, mapping: yaml.Node | None, section: str | None, values: dict[str, str]) -> None:
        """Add ``values`` to a mapping node: the keys themselves, or under a new key ``section``."""
        if isinstance(mapping, yaml.MappingNode) and mapping.flow_style:
            entries = [f"{k}: {v}" for k, v in values.items()]
            if section is not None:
                entries = [f"{section}: {{{', '.join(entries)}}}"]
            close = mapping.end_mark.index - 1  # the closing brace
            last = max((t for t in self.tokens if mapping.start_mark.index <= t.start_mark.index < close
                        and t.end_mark.index > t.start_mark.index), key=lambda t: t.end_mark.index)
            joined = ", ".join(entries)
            at, rank = last.end_mark.index, int(section is not None)
            if isinstance(last, yaml.FlowMappingStartToken):
                self._edit(at, at, joined, rank)
            elif isinstance(last, yaml.FlowEntryToken):  # a trailing comma: `{a: 1,}`
                self._edit(at, at, f" {joined}", rank)
            else:
                self._edit(at, at, f", {joined}", rank)
            return
        lines = [f"{k}: {v}" for k, v in values.items()]
        if section is not None:
            lines = [f"{section}:", *(f"  {line}" for line in lines)]
        if isinstance(mapping, yaml.MappingNode):
            indent = " " * mapping.value[0][0].start_mark.column
            at = self._line_end(self._content_end(mapping))
            blank = self.nl if section is not None else ""  # a blank line before a new section
            self._edit(at, at, blank + "".join(self.nl + indent + line for line in lines), int(section is not None))
        elif mapping is None:  # no document yet: an empty file, or only comments
            body = self.text.rstrip(" \t\r\n")
            lead = "" if not body else self.nl * (1 if self.text.endswith(("\n", "\r")) else 2)
            self._edit(len(self.text), len(self.text), lead + "".join(line + self.nl for line in lines), 1)
        else:
            raise SettingsError(f"{self.path}:{mapping.start_mark.line + 1}: the file is not a mapping of "
                                "sections (`training:`, `corpus:` ... each at the start of a line).")

    def fill(self, root: yaml.Node, key_node: yaml.Node, node: yaml.Node, values: dict[str, str]) -> None:
        """A section with no value (``training:`` or ``training: ~``) gets ``values`` under it."""
        if root.flow_style:
            self.replace(key_node, node, f"{{{', '.join(f'{k}: {v}' for k, v in values.items())}}}")
            return
        indent = " " * (key_node.start_mark.column + 2)
        self.replace(key_node, node, "", after="".join(f"{self.nl}{indent}{k}: {v}" for k, v in values.items()))

    def apply(self) -> str:
        text, last = self.text, len(self.text) + 1
        for lo, hi, _, _, new in sorted(self.edits, reverse=True):
            if hi > last:  # two edits of one place: two sections that alias one mapping
                raise SettingsError(f"{self.path}: two of the sections to change are one mapping (an alias); "
                                    "change it once, or write the sections out.")
            text, last = text[:lo] + new + text[hi:], lo
        return text


def _check(old: str, new: str, changes: dict[str, dict], path: Path | str) -> None:
    """``new`` must load as ``old`` with only ``changes`` made: a wrong edit is never handed on to be written."""
    try:
        expected = copy.deepcopy(load_yaml(old)) or {}  # deep: values two keys share (an alias) stay shared
    except yaml.YAMLError:
        return  # parsed, but no settings (an unhashable key): the settings check that follows says where
    for section, values in changes.items():
        if not isinstance(expected.get(section), dict):
            expected[section] = {}
        for key, value in values.items():
            expected[section][str(key)] = load_yaml(_flow(value))
    try:
        got = load_yaml(new)
    except yaml.YAMLError as exc:
        got = exc
    if repr(got) != repr(expected):  # repr: a .nan equals itself
        # Seen only for a block scalar (`|`) that ends the file with no line break: a line after it adds one to
        # its value. Anything else would be a bug here; either way the user can make the change by hand.
        raise SettingsError(f"{path}: {_names(changes)} cannot be set in place: the file would then read "
                            "differently elsewhere too. Make the change in the editor.")


def _names(changes: dict[str, dict]) -> str:
    return ", ".join(f"{section}.{key}" for section, values in changes.items() for key in values)
