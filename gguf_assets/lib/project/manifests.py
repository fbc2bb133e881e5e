"""The typed contracts between stages: the materials and corpus manifests, the export sidecar and the
evaluation report.

Each is a frozen dataclass whose fields are the keys of its JSON file, so the JSON stays what
users, scripts and checks read (report.json's fields are an interface) while the code that
builds and reads them is checked by name. ``from_json`` accepts files written by earlier
versions (keys added since then get their "not recorded" value).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError


class DamagedRecord(UserError):
    """A stage's JSON record exists but cannot be read (truncated, not JSON, wrong shape)."""

    def __init__(self, path: Path, why: str) -> None:
        self.path, self.why = Path(path), why
        super().__init__(f"{path} is damaged ({why}). Nothing else is lost: `gguf-trainer run` redoes the stage "
                         "that wrote it.")


def read_record(path: Path) -> dict[str, Any] | None:
    """A stage record's JSON object; None when the file does not exist; DamagedRecord when it cannot be read."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedRecord(path, f"not valid JSON: {exc}; {len(text)} bytes, truncated?") from None
    if not isinstance(doc, dict):
        raise DamagedRecord(path, f"a JSON {type(doc).__name__}, not an object")
    return doc


def recorded(record: Path, key: str) -> Any:
    """One field of a stage's JSON record; None when the record is missing or damaged (status says which)."""
    try:
        return atomic.read_json(record).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def recorded_fingerprint(record: Path) -> str | None:
    """The fingerprint a stage's record names: that of what its result was made from."""
    return recorded(record, "fingerprint")


class _JsonFields:
    """A dataclass stored as a JSON object of its fields; ``_STORED_AS`` renames a field in the file."""

    _STORED_AS: dict[str, str] = {}

    @classmethod
    def from_json(cls, doc: dict[str, Any]):
        """Keys a newer version added are dropped; fields an older file lacks take their defaults."""
        names = {stored: name for name, stored in cls._STORED_AS.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{names.get(k, k): v for k, v in doc.items() if names.get(k, k) in known})

    @classmethod
    def read(cls, path: Path, doc: dict[str, Any] | None = None):
        """The record stored at ``path`` (``doc``: its JSON, already read); None when there is none.
        DamagedRecord when it is unreadable or lacks a field that has no default."""
        doc = read_record(path) if doc is None else doc
        if doc is None:
            return None
        try:
            return cls.from_json(doc)
        except TypeError as exc:  # a required field is missing
            raise DamagedRecord(path, str(exc).split(".", 1)[-1].strip()) from None

    def to_json(self) -> dict[str, Any]:
        return {self._STORED_AS.get(k, k): v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class ExportSidecar(_JsonFields):
    """<output_dir>/<adapter_name>.json: what the export wrote (lib/output/export.py); the report and status read it.

    ``files`` lists every file written, copies included: {role, path, bytes, sha256, mtime_ns,
    inode[, copy_of]} (the stamp lets `status` see a change without reading the file).
    """

    path: str
    sha256: str
    bytes: int
    fingerprint: str
    val_centred_cosine_torch: float
    name: str = ""
    architecture: str = ""
    format_version: int = 0
    tensor_count: int = 0
    f16_count: int = 0
    f32_count: int = 0
    kept_f32: list[str] = field(default_factory=list)
    adapter_fingerprint: str = ""
    files: list[dict] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)
    vision: dict | None = None  # the vision GGUF's summary, when one was exported
    provenance: dict[str, Any] = field(default_factory=dict)
    empty_prompt_cosine_torch: float | None = None
    per_shard_torch: list[dict] = field(default_factory=list)
    settings_hash: str = ""  # the settings snapshot it was exported under (lib/project/settings_history.py)

    def written_files(self) -> list[dict]:
        """Every file the export wrote; a sidecar from before ``files`` existed names only the GGUF."""
        return self.files or [{"role": "adapter", "path": self.path, "bytes": self.bytes, "sha256": self.sha256}]


@dataclass(frozen=True)
class Report(_JsonFields):
    """<output_dir>/report.json (and <adapter_name>.report.json): the evaluation of the exported GGUF.

    Paths inside the project are stored relative to the project folder.
    """

    fingerprint: str
    evaluated: bool  # False when output.evaluate is off: the score is then the torch checkpoint's
    val_centred_cosine: float | None  # the GGUF's, by the independent numpy evaluator
    val_centred_cosine_torch: float
    gguf_vs_torch: float | None
    empty_prompt_cosine: float | None
    empty_prompt_cosine_torch: float | None
    score_source: str  # "gguf" or "torch"
    gguf_path: str
    gguf_sha256: str
    gguf_bytes: int
    vision_gguf: str | None
    ggk_files: dict[str, str | None]  # {adapter, vision_encoder}: what ggk loads (a copy when one was made)
    n_prompts: int | None
    eval_seconds: float | None
    per_shard: list[dict]  # {shard, n, val_centred_cosine, val_centred_cosine_torch}
    worst: list[dict]  # the worst val prompts: {cosine, text, shard, index}
    verdict: str
    advice: str
    files: list[dict]  # {role, path, bytes, sha256[, copy_of]}
    student: dict[str, Any]  # {repo, commit, path, layer}
    ggk_command: str
    kept_f32: list[str] = field(default_factory=list)
    settings_hash: str = ""  # the settings snapshot it was made under (lib/project/settings_history.py)
    # The other scores, in the raw target space (lib/core/metrics.py defines them), of the GGUF like the verdict's
    # (the torch checkpoint's last validation when the GGUF was not evaluated); None in reports made before them.
    val_rel_mse: float | None = None
    val_rms_cosine: float | None = None
    worst_row: int | None = None  # the query row with the lowest mean centred cosine, and that cosine
    worst_row_cosine: float | None = None
    # The GGUF's outputs against the torch checkpoint's on the val prompts: {min_row_cosine, mean_row_cosine,
    # max_abs_diff, max_abs_diff_relative}; None when not evaluated, or in reports made before it.
    gguf_vs_checkpoint: dict[str, float] | None = None
    # Prompt retrieval over the non-empty val prompts (lib/core/metrics.py), the GGUF's: the share whose own target is
    # the nearest / among the 5 nearest to its prediction, the own cosine less the mean to the others' targets, and
    # how many prompts (chance is 1/N and 5/N); None when not evaluated, or in reports made before it.
    val_retrieval_top1: float | None = None
    val_retrieval_top5: float | None = None
    val_retrieval_margin: float | None = None
    val_retrieval_prompts: int | None = None
    # Weights that scored higher than these (lib/training/better.py): the run's best validation, the run it continues;
    # [] when none did, and in reports made before it.
    better_weights: list[dict] = field(default_factory=list)



MODEL_ROLES = ("teacher", "student", "vision_encoder")


@dataclass
class MaterialsManifest(_JsonFields):
    """materials/manifest.json: every configured source, pinned (lib/materials/pinning/ resolves
    them; lib/materials/materials_run.py reads and writes the record).

    An entry is a pinning.resolve.Material as a dict: {role, source, path, commit, files, bytes,
    text_field, origin}. ``hash_cache`` and ``downloads`` are stored under their earlier names,
    "_hash_cache" and "_downloads", so existing projects read as they are.
    """

    teacher: dict | None = None
    student: dict | None = None
    vision_encoder: dict | None = None
    datasets: list[dict] = field(default_factory=list)
    # materials.query_rows, when set: the one tensor fetched into materials/query_rows.safetensors
    # (lib/materials/query_rows.py): source, file, tensor, commit, the file's etag, the tensor's sha256.
    query_rows: dict | None = None
    settings: dict = field(default_factory=dict)  # what it was resolved under (materials_run.materials_settings_key)
    settings_hash: str = ""  # the whole snapshot it was resolved under (lib/project/settings_history.py)
    # Per local or downloaded folder, {relative file: record}: lib/verify's stamp with the sha256 (a local
    # file) or with the hub etag it matched (a download); manifests from before stamps hold "size:mtime" keys.
    hash_cache: dict[str, dict] = field(default_factory=dict)
    downloads: list[dict] = field(default_factory=list)  # per hub source: bytes, seconds, refetched files

    _STORED_AS = {"hash_cache": "_hash_cache", "downloads": "_downloads"}

    def entries(self) -> list[dict]:
        """The pinned materials: the models that are configured, then the datasets."""
        return [e for e in (getattr(self, role) for role in MODEL_ROLES) if e] + self.datasets

    def pin(self, role: str) -> dict | None:
        """What downstream fingerprints depend on: the source and the exact content."""
        entry = getattr(self, role)
        return None if entry is None else {"source": entry["source"], "commit": entry["commit"]}


@dataclass(frozen=True)
class CorpusManifest(_JsonFields):
    """corpus/manifest.json: what `build_corpus` wrote (lib/corpus/corpus.py); status, the shards and the UI read it.

    ``splits``: per split, {prompts, empty} and lib/core/verify's record of its jsonl file (size, sha256, stamp).
    ``counts``: read, kept, used, unused and the dropped_* / skipped_bad_lines totals. ``sources``: per
    prompt file, its figures and its path as stored (relative to the project when inside it).
    """

    fingerprint: str
    splits: dict[str, dict]
    settings: dict = field(default_factory=dict)  # the corpus section it was built under
    settings_hash: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    per_source: dict[str, int] = field(default_factory=dict)
    sources: list[dict] = field(default_factory=list)
    bad_line_samples: list[str] = field(default_factory=list)
    length_histogram: list[dict] = field(default_factory=list)  # {chars_from, chars_to, prompts}
    length_chars: dict = field(default_factory=dict)  # {min, median, mean, max} of the kept prompts
    requested: dict[str, int] = field(default_factory=dict)  # prompts asked for; allow_fewer may shrink train
    preview: list[dict] = field(default_factory=list)  # the first rows of each split: {split, source, chars, text}

    def prompts(self, split: str) -> int:
        return self.splits[split]["prompts"]

    def asked(self) -> dict[str, int]:
        return self.requested or {split: record["prompts"] for split, record in self.splits.items()}
