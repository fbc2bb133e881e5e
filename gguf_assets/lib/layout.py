"""Where everything lives inside a project folder. Paths come from here, never from the cwd."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.settings import PROJECT_FILE, Settings

SPLITS = ("train", "val")
TEACHER_FILE = "teacher.safetensors"
STUDENT_FILE = "student.safetensors"
PROMPTS_FILE = "prompts.jsonl"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"


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

    @property
    def dagster_home(self) -> Path:
        return self.root / ".dagster"

    @property
    def lock_file(self) -> Path:
        return self.root / ".pipeline.lock"

    def resolve_local(self, value: str) -> Path:
        """A settings path: absolute, ~, or relative to the project folder."""
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.root / path
