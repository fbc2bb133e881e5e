"""Which teacher implementation makes the targets: the mock, an LLM with query rows, or an LLaDA-Image pipeline."""

from __future__ import annotations

from pathlib import Path

from gguf_assets.lib.materials.teacher.layout import LLADA_IMAGE_PIPELINE
from gguf_assets.lib.precompute.teacher import HFTeacher, MockTeacher
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.teacher_choice import TeacherChoice


def load_teacher(choice: TeacherChoice, settings: Settings, *, teacher_folder: Path | None, student, device,
                 gpu_budget_gib: float | None = None, rows: tuple[Path, str, str] | None = None,
                 kind: str | None = None):
    """The teacher implementation ``choice`` and the materials' ``kind`` name (lib/project/teacher_choice.py,
    lib/materials/teacher/layout.py); ``student`` is a callable returning the loaded student."""
    if choice.mock:
        return MockTeacher(student())
    if kind == LLADA_IMAGE_PIPELINE:
        from gguf_assets.lib.precompute.llada_teacher import LLaDAImageTeacher

        return LLaDAImageTeacher(Path(teacher_folder), settings, device, gpu_budget_gib=gpu_budget_gib)
    return HFTeacher(Path(teacher_folder), settings, device, gpu_budget_gib=gpu_budget_gib, rows=rows)
