"""The project.yaml schema: one frozen dataclass per form section, defaults documented inline.

Every field carries its one-line help, so `gguf-trainer init` writes a commented
project.yaml and docs/settings.md is generated from the same source (they cannot drift).
Loading validates every field and names the file, line, key, value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gguf_assets.lib import atomic
from gguf_assets.lib.errors import UserError

PROJECT_FILE = "project.yaml"
# The output folder's report.json would collide with an adapter of this name's sidecar (<name>.json).
RESERVED_ADAPTER_NAME = "report"
SECTIONS = ("materials", "corpus", "precompute", "training", "output")
PRECOMPUTE_MODES = ("teacher+student", "teacher", "student")
DTYPES = ("bf16", "f16", "f32")
PLACEMENTS = ("sequential", "balanced")


class SettingsError(UserError, ValueError):
    """A bad project.yaml; the message names where, what and the fix."""


def _f(default: Any, help: str, *, choices: tuple | None = None, min: float | None = None,
       max: float | None = None, below: float | None = None, kind: str | None = None) -> Any:
    """``below`` is an exclusive upper bound (``max`` an inclusive one)."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "below": below, "kind": kind}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DatasetSource:
    """A prompt dataset: hub repo id (optionally @revision) or local folder, and its text field."""

    source: str
    text_field: str = "text"


@dataclass(frozen=True)
class Materials:
    teacher: str = _f("", "teacher LLM: hub repo id (optionally @revision) or local folder", kind="source")
    student: str = _f("", "student LLM: hub repo id (optionally @revision) or local folder", kind="source")
    datasets: list = _f([], "prompt datasets: repo id/folder strings, or {source: ..., text_field: text}",
                        kind="datasets")
    vision_encoder: str = _f("", "optional paired vision encoder (SigVQ): repo id or folder; empty = none",
                             kind="source")
    query_rows_file: str = _f("query_rows.safetensors", "file in the teacher folder holding the Q x D query rows")
    query_rows_tensor: str = _f("query_rows", "tensor name of the query rows inside query_rows_file")
    teacher_layer: int = _f(-1, "teacher hidden layer taken at the query positions (-1 = last)")
    student_layer: int = _f(-1, "student hidden layer fed to the adapter (-1 = last)")
    trust_remote_code: bool = _f(False, "allow models that need remote code (off: safer)")


@dataclass(frozen=True)
class Corpus:
    local_prompt_files: list = _f([], "extra prompt files: .txt one per line, .jsonl/.json with a text field, "
                                  ".csv/.parquet with a text column (text formats may be .gz)", kind="paths")
    train_prompts: int = _f(60000, "number of train prompts", min=1)
    val_prompts: int = _f(1000, "number of val prompts", min=1)
    empty_fraction: float = _f(0.01, "fraction of each split that is the empty (CFG) prompt", min=0.0, max=0.5)
    seed: int = _f(0, "seed of the shuffle and split")
    min_chars: int = _f(3, "drop prompts shorter than this (characters)", min=0)
    max_chars: int = _f(2000, "drop prompts longer than this (characters)", min=1)
    text_field: str = _f("text",
                         "field (.jsonl/.json) or column (.csv/.parquet) holding the prompt in local prompt files")
    skip_bad_lines: bool = _f(False, "skip malformed lines in prompt files (counted and reported) instead of stopping")
    allow_fewer: bool = _f(False, "accept fewer prompts than train_prompts + val_prompts (train shrinks, val is kept)")


@dataclass(frozen=True)
class Precompute:
    mode: str = _f("teacher+student", "what to compute", choices=PRECOMPUTE_MODES)
    device: str = _f("auto", "auto, cpu, cuda or cuda:N", kind="device")
    shard_size: int = _f(1000, "train prompts per shard", min=1)
    val_shard_size: int = _f(500, "val prompts per shard", min=1)
    student_dtype: str = _f("bf16", "dtype the student states are computed and stored in", choices=DTYPES)
    target_dtype: str = _f("f16", "dtype the teacher targets are stored in", choices=("f16", "bf16"))
    teacher_batch: int = _f(8, "most prompts per teacher batch", min=1)
    token_budget: int = _f(8192, "cap on batch x (text tokens + query rows) per teacher batch", min=1)
    student_batch: int = _f(32, "most prompts per student batch", min=1)
    teacher_placement: str = _f("sequential",
                                "sequential: fill the device, then other GPUs, then RAM; balanced: even split",
                                choices=PLACEMENTS)
    teacher_gpu_memory_gib: float = _f(0.0, "GPU memory budget for the teacher in GiB (0 = auto)", min=0.0)
    teacher_cpu_memory_gib: float = _f(0.0, "CPU RAM budget for offloaded teacher layers in GiB (0 = auto)", min=0.0)
    mock_teacher: bool = _f(False, "dev smoke test: synthetic learnable targets, no teacher load")
    prompt_template: str = _f("{prompt}", "text fed to the teacher and student; {prompt} is replaced by the prompt")


@dataclass(frozen=True)
class Training:
    width: int = _f(1024, "adapter width", min=8)
    depth: int = _f(6, "adapter blocks", min=1)
    heads: int = _f(16, "attention heads (must divide width)", min=1)
    steps: int = _f(20000, "optimizer steps", min=1)
    batch_size: int = _f(32, "prompts per step", min=1)
    learning_rate: float = _f(2e-4, "peak learning rate", min=0.0)
    warmup_steps: int = _f(1000, "linear warmup steps, then cosine decay to 10% of the learning rate", min=0)
    weight_decay: float = _f(0.01, "AdamW weight decay", min=0.0)
    grad_clip: float = _f(1.0, "clip the gradient norm to this (0 = off)", min=0.0)
    cosine_weight: float = _f(0.5, "loss = whitened MSE + cosine_weight * (1 - cos)", min=0.0)
    ema_decay: float = _f(0.0, "exponential moving average of the weights, used for validation, best/ and final/ "
                               "(0 = off; e.g. 0.999)", min=0.0, below=1.0)
    sigma_floor: float = _f(0.01, "floor of the per-dimension target std used to standardize", min=1e-12)
    grad_checkpoint: bool = _f(False, "recompute activations in backward to save memory")
    device: str = _f("auto", "auto, cpu, cuda or cuda:N", kind="device")
    log_every: int = _f(50, "log loss, lr and throughput every N steps", min=1)
    validate_every: int = _f(1000, "validate every N steps", min=1)
    checkpoint_every: int = _f(1000, "write a checkpoint every N steps", min=1)
    keep_checkpoints: int = _f(3, "keep the last N checkpoints (and the best)", min=1)
    seed: int = _f(0, "seed of initialization and data order")


@dataclass(frozen=True)
class Output:
    adapter_name: str = _f("adapter", "name of the exported GGUF (adapter_name.gguf)")
    output_dir: str = _f("", "where GGUF files and reports go (empty = <project>/output)")
    also_copy_to: str = _f("", "optional folder that receives a copy, e.g. your ggk model folder")
    export_vision_encoder: bool = _f(True, "also export the paired vision encoder GGUF when downloaded")
    evaluate: bool = _f(True, "evaluate the exported GGUF on the val shards")
    auto_resume: bool = _f(True, "resume after a crash or reboot: gguf-trainer --auto-resume continues the "
                                 "pipeline, and the daemon's sensors (fail cut-off runs, finish what is left) "
                                 "are on by default")
    ggk_command: str = _f("ggk --llm {student} --llm_adapter {adapter_gguf} --llm_vision {vision_gguf} -p \"a cat\"",
                          "command line shown in the report; {student}, {adapter_gguf}, {vision_gguf} are filled in "
                          "(a flag whose {vision_gguf} is empty is dropped)")


SECTION_CLASSES = {"materials": Materials, "corpus": Corpus, "precompute": Precompute,
                   "training": Training, "output": Output}


@dataclass(frozen=True)
class Settings:
    materials: Materials = field(default_factory=Materials)
    corpus: Corpus = field(default_factory=Corpus)
    precompute: Precompute = field(default_factory=Precompute)
    training: Training = field(default_factory=Training)
    output: Output = field(default_factory=Output)

    def section_dict(self, name: str) -> dict:
        return dataclasses.asdict(getattr(self, name))

    def to_dict(self) -> dict:
        return {name: self.section_dict(name) for name in SECTIONS}

    def dataset_sources(self) -> list[DatasetSource]:
        return [DatasetSource(**d) if isinstance(d, dict) else DatasetSource(d) for d in self.materials.datasets]


# -- rendering ---------------------------------------------------------------------------

def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


# What the reference run (the seed app's, on an RTX 5090) teaches; `gguf-trainer init` writes these
# under their section, so they sit beside the settings they are about.
SECTION_HINTS = {
    "corpus": "Reference: 60k prompts took about 3.7 h of teacher time (about 4.5 prompts/s, sequential, one "
              "RTX 5090 plus a 4050). Budget roughly prompts / 4.5 seconds on one large GPU.",
    "precompute": "teacher_placement: sequential fills the chosen GPU up to its budget, then the other GPUs, "
                  "then RAM; it keeps a 30 GB MoE on the GPUs and ran at about 4.5 prompts/s. balanced (the "
                  "transformers default even split) caps the big card at half the model and runs the rest of "
                  "the experts on the CPU: about 2.4 prompts/s. If sequential runs out of VRAM, lower "
                  "teacher_gpu_memory_gib by 2-3 GiB rather than switching to balanced.",
    "training": "Reference recipe (trainer8): width 1024, depth 6, 20k steps, batch 32, lr 2e-4, warmup 1k; it "
                "reached 0.965 val centred cosine in about 55 min on an RTX 5090. Below about 0.9, widen "
                "(1536) or deepen before touching the recipe.",
}


def render_yaml(settings: Settings, *, header: str = "", hints: dict[str, str] | None = None) -> str:
    """project.yaml text: every setting with its value and a one-line comment (plus section hints)."""
    import textwrap

    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for name in SECTIONS:
        section = getattr(settings, name)
        lines.append("")
        lines.append(f"{name}:")
        if hints and name in hints:
            lines += [f"  # {line}" for line in textwrap.wrap(hints[name], width=100)]
        for f in dataclasses.fields(section):
            meta = f.metadata
            note = meta["help"]
            if meta.get("choices"):
                note += f" [{' | '.join(meta['choices'])}]"
            lines.append(f"  # {note}")
            lines.append(f"  {f.name}: {_yaml_value(getattr(section, f.name))}")
    return "\n".join(lines).lstrip("\n") + "\n"


def write_project_file(folder: Path, settings: Settings, *, header: str = "",
                       hints: dict[str, str] | None = None) -> Path:
    path = Path(folder) / PROJECT_FILE
    atomic.write_text(path, render_yaml(settings, header=header, hints=hints))
    return path


# -- loading and validation --------------------------------------------------------------

def _key_lines(text: str) -> dict[str, int]:
    """Map 'section.key' to its 1-based line in the YAML text (for error messages)."""
    lines: dict[str, int] = {}
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if not isinstance(root, yaml.MappingNode):
        return lines
    for k_node, v_node in root.value:
        lines[str(k_node.value)] = k_node.start_mark.line + 1
        if isinstance(v_node, yaml.MappingNode):
            for k2, _ in v_node.value:
                lines[f"{k_node.value}.{k2.value}"] = k2.start_mark.line + 1
    return lines


def _where(path: Path, lines: dict[str, int], key: str) -> str:
    line = lines.get(key) or lines.get(key.split(".")[0])
    return f"{path}:{line}" if line else str(path)


# A number in exponent form without a dot (2e-4, 1E+3), which YAML 1.1 leaves a string.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")


def _check_value(section: str, f: dataclasses.Field, value: Any) -> Any:
    """Return the normalized value or raise ValueError with what is allowed."""
    meta, kind = f.metadata, f.metadata.get("kind")
    expected = type(f.default) if f.default is not dataclasses.MISSING else list
    if kind == "datasets":
        if not isinstance(value, list):
            raise ValueError("must be a list of repo ids/folders or {source, text_field} mappings")
        out = []
        for i, item in enumerate(value):
            if isinstance(item, str) and item.strip():
                out.append(item.strip())
            elif isinstance(item, dict) and isinstance(item.get("source"), str) and item["source"].strip():
                extra = set(item) - {"source", "text_field"}
                if extra:
                    raise ValueError(f"item {i} has unknown keys {sorted(extra)}; allowed: source, text_field")
                tf = item.get("text_field", "text")
                if not isinstance(tf, str) or not tf:
                    raise ValueError(f"item {i}: text_field must be a non-empty string")
                out.append({"source": item["source"].strip(), "text_field": tf})
            else:
                raise ValueError(f"item {i} ({item!r}) must be a repo id/folder string "
                                 "or {source: ..., text_field: ...}")
        return out
    if kind == "paths":
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise ValueError("must be a list of file paths (strings)")
        return [v.strip() for v in value]
    if expected is bool:
        if not isinstance(value, bool):
            raise ValueError("must be true or false")
        return value
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("must be an integer")
    elif expected is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.match(value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads `2e-4` as a string; it is plainly a number
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, not {value} (YAML's .nan/.inf)")
    elif expected is str:
        if value is None:
            value = ""
        if not isinstance(value, str):
            raise ValueError("must be a string")
    if meta.get("choices") and value not in meta["choices"]:
        raise ValueError(f"must be one of: {', '.join(meta['choices'])}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ValueError(f"must be >= {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ValueError(f"must be <= {meta['max']}")
    if meta.get("below") is not None and value >= meta["below"]:
        raise ValueError(f"must be below {meta['below']}")
    if kind == "device" and not (value in ("auto", "cpu", "cuda")
                                 or (value.startswith("cuda:") and value[5:].isdigit())):
        raise ValueError("must be auto, cpu, cuda or cuda:N")
    return value


def _cross_checks(s: Settings) -> list[tuple[str, str]]:
    """Rules that involve more than one field: (key, message)."""
    problems = []
    if s.corpus.min_chars > s.corpus.max_chars:
        problems.append(("corpus.min_chars",
                         f"min_chars ({s.corpus.min_chars}) is above max_chars ({s.corpus.max_chars})"))
    if s.training.width % s.training.heads:
        problems.append(("training.heads", f"heads ({s.training.heads}) must divide width ({s.training.width})"))
    if "{prompt}" not in s.precompute.prompt_template:
        problems.append(("precompute.prompt_template", "must contain {prompt}"))
    if s.precompute.mode != "student" and not s.precompute.mock_teacher and not s.materials.teacher:
        problems.append(("materials.teacher",
                         "is empty: set a hub repo id or local folder (or precompute.mock_teacher: true)"))
    if not s.materials.student:
        problems.append(("materials.student", "is empty: set a hub repo id or local folder"))
    name = s.output.adapter_name
    if not name or name in (".", "..") or any(c in name for c in "/\\\0:"):
        problems.append(("output.adapter_name", f"{name!r} is not a plain file name (no path separators, not . or ..)"))
    elif name == RESERVED_ADAPTER_NAME or name.endswith(f".{RESERVED_ADAPTER_NAME}"):
        problems.append(("output.adapter_name", f"{name!r} is taken: the export's sidecar {name}.json would "
                         "overwrite a report in the output folder. Choose another name, e.g. 'my-adapter'"))
    return problems


def settings_from_dict(raw: Any, *, source: Path = Path(PROJECT_FILE), text: str = "") -> Settings:
    lines = _key_lines(text)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SettingsError(f"{source}: the top level must be a mapping with sections {', '.join(SECTIONS)}")
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        key = sorted(unknown)[0]
        hint = difflib.get_close_matches(key, SECTIONS, n=1)
        raise SettingsError(f"{_where(source, lines, key)}: unknown section {key!r}. "
                            + (f"Did you mean {hint[0]!r}? " if hint else "")
                            + f"Allowed sections: {', '.join(SECTIONS)}")
    sections = {}
    for name, cls in SECTION_CLASSES.items():
        given = raw.get(name) or {}
        if not isinstance(given, dict):
            raise SettingsError(f"{_where(source, lines, name)}: section {name!r} must be a mapping of key: value")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in given:
            if key not in fields:
                hint = difflib.get_close_matches(str(key), list(fields), n=1)
                raise SettingsError(f"{_where(source, lines, f'{name}.{key}')}: unknown key {name}.{key}. "
                                    + (f"Did you mean {name}.{hint[0]}? " if hint else "")
                                    + f"Allowed keys: {', '.join(fields)}")
        values = {}
        for key, value in given.items():
            try:
                values[key] = _check_value(name, fields[key], value)
            except ValueError as exc:
                raise SettingsError(f"{_where(source, lines, f'{name}.{key}')}: {name}.{key} = {value!r} {exc}. "
                                    f"({fields[key].metadata['help']})") from None
        sections[name] = cls(**values)
    settings = Settings(**sections)
    problems = _cross_checks(settings)
    if problems:
        key, msg = problems[0]
        raise SettingsError(f"{_where(source, lines, key)}: {key} {msg}")
    return settings


def load_settings(project: Path) -> Settings:
    path = Path(project) / PROJECT_FILE
    if not path.is_file():
        raise SettingsError(f"{path}: no project.yaml here. Create one with `gguf-trainer init {project}`.")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SettingsError(f"{path}:{line}: byte 0x{data[exc.start]:02x} at byte offset {exc.start} (column "
                            f"{column}) is not UTF-8. Save the file as UTF-8 (retype that character).") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise SettingsError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    _refuse_duplicate_keys(path, text)
    return settings_from_dict(raw, source=path, text=text)


def _refuse_duplicate_keys(path: Path, text: str) -> None:
    """YAML lets a later key silently win over an earlier one; in a settings file that hides an edit."""
    def walk(node: yaml.Node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
            if key in seen:
                raise SettingsError(f"{path}:{line}: {key} is set twice (lines {seen[key]} and {line}); the "
                                    "second would silently win. Keep one of them.")
            seen[key] = line
            walk(value_node, f"{key}.")

    walk(yaml.compose(text), "")


def replace(settings: Settings, **changes: dict) -> Settings:
    """Copy with some fields changed, e.g. replace(s, training={"steps": 10})."""
    return Settings(**{name: dataclasses.replace(getattr(settings, name), **changes.get(name, {}))
                       for name in SECTIONS})


def settings_reference_markdown() -> str:
    """docs/settings.md, generated from the dataclasses above."""
    out = ["# Settings reference", "",
           "Generated from `gguf_assets/lib/settings.py` by `python -m gguf_assets.docs`; do not edit by hand.", ""]
    defaults = Settings()
    for name in SECTIONS:
        out += [f"## `{name}`", "", "| key | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(SECTION_CLASSES[name]):
            meta = f.metadata
            note = meta["help"] + (f" (one of: {', '.join(meta['choices'])})" if meta.get("choices") else "")
            out.append(f"| `{name}.{f.name}` | `{_yaml_value(getattr(getattr(defaults, name), f.name))}` | {note} |")
        out.append("")
    return "\n".join(out)
