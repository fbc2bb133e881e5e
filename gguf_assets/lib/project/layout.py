"""Where everything lives inside a project folder. Paths come from here, never from the cwd."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.project.settings import PROJECT_FILE, RESERVED_ADAPTER_NAME, Settings

SPLITS = ("train", "val")
TEACHER_FILE = "teacher.safetensors"
STUDENT_FILE = "student.safetensors"
PROMPTS_FILE = "prompts.jsonl"
# The folder's latest report. Each adapter's own is <adapter_name>.report.json/.md (ProjectPaths.report_json),
# so projects that share an output_dir keep theirs apart.
REPORT_JSON = f"{RESERVED_ADAPTER_NAME}.json"
REPORT_MD = f"{RESERVED_ADAPTER_NAME}.md"
REPORT_SUFFIX = ".report"
# Inside checkpoints/<fingerprint>/ (lib/training/checkpoints.py writes them; `status` reads final/ without torch).
STEP_DIR = re.compile(r"^step-(\d{8})$")
BEST_DIR = "best"
FINAL_DIR = "final"
DAMAGED_FINAL_DIR = "final.damaged"  # finished weights whose bytes changed, kept for a look
WEIGHTS_FILE = "adapter.safetensors"
STATE_FILE = "trainer_state.pt"
META_FILE = "meta.json"
CURVES_FILE = "curves.svg"
# Also inside checkpoints/<fingerprint>/, for `gguf-trainer runs` (lib/runs/listing.py):
SESSION_FILE = "session.json"  # the last training session of the run: running (pid), stopped or failed (why)
LABEL_FILE = "label.txt"  # the user's label of the run (`gguf-trainer runs DIR --label RUN TEXT`)
KEPT_DIR = "export"  # the run's own GGUF, export sidecar and report, kept when they were made (lib/output/kept.py)
KEPT_FILE = "kept.json"
# A deleted run's folder is renamed to checkpoints/.deleting/<fingerprint> before it is removed: a kill leaves
# no half-deleted run among the runs (hidden folders are no runs).
DELETING_DIR = ".deleting"
# Files in a hub dataset's folder that describe it rather than hold prompts: the materials step does not
# download them, the corpus does not read them.
DATASET_METADATA_FILES = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})


# Keys whose values are file or folder paths in the project's JSON files (manifests, sidecars,
# reports). Written relative to the project folder, read back absolute.
PATH_KEYS = frozenset({"path", "copy_of", "copies", "gguf_path", "vision_gguf", "ggk_files"})


def _map_paths(doc: Any, convert: Callable[[str], str], *, is_path: bool = False) -> Any:
    if isinstance(doc, dict):
        return {k: _map_paths(v, convert, is_path=is_path or k in PATH_KEYS) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_map_paths(v, convert, is_path=is_path) for v in doc]
    if is_path and isinstance(doc, str) and doc:
        return convert(doc)
    return doc


def shard_key(index: int) -> str:
    """Dynamic partition key of a shard (zero-padded so keys sort like indices)."""
    return f"{index:05d}"


@dataclass(frozen=True)
class ProjectPaths:
    root: Path

    @classmethod
    def of(cls, root: Path | str) -> "ProjectPaths":
        return cls(Path(root).expanduser().resolve())

    @property
    def project_file(self) -> Path:
        return self.root / PROJECT_FILE

    @property
    def materials_dir(self) -> Path:
        return self.root / "materials"

    @property
    def materials_manifest(self) -> Path:
        return self.materials_dir / "manifest.json"

    @property
    def corpus_dir(self) -> Path:
        return self.root / "corpus"

    def corpus_file(self, split: str) -> Path:
        return self.corpus_dir / f"{split}.jsonl"

    @property
    def corpus_manifest(self) -> Path:
        return self.corpus_dir / "manifest.json"

    def shard_dir(self, split: str, key: str) -> Path:
        return self.root / "shards" / split / key

    def checkpoints_dir(self, fingerprint: str) -> Path:
        return self.root / "checkpoints" / fingerprint

    @property
    def adapter_manifest(self) -> Path:
        """Points at the finished training run (its fingerprint and final weights)."""
        return self.root / "checkpoints" / "final.json"

    def output_dir(self, settings: Settings) -> Path:
        configured = settings.output.output_dir
        if not configured:
            return self.root / "output"
        path = Path(configured).expanduser()
        return path if path.is_absolute() else self.root / path

    def report_json(self, settings: Settings) -> Path:
        """This adapter's report (report.json beside it is the latest report of any adapter in the folder)."""
        return self.output_dir(settings) / f"{settings.output.adapter_name}{REPORT_SUFFIX}.json"

    def report_md(self, settings: Settings) -> Path:
        return self.output_dir(settings) / f"{settings.output.adapter_name}{REPORT_SUFFIX}.md"

    @property
    def cache_dir(self) -> Path:
        """What was read only to answer a question (a hub model's config for `estimate`): safe to delete, read
        again when missing; no stage depends on it."""
        return self.root / ".cache"

    @property
    def dagster_home(self) -> Path:
        return self.root / ".dagster"

    @property
    def lock_file(self) -> Path:
        return self.root / ".pipeline.lock"

    def stored(self, path: Path | str) -> str:
        """A path as it is written into the project's own files: relative to the project folder
        when inside it, so a copied or moved folder never points back at the original."""
        path = Path(path)
        try:
            return path.resolve().relative_to(self.root).as_posix()
        except ValueError:  # outside the project (a user's local folder, also_copy_to): kept as given
            return str(path)

    def located(self, stored: str) -> Path:
        """The inverse of :meth:`stored`."""
        path = Path(stored)
        return path if path.is_absolute() else self.root / path

    def inside(self, stored: str, *, record: Path, under: Path | None = None) -> Path:
        """The path a record of the project names, confined: it must lead (links resolved) into ``under``, the
        project folder by default. A project folder is copied and shared, so a record that names an absolute path
        or climbs out with ``..`` is refused, naming the record, before anything is opened, written or deleted."""
        base = (under or self.root).resolve()
        path = self.located(str(stored)) if stored not in (None, "") else None
        if path is None or not path.resolve().is_relative_to(base):
            raise RecordPathError(
                f"{record}: it names {stored!r}, which is not inside {base}. A project's records name only its own "
                "files (this one may come from someone else, or was edited): nothing was opened, written or "
                "deleted. Remove that entry, or get the project again from its sender.")
        return path

    def stored_doc(self, doc: Any) -> Any:
        """A JSON document with every path under :data:`PATH_KEYS` made :meth:`stored`."""
        return _map_paths(doc, self.stored)

    def located_doc(self, doc: Any) -> Any:
        """A JSON document read back: every path under :data:`PATH_KEYS` made absolute again."""
        return _map_paths(doc, lambda value: str(self.located(value)))

    def resolve_local(self, value: str) -> Path:
        """A settings path: absolute, ~, or relative to the project folder."""
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.root / path


class RecordPathError(UserError, ValueError):
    """A path read from one of the project's own records that leads outside the project (or outside the folder it
    must be in): refused before any file is touched."""


class OutputFolderError(UserError):
    """An output setting points at something that cannot be a folder; raised before a run does any work."""


def check_output_folders(paths: ProjectPaths, settings: Settings) -> None:
    """Refuse, before any work, an output folder that cannot be made: the path, or a folder above it, is a file.
    (Found only at export otherwise, after hours of training.)"""
    o = settings.output
    for key, value, folder in (("output.output_dir", o.output_dir, paths.output_dir(settings)),
                               ("output.also_copy_to", o.also_copy_to,
                                paths.resolve_local(o.also_copy_to) if o.also_copy_to else None)):
        if folder is None:
            continue
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            where = "is a file" if blocker == folder else f"lies under {blocker}, which is a file"
            raise OutputFolderError(f"{key} = {value or '(empty: <project>/output)'!r}: {folder} {where}, not a "
                                    "folder. Point the setting at a folder (it is made when missing), or move the "
                                    "file away.")
