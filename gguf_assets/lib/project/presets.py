"""Named sets of project.yaml changes (the studio's Settings panel), and a comment-keeping YAML edit.

A preset changes only the keys it names, in the project.yaml text itself, so the user's comments
and every other setting stay as they are; the result is validated like the file before it is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gguf_assets.lib.project.settings import Settings, yaml_value


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    changes: dict[str, dict] = field(default_factory=dict)  # {section: {key: value}}


def _trainer8() -> dict[str, dict]:
    t = Settings().training  # the defaults are the seed's trainer8 recipe (docs/recipe.md)
    keys = ("width", "depth", "heads", "steps", "batch_size", "learning_rate", "warmup_steps", "weight_decay",
            "grad_clip", "cosine_weight", "ema_decay", "sigma_floor", "target_standardization", "relational_weight")
    return {"training": {k: getattr(t, k) for k in keys}, "corpus": {"train_prompts": 60000},
            "materials": {"teacher_layer": -1, "student_layer": -1}}


PRESETS = (
    Preset("first look", "2,000 steps, validating every 250: does this pair learn at all, before the full run? "
           "Nothing else changes.", {"training": {"steps": 2000, "validate_every": 250}}),
    Preset("seed reference (trainer8)", "the seed's reference recipe: 1024 x 6, 20,000 steps, 60k train prompts, "
           "both models read at their last layer (0.965 on an RTX 5090 in about 55 min)", _trainer8()),
    Preset("CPU scale", "a small adapter for a CPU: 128 wide (two of ggk's 64-wide heads), 1 block, batch 16, "
           "lr 6e-3 (the demo's recipe)",
           {"training": {"width": 128, "depth": 1, "batch_size": 16, "learning_rate": 6e-3,
                         "device": "cpu"}}),
)


def preset(name: str) -> Preset:
    found = next((p for p in PRESETS if p.name == name), None)
    if found is None:
        raise KeyError(f"no preset {name!r}; the presets are {[p.name for p in PRESETS]}")
    return found


def set_keys(text: str, changes: dict[str, dict]) -> str:
    """``text`` (a project.yaml) with each ``section.key`` set to its new value, in place: the line's own
    comment and every other line kept; a key or section the file lacks is added at its section's end."""
    lines = text.splitlines(keepends=True)
    for section, values in changes.items():
        for key, value in values.items():
            lines = _set_key(lines, section, key, value)
    return "".join(lines)


def _set_key(lines: list[str], section: str, key: str, value) -> list[str]:
    start = next((i for i, line in enumerate(lines) if re.match(rf"^{re.escape(section)}:\s*(#.*)?$", line)), None)
    if start is None:
        tail = "" if not lines or lines[-1].endswith("\n") else "\n"
        return [*lines, f"{tail}\n{section}:\n", f"  {key}: {yaml_value(value)}\n"]
    end = next((i for i in range(start + 1, len(lines)) if re.match(r"^\S", lines[i])), len(lines))
    pattern = re.compile(rf"^(\s+){re.escape(key)}:(\s*)([^#\n]*?)(\s+#.*)?$")
    for i in range(start + 1, end):
        found = pattern.match(lines[i].rstrip("\n"))
        if found:
            indent, comment = found.group(1), found.group(4) or ""
            lines[i] = f"{indent}{key}: {yaml_value(value)}{comment}\n"
            # A block value (a list written one "- item" a line) goes with it: the new value is one flow line.
            # Comment and blank lines among its items stay.
            after = _block_end(lines, i, end)
            kept = [line for line in lines[i + 1:after] if not line.strip() or line.lstrip().startswith("#")]
            return [*lines[:i + 1], *kept, *lines[after:]]
    last = max((i for i in range(start + 1, end) if lines[i].strip()), default=start)
    return [*lines[:last + 1], f"  {key}: {yaml_value(value)}\n", *lines[last + 1:]]


def _block_end(lines: list[str], key_line: int, end: int) -> int:
    """The line after the block value that follows ``key_line`` (deeper lines, or "- " items at its indent)."""
    indent = len(lines[key_line]) - len(lines[key_line].lstrip())
    after = key_line + 1
    for i in range(key_line + 1, end):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        depth = len(line) - len(line.lstrip())
        if depth > indent or (depth == indent and line.lstrip().startswith("- ")):
            after = i + 1
        else:
            break
    return after
