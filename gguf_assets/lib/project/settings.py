"""The project.yaml schema: one frozen pydantic model per form section, defaults documented inline.

Every field carries its one-line help (its description), so `gguf-trainer init` writes a
commented project.yaml and docs/settings.md is generated from the same models (they cannot
drift). Pydantic validates (types, bounds, choices, unknown keys, cross-field rules); a thin
layer on top (``_explain``) names the file, line, key, value, what is allowed and a close match.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.ggk_contract import (
    ADAPTER_HEAD_DIM,
    CONDITIONINGS,
    GGK_COMMAND,
    GGK_VERSION,
    LLADA_IMAGE,
    STUDENT_LAYER,
)
from gguf_assets.lib.core.markdown import markdown_table
from gguf_assets.lib.core.webhook import shown_url, url_problem
from gguf_assets.lib.project.seed_reference import SEED_PRECOMPUTE

PROJECT_FILE = "project.yaml"
# The output folder's report.json would collide with an adapter of this name's sidecar (<name>.json).
RESERVED_ADAPTER_NAME = "report"
SECTIONS = ("materials", "corpus", "precompute", "training", "output")


class SettingsError(UserError, ValueError):
    """A bad project.yaml; the message names where, what and the fix."""


def _device(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise ValueError("must be auto, cpu, cuda or cuda:N")


def _datasets(value: Any) -> list:
    """Repo id/folder strings, or {source, text_field} mappings (text_field filled in)."""
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
            text_field = item.get("text_field", "text")
            if not isinstance(text_field, str) or not text_field:
                raise ValueError(f"item {i}: text_field must be a non-empty string")
            out.append({"source": item["source"].strip(), "text_field": text_field})
        else:
            raise ValueError(f"item {i} ({_shown(item)}) must be a repo id/folder string or "
                             "{source: ..., text_field: ...}")
    return out


QUERY_ROWS_KEYS = ("source", "file", "tensor")


def _query_rows(value: Any) -> dict:
    """Unset ({} or nothing), or {source, file, tensor}: a tensor in a local or hub safetensors file."""
    if value is None or value == {}:
        return {}
    if not isinstance(value, dict):
        raise ValueError("must be a mapping {source: owner/name@revision or a local file/folder, file: path in "
                         "it, tensor: name}, or {} (unset: the teacher folder's query_rows_file)")
    extra = set(value) - set(QUERY_ROWS_KEYS)
    if extra:
        raise ValueError(f"has unknown keys {sorted(extra)}; allowed: {', '.join(QUERY_ROWS_KEYS)}")
    out = {}
    for key in QUERY_ROWS_KEYS:
        item = value.get(key, "")
        if item is None:
            item = ""
        if not isinstance(item, str):
            raise ValueError(f"{key} must be a string, not {_shown(item)}")
        if key != "file" and not item.strip():
            raise ValueError(f"needs a non-empty {key}")
        out[key] = item.strip()
    return out


def _student_layer(value: Any) -> Any:
    """-1 (or [-1]): the student's final-norm states, the only ones ggk feeds the adapter. The key stays so old
    project files load; any other layer is refused with the reason, before any work starts."""
    if value in (STUDENT_LAYER, [STUDENT_LAYER]) and not isinstance(value, bool):
        return STUDENT_LAYER
    raise ValueError(f"is {_shown(value)}, but ggk feeds the adapter the student's final-norm hidden states (layer "
                     f"{STUDENT_LAYER}) and nothing else (conditioner.hpp, ggk {GGK_VERSION}), so an adapter "
                     f"trained on another layer, or on several, computes something else in ggk. Set it to "
                     f"{STUDENT_LAYER} or remove the key")


def _paths(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError("must be a list of file paths (strings)")
    return [v.strip() for v in value]


Device = Annotated[str, AfterValidator(_device)]
Datasets = Annotated[list, BeforeValidator(_datasets)]
Paths = Annotated[list[str], BeforeValidator(_paths)]
QueryRows = Annotated[dict, BeforeValidator(_query_rows)]
StudentLayer = Annotated[int, BeforeValidator(_student_layer)]
# A number in exponent form without a dot (2e-4, 1E+3), which YAML 1.1 (PyYAML) leaves a string.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what torch, numpy and the GGUF header can hold
EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")


class LongNumber:
    """A YAML integer too long for Python to read or print back (over its 4,300-digit limit on int/str
    conversions: ``int("9" * 5000)`` raises ValueError, and so does ``str()`` of a 0x-spelled one as long). The
    settings loader reads such a number as this, its text kept, so a settings check says the key is out of range
    (file:line) and the studio's form shows the text, instead of a traceback or an HTTP 500."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LongNumber) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


_LONG_NUMBER_BITS = 14_000  # about 4,200 decimal digits: Python prints no int of more than 4,300 by default


def _construct_int(loader: yaml.constructor.SafeConstructor, node: yaml.ScalarNode) -> Any:
    try:
        value = yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)
    except ValueError:  # Python's int-string conversion limit
        return LongNumber(str(loader.construct_scalar(node)))
    return LongNumber(str(loader.construct_scalar(node))) if value.bit_length() > _LONG_NUMBER_BITS else value


class _Section(BaseModel):
    """A form section: unknown keys refused, types strict (no "true" for true, no 2.5 for an int)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_spellings(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if annotation is float and isinstance(value, str) and EXPONENT_FLOAT.match(value.strip()):
            return float(value)  # `2e-4` is plainly a number
        if annotation is str and value is None:
            return ""  # `key:` with nothing after it
        if annotation in (int, float) and isinstance(value, LongNumber):
            value = INT64_MAX + 1  # refused just below, as any number out of range is
        if annotation in (int, float) and isinstance(value, int) and not isinstance(value, bool) \
                and not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"is out of range: a number here lies between {INT64_MIN} and {INT64_MAX} at most, "
                             "and within the bounds the key's help gives")
        return value


def _cross_check(key: str, message: str) -> PydanticCustomError:
    """A rule over several fields, reported at ``key`` (section.key) so the message gets its line."""
    return PydanticCustomError("cross_check", "{message}", {"key": key, "message": message})


# materials.teacher_kind: told by what the teacher holds, or one of the kinds (lib/materials/teacher/layout.py).
TEACHER_KINDS = ("auto", "query-rows", "llada-image")


class Materials(_Section):
    teacher: str = Field("", description=(
        "the teacher: hub repo id (optionally @revision) or local folder; a transformers LLM with query rows, or an "
        "LLaDA-Image pipeline (e.g. inclusionAI/LLaDA-Image-Turbo: only its text stack is fetched)"))
    teacher_kind: Literal[TEACHER_KINDS] = Field("auto", description=(
        "auto: told by what materials.teacher holds (a model_index.json with queryformer/ is an LLaDA-Image "
        "pipeline); query-rows: an LLM read at fixed query rows; llada-image: the pipeline's text stack "
        "(QueryFormer, LLaDA2-MoE backbone, text projection)"))
    student: str = Field("", description=(
        "student LLM: hub repo id (optionally @revision), local folder, or a local .gguf file as ggk runs it "
        "(`--llm`: a Qwen3 under its Hugging Face tensor names, f32/f16/bf16 or quantized, e.g. q8_0), converted "
        "once into materials/student-gguf/"))
    student_tokenizer: str = Field("", description=(
        "the tokenizer of a .gguf student: a local folder or hub repo id (optionally @revision) holding its "
        "tokenizer.json (only its tokenizer files are fetched); required when materials.student is a .gguf file, "
        "refused otherwise (a model folder or repo brings its own)"))
    datasets: Datasets = Field(default_factory=list, description="prompt datasets: repo id/folder strings, or "
                                                                 "{source: ..., text_field: text}")
    vision_encoder: str = Field("", description="optional paired vision encoder (SigVQ): repo id or folder; "
                                                "empty = none")
    query_rows_file: str = Field("query_rows.safetensors",
                                 description="file in the teacher folder holding the Q x D query rows")
    query_rows_tensor: str = Field("query_rows", description="tensor name of the query rows inside query_rows_file")
    query_rows: QueryRows = Field(default_factory=dict, description=(
        "query rows from a tensor of their own: {source: owner/t2i-model@revision or a local file/folder, file: "
        "path of the safetensors file in it, tensor: name}; only that tensor is fetched (by HTTP range), pinned, "
        "checked and kept as materials/query_rows.safetensors. {} = the teacher folder's query_rows_file"))
    teacher_layer: int = Field(-1, description="teacher hidden layer taken at the query positions (-1 = last)")
    student_layer: StudentLayer = Field(STUDENT_LAYER, description=(
        "student hidden layer fed to the adapter: -1 (after the final norm), the only one ggk feeds it"))
    trust_remote_code: bool = Field(False, description=(
        "allow models that need remote code, such as an LLaDA-Image pipeline's LLaDA2-MoE text encoder (off: "
        "safer; a refusal names the files and their sha256)"))

    @model_validator(mode="after")
    def _student_tokenizer(self) -> "Materials":
        gguf = self.student.strip().lower().endswith(".gguf")
        if gguf and not self.student_tokenizer.strip():
            raise _cross_check("materials.student", (
                f"= {self.student!r} is a GGUF file, which carries no tokenizer the product reads: set "
                "materials.student_tokenizer to the folder or hub repo id holding the student's tokenizer.json "
                "(the model the GGUF was exported from)"))
        if self.student_tokenizer.strip() and not gguf:
            raise _cross_check("materials.student_tokenizer", (
                f"= {self.student_tokenizer!r} is only read when materials.student is a .gguf file; "
                f"materials.student = {self.student!r} brings its own tokenizer. Remove the key"))
        return self


class Corpus(_Section):
    local_prompt_files: Paths = Field(default_factory=list, description=(
        "extra prompt files: .txt one per line, .jsonl/.json with a text field, .csv/.parquet with a text column "
        "(text formats may be .gz)"))
    train_prompts: int = Field(60000, ge=1, description="number of train prompts")
    val_prompts: int = Field(1000, ge=1, description="number of val prompts")
    empty_fraction: float = Field(0.01, ge=0.0, le=0.5,
                                  description="fraction of each split that is the empty (CFG) prompt")
    seed: int = Field(0, description="seed of the shuffle and split")
    min_chars: int = Field(3, ge=0, description="drop prompts shorter than this (characters)")
    max_chars: int = Field(2000, ge=1, description="drop prompts longer than this (characters)")
    text_field: str = Field("text", description="field (.jsonl/.json) or column (.csv/.parquet) holding the prompt "
                                                "in local prompt files")
    skip_bad_lines: bool = Field(False, description="skip malformed lines in prompt files (counted and reported) "
                                                    "instead of stopping")
    allow_fewer: bool = Field(False, description="accept fewer prompts than train_prompts + val_prompts (train "
                                                 "shrinks, val is kept)")

    @model_validator(mode="after")
    def _lengths(self) -> "Corpus":
        if self.min_chars > self.max_chars:
            raise _cross_check("corpus.min_chars",
                               f"min_chars ({self.min_chars}) is above max_chars ({self.max_chars})")
        return self


class Precompute(_Section):
    mode: Literal["teacher+student", "teacher", "student"] = Field("teacher+student", description="what to compute")
    device: Device = Field("auto", description="auto, cpu, cuda or cuda:N")
    shard_size: int = Field(1000, ge=1, description="train prompts per shard")
    val_shard_size: int = Field(500, ge=1, description="val prompts per shard")
    student_dtype: Literal["bf16", "f16", "f32"] = Field(
        "bf16", description="dtype the student states are computed and stored in")
    target_dtype: Literal["f16", "bf16"] = Field("f16", description="dtype the teacher targets are stored in")
    teacher_batch: int = Field(8, ge=1, description="most prompts per teacher batch")
    token_budget: int = Field(8192, ge=1, description="cap on batch x (text tokens + query rows) per teacher batch")
    student_batch: int = Field(32, ge=1, description="most prompts per student batch")
    teacher_placement: Literal["sequential", "balanced"] = Field("sequential", description=(
        "sequential: fill the device, then other GPUs, then RAM; balanced: even split"))
    teacher_gpu_memory_gib: float = Field(0.0, ge=0.0,
                                          description="GPU memory budget for the teacher in GiB (0 = auto)")
    teacher_cpu_memory_gib: float = Field(0.0, ge=0.0, description=(
        "CPU RAM budget for offloaded teacher layers in GiB (0 = auto)"))
    mock_teacher: bool = Field(False, description="dev smoke test: synthetic learnable targets, no teacher load")
    conditioning: Literal[CONDITIONINGS] = Field(LLADA_IMAGE, description=(
        "the runtime's conditioning contract the student is fed by: llada-image (ggk's LLaDA-Image template, "
        "tokenized in ggk's pieces after its emphasis parser; the teacher keeps the literal prompt)"))
    prompt_template: str = Field("{prompt}", description=(
        "text fed to the teacher: {prompt} is replaced by the prompt, or llada-image renders it as ggk renders "
        "LLaDA-Image's (the literal text, no emphasis parsing). The student's text is always ggk's "
        "(precompute.conditioning)"))

    @model_validator(mode="after")
    def _template(self) -> "Precompute":
        if "{prompt}" not in self.prompt_template and self.prompt_template != LLADA_IMAGE:
            raise _cross_check("precompute.prompt_template", f"must contain {{prompt}} or be {LLADA_IMAGE}")
        return self


class Training(_Section):
    width: int = Field(1024, ge=ADAPTER_HEAD_DIM, description=f"adapter width (a multiple of {ADAPTER_HEAD_DIM})")
    depth: int = Field(6, ge=1, description="adapter blocks")
    heads: int = Field(0, ge=0, description=(
        f"attention heads: ggk fixes the head dim at {ADAPTER_HEAD_DIM}, so heads = width / {ADAPTER_HEAD_DIM} "
        "(0 = that; another number is refused)"))
    steps: int = Field(20000, ge=1, description="optimizer steps")
    batch_size: int = Field(32, ge=1, description="prompts per step")
    learning_rate: float = Field(2e-4, ge=0.0, description="peak learning rate")
    warmup_steps: int = Field(1000, ge=0, description=(
        "linear warmup steps, then cosine decay to 10% of the learning rate"))
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, ge=0.0, description="clip the gradient norm to this (0 = off)")
    cosine_weight: float = Field(0.5, ge=0.0, description="loss = whitened MSE + cosine_weight * (1 - cos)")
    ema_decay: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "exponential moving average of the weights, used for validation, best/ and final/ (0 = off; e.g. 0.999)"))
    sigma_floor: float = Field(0.01, ge=1e-12, description=(
        "floor of the per-dimension target std used to standardize"))
    target_standardization: Literal["per_row_dim", "isotropic"] = Field("per_row_dim", description=(
        "how the loss scales targets: per_row_dim (each query row and dim to unit std, trainer8) or isotropic "
        "(one std for all, as PHI-S: the loss then weighs dims as the centred cosine does)"))
    relational_weight: float = Field(0.0, ge=0.0, description=(
        "weight of a term matching the batch's prompt-to-prompt centred cosines of the predictions to the "
        "targets' (0 = off)"))
    init: Literal["random", "row_means"] = Field("random", description=(
        "how the adapter starts: random (trainer8's) or row_means (the untrained adapter outputs each query row's "
        "train mean, so training learns only what the prompt adds; the same module and file)"))
    query_lr_scale: float = Field(1.0, gt=0.0, description=(
        "the query rows' learning rate as a multiple of training.learning_rate (trainer8: 1)"))
    layer_fusion: Literal["concat", "mix"] = Field("concat", description=(
        "no effect: it fused several student layers, which ggk cannot feed (kept so old project files load)"))
    grad_checkpoint: bool = Field(False, description="recompute activations in backward to save memory")
    device: Device = Field("auto", description="auto, cpu, cuda or cuda:N")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description=(
        "a training step's arithmetic: auto = bf16 autocast where the device computes bf16 in hardware (a CUDA "
        "GPU from compute capability 8.0; an x86 CPU with AVX512-BF16 or AMX, for a step of at least 262,144 "
        "prompts x query rows x width), else f32; weights, optimizer, loss and validation stay f32"))
    log_every: int = Field(50, ge=1, description="log loss, lr and throughput every N steps")
    validate_every: int = Field(1000, ge=1, description="validate every N steps")
    checkpoint_every: int = Field(1000, ge=1, description="write a checkpoint every N steps")
    keep_checkpoints: int = Field(3, ge=1, description="keep the last N checkpoints (and the best)")
    keep_steps_every: int = Field(0, ge=0, description=(
        "kept steps: a weights-only copy of the adapter (validated) every N steps, for `gguf-trainer snapshot "
        "--step N` later; 0 = off (each costs disk: about the adapter's f32 size)"))
    keep_steps_from: int = Field(0, ge=0, description="kept steps: only from this step on (0 = the start)")
    keep_steps_to: int = Field(0, ge=0, description="kept steps: only up to this step (0 = the run's end)")
    keep_steps_last: int = Field(0, ge=0, description="kept steps: hold only the newest N on disk (0 = all)")
    seed: int = Field(0, description="seed of initialization and data order")

    @model_validator(mode="after")
    def _heads(self) -> "Training":
        if self.width % ADAPTER_HEAD_DIM:
            down = self.width // ADAPTER_HEAD_DIM * ADAPTER_HEAD_DIM
            raise _cross_check("training.width", (
                f"is {self.width}, not a multiple of {ADAPTER_HEAD_DIM}: ggk's adapter runs heads of "
                f"{ADAPTER_HEAD_DIM} (llm_adapter.hpp); use {max(down, ADAPTER_HEAD_DIM)} or "
                f"{down + ADAPTER_HEAD_DIM}"))
        if self.keep_steps_to and self.keep_steps_to < self.keep_steps_from:
            raise _cross_check("training.keep_steps_to", (
                f"is {self.keep_steps_to}, before training.keep_steps_from ({self.keep_steps_from}): the window "
                "would keep nothing; raise it, or set 0 for the run's end"))
        if self.heads and self.heads * ADAPTER_HEAD_DIM != self.width:
            raise _cross_check("training.heads", (
                f"is {self.heads}, but ggk runs heads of {ADAPTER_HEAD_DIM}, so width {self.width} has "
                f"{self.width // ADAPTER_HEAD_DIM}; remove the key (or set 0)"))
        return self


class Output(_Section):
    adapter_name: str = Field("adapter", description="name of the exported GGUF (adapter_name.gguf)")
    output_dir: str = Field("", description="where GGUF files and reports go (empty = <project>/output)")
    also_copy_to: str = Field("", description="optional folder that receives a copy, e.g. your ggk model folder")
    export_vision_encoder: bool = Field(True, description=(
        "also export the paired vision encoder GGUF when downloaded"))
    evaluate: bool = Field(True, description="evaluate the exported GGUF on the val shards")
    auto_resume: bool = Field(True, description=(
        "resume after a crash or reboot: gguf-trainer --auto-resume continues the pipeline, and the daemon's "
        "sensors (fail cut-off runs, finish what is left) are on by default"))
    ggk_command: str = Field(GGK_COMMAND, description=(
        "command line shown in the report; {student_gguf} (or {student}), {adapter_gguf}, {vision_gguf} and "
        "{tokenizer_pack} are filled with the files the export made (a flag whose file was not made is dropped), "
        "{dit_gguf} and {vae_gguf} with placeholders for the image model's files you bring"))
    notify_url: str = Field("", description=(
        "optional webhook: when a pipeline run ends (finished, failed or stopped), a JSON POST here with the project "
        "(its folder's name), the run id, the outcome, the score and verdict and the GGUF's name; an http:// or "
        "https:// URL (empty = none). A failed delivery is one line in the run's log and never fails the run; logs "
        "show only its scheme and host, as it may hold a token"))

    @model_validator(mode="after")
    def _plain_name(self) -> "Output":
        problem = adapter_name_problem(self.adapter_name)
        if problem:
            raise _cross_check("output.adapter_name", problem)
        if self.notify_url and (problem := url_problem(self.notify_url)):
            raise _cross_check("output.notify_url", problem)  # in words that never repeat the URL (a token)
        return self


# Keys whose values may hold a secret (a webhook's token): a line that names a change of one shows scheme://host only.
URL_KEYS = frozenset({"output.notify_url"})


def shown_setting(key: str, value: Any) -> Any:
    """``value`` of project.yaml's ``key`` (section.key) as a printed or logged line may show it."""
    return shown_url(value) if key in URL_KEYS and isinstance(value, str) and value else value


def adapter_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be output.adapter_name, or None. The one rule: settings refuse it at load, and the
    export checks it again (a name that reached it another way must never write outside the output folder)."""
    if not isinstance(name, str) or not name.strip():
        return f"{name!r} is blank; use a plain file name such as 'my-adapter'"
    if name in (".", "..") or any(c in name for c in "/\\:\0"):
        return f"{name!r} is not a plain file name (no path separators or ':', not . or ..); use e.g. 'my-adapter'"
    if any(unicodedata.category(c).startswith("C") for c in name):
        shown = next(c for c in name if unicodedata.category(c).startswith("C"))
        return (f"{name!r} holds the control character {shown!r}, which makes a file name nobody can type; "
                "use e.g. 'my-adapter'")
    if name != name.strip():
        return f"{name!r} starts or ends with a space; use {name.strip()!r}"
    if name == RESERVED_ADAPTER_NAME or name.endswith(f".{RESERVED_ADAPTER_NAME}"):
        return (f"{name!r} is taken: the export's sidecar {name}.json would overwrite a report in the output "
                "folder. Choose another name, e.g. 'my-adapter'")
    return None


SECTION_CLASSES: dict[str, type[_Section]] = {"materials": Materials, "corpus": Corpus, "precompute": Precompute,
                                              "training": Training, "output": Output}


@dataclass(frozen=True)
class SettingField:
    """One key of project.yaml, as the init file, docs/settings.md and the UI describe it."""

    name: str
    help: str
    choices: tuple[str, ...] | None


def section_fields(section: str) -> list[SettingField]:
    fields = []
    for name, info in SECTION_CLASSES[section].model_fields.items():
        literal = get_origin(info.annotation) is Literal
        fields.append(SettingField(name, info.description or "", get_args(info.annotation) if literal else None))
    return fields


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    materials: Materials = Field(default_factory=Materials)
    corpus: Corpus = Field(default_factory=Corpus)
    precompute: Precompute = Field(default_factory=Precompute)
    training: Training = Field(default_factory=Training)
    output: Output = Field(default_factory=Output)

    @field_validator("*", mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        return {} if value is None else value  # `training:` with no keys under it

    def section_dict(self, name: str) -> dict:
        return getattr(self, name).model_dump()

    def to_dict(self) -> dict:
        return {name: self.section_dict(name) for name in SECTIONS}

    def dataset_sources(self) -> list[DatasetSource]:
        return [DatasetSource(**d) if isinstance(d, dict) else DatasetSource(d) for d in self.materials.datasets]


@dataclass(frozen=True)
class DatasetSource:
    """A prompt dataset: hub repo id (optionally @revision) or local folder, and its text field."""

    source: str
    text_field: str = "text"


# -- rendering ---------------------------------------------------------------------------

class _Dumper(yaml.SafeDumper):
    """safe_dump, plus a LongNumber written back as the number text it was read from."""


_Dumper.add_representer(LongNumber, lambda dumper, number: dumper.represent_scalar("tag:yaml.org,2002:int",
                                                                                   number.text))


def yaml_value(value: Any) -> str:
    return yaml.dump(value, Dumper=_Dumper, default_flow_style=True,
                     width=10_000).strip().removesuffix("...").strip()


# What the reference run (the seed app's, on an RTX 5090) teaches; `gguf-trainer init` writes these
# under their section, so they sit beside the settings they are about.
SECTION_HINTS = {
    "corpus": f"Reference: {SEED_PRECOMPUTE.text()} of teacher time (sequential placement). Budget roughly "
              f"prompts / {SEED_PRECOMPUTE.per_second:.1f} seconds on one large GPU (`gguf-trainer estimate`).",
    "precompute": "teacher_placement: sequential fills the chosen GPU up to its budget, then the other GPUs, "
                  "then RAM; it keeps a 30 GB MoE on the GPUs and ran at about "
                  f"{SEED_PRECOMPUTE.per_second:.1f} prompts/s. balanced (the "
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
        for f in section_fields(name):
            note = f.help + (f" [{' | '.join(f.choices)}]" if f.choices else "")
            lines.append(f"  # {note}")
            lines.append(f"  {f.name}: {yaml_value(getattr(section, f.name))}")
    return "\n".join(lines).lstrip("\n") + "\n"


def write_project_file(folder: Path, settings: Settings, *, header: str = "",
                       hints: dict[str, str] | None = None) -> Path:
    path = Path(folder) / PROJECT_FILE
    atomic.write_text(path, render_yaml(settings, header=header, hints=hints))
    return path


# -- loading and validation --------------------------------------------------------------

# libyaml's parser, which PyYAML's wheels include: it reads a project.yaml about 15 times as fast as the pure-Python
# one, and every process that runs a stage loads the file several times, as do `status` and the studio's polls. Its
# error texts are terser ("found character that cannot start any token", without the character), so a text it
# refuses is parsed again by the pure-Python loader for the message the user reads.
class _FastLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """The C safe loader, reading an integer too long for Python as a LongNumber."""


class _PyLoader(yaml.SafeLoader):
    """The pure-Python safe loader, likewise."""


for _loader in (_FastLoader, _PyLoader):
    _loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_FAST_LOADER = _FastLoader


def load_yaml(text: str) -> Any:
    """YAML as project.yaml is read (yaml.safe_load, but a too-long integer is a LongNumber, not a ValueError):
    for the studio's form fields. Raises yaml.YAMLError."""
    return yaml.load(text, Loader=_FAST_LOADER)


def _key_lines(text: str) -> dict[str, int]:
    """Map 'section.key' to its 1-based line in the YAML text (for error messages)."""
    lines: dict[str, int] = {}
    try:
        root = yaml.compose(text, Loader=_FAST_LOADER)
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


def _materials_needed(s: Settings) -> tuple[str, str] | None:
    """Checked on load, not on construction: `Settings()` (the init file's defaults) leaves them empty."""
    if s.precompute.mode != "student" and not s.precompute.mock_teacher and not s.materials.teacher:
        return "materials.teacher", "is empty: set a hub repo id or local folder (or precompute.mock_teacher: true)"
    if not s.materials.student:
        return "materials.student", "is empty: set a hub repo id or local folder"
    return None


# What a value must be, by pydantic error type; {…} are filled from the error's context.
_MUST_BE = {
    "int_type": "must be an integer", "bool_type": "must be true or false", "string_type": "must be a string",
    "float_type": "must be a number", "finite_number": "must be a finite number, not {input} (YAML's .nan/.inf)",
    "greater_than_equal": "must be >= {ge}", "less_than_equal": "must be <= {le}", "less_than": "must be below {lt}",
    "greater_than": "must be above {gt}", "list_type": "must be a list",
}


def _explain(error: dict, source: Path, lines: dict[str, int], given: dict) -> str:
    """One pydantic error as the user reads it: file:line, key, value, what is allowed, or a close match."""
    loc = [str(part) for part in error["loc"]]
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "cross_check":
        return f"{_where(source, lines, ctx['key'])}: {ctx['key']} {ctx['message']}"
    if len(loc) == 1:  # a section
        section = loc[0]
        if kind == "extra_forbidden":
            hint = difflib.get_close_matches(section, SECTIONS, n=1)
            return (f"{_where(source, lines, section)}: unknown section {section!r}. "
                    + (f"Did you mean {hint[0]!r}? " if hint else "") + f"Allowed sections: {', '.join(SECTIONS)}")
        return f"{_where(source, lines, section)}: section {section!r} must be a mapping of key: value"
    section, key = loc[0], loc[1]
    where = _where(source, lines, f"{section}.{key}")
    fields = SECTION_CLASSES[section].model_fields
    if kind == "extra_forbidden":
        hint = difflib.get_close_matches(key, list(fields), n=1)
        return (f"{where}: unknown key {section}.{key}. " + (f"Did you mean {section}.{hint[0]}? " if hint else "")
                + f"Allowed keys: {', '.join(fields)}")
    if kind == "literal_error":
        must = f"must be one of: {', '.join(get_args(fields[key].annotation))}"
    elif kind == "value_error":
        must = str(ctx["error"])
    else:
        must = _MUST_BE.get(kind, error["msg"]).format(**ctx, input=error["input"])
    return f"{where}: {section}.{key} = {_shown(given[section][key])} {must}. ({fields[key].description})"


def _shown(value: Any) -> str:
    """A value as an error message quotes it: a pasted novel or a 400-digit number is cut short."""
    try:
        text = repr(value)
    except ValueError:  # an int over Python's 4,300-digit limit on printing one (given in code, not read)
        return f"(a number of {value.bit_length()} bits)"
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def settings_from_dict(raw: Any, *, source: Path = Path(PROJECT_FILE), text: str = "") -> Settings:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SettingsError(f"{source}: the top level must be a mapping with sections {', '.join(SECTIONS)}")
    try:
        settings = Settings.model_validate(raw)
    except ValidationError as exc:
        raise SettingsError(_explain(exc.errors()[0], source, _key_lines(text), raw)) from None
    problem = _materials_needed(settings) or _material_the_product_writes(settings, source.parent)
    if problem:
        key, message = problem
        raise SettingsError(f"{_where(source, _key_lines(text), key)}: {key} {message}")
    return settings


# The project's folders the product writes into; a material there would be overwritten or deleted by a run.
WRITTEN_FOLDERS = ("checkpoints", "shards")


def _material_the_product_writes(s: Settings, root: Path) -> tuple[str, str] | None:
    """A material (teacher, student, vision encoder, tokenizer) that is a file or folder the product writes: its
    output folder, checkpoints/ or shards/. A run would rewrite it, and every run would find the materials changed."""
    output = Path(s.output.output_dir or "output").expanduser()
    written = [(root / output if not output.is_absolute() else output), *(root / f for f in WRITTEN_FOLDERS)]
    for key in ("teacher", "student", "vision_encoder", "student_tokenizer"):
        value = getattr(s.materials, key)
        if not value:
            continue
        path = Path(value).expanduser()
        path = path if path.is_absolute() else root / path
        if not path.exists():  # a hub repo id, or a folder still to come
            continue
        for folder in written:
            if folder.exists() and path.resolve().is_relative_to(folder.resolve()):
                return (f"materials.{key}", f"= {value!r} is inside {folder}, which the product writes (GGUFs, "
                        "checkpoints, shards): a run would overwrite or delete it, and every run would find the "
                        "materials changed. Copy it to a folder of its own (materials/, say) and point the key there")
    return None


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
    return settings_from_text(path, text)


def settings_from_text(path: Path, text: str) -> Settings:
    """The settings a project.yaml text holds, checked as `load_settings` checks the file (errors name
    ``path``:line): what an editor validates before it writes the file."""
    _refuse_duplicate_keys(path, text)
    return settings_from_dict(_parse_yaml(path, text), source=path, text=text)


def _parse_yaml(path: Path, text: str) -> Any:
    try:
        return yaml.load(text, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        pass
    try:
        return yaml.load(text, Loader=_PyLoader)  # the same refusal, in the pure-Python loader's fuller words
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise SettingsError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None


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

    try:
        root = yaml.compose(text, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        return  # not YAML at all: _parse_yaml says where
    walk(root, "")


def replace(settings: Settings, **changes: dict) -> Settings:
    """Copy with some fields changed, e.g. replace(s, training={"steps": 10}); not validated (load_settings is)."""
    return Settings.model_construct(**{name: getattr(settings, name).model_copy(update=changes.get(name, {}))
                                       for name in SECTIONS})


def settings_reference_markdown() -> str:
    """docs/settings.md, generated from the models above."""
    out = ["# Settings reference", "",
           "Generated from `gguf_assets/lib/project/settings.py` by `python -m gguf_assets.docs`; do not edit by "
           "hand.", ""]
    defaults = Settings()
    for name in SECTIONS:
        rows = [[f"`{name}.{f.name}`", f"`{yaml_value(getattr(getattr(defaults, name), f.name))}`",
                 f.help + (f" (one of: {', '.join(f.choices)})" if f.choices else "")] for f in section_fields(name)]
        out += [f"## `{name}`", "", markdown_table(["key", "default", "meaning"], rows), ""]
    return "\n".join(out)
