"""Which teacher makes the targets, decided in one place from the settings.

`precompute.mock_teacher` (a dev smoke test: synthetic targets computed from the student's
states, no teacher download) stays the user-facing switch; only this module reads it. Every
stage asks the choice instead: what to download and pin, what the targets' fingerprint
depends on, what the GGUF names as its teacher, and which implementation the precompute loads
(lib/precompute/teacher_loader.py ``load_teacher``: HFTeacher, LLaDAImageTeacher or MockTeacher, all with
``encode(prompts, dtype=, on_batch=)``). It lives with the settings because every stage from the
materials on reads it. No torch import here: the status and the CLI read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import Settings

MOCK_TEACHER_REPO = "mock-teacher"
MOCK_TEACHER_COMMIT = "none"
# The mock teacher's output shape (query rows x width): here, not beside MockTeacher, so that the status's memory
# line for a mock-teacher project does not load torch (lib/precompute/teacher.py imports it).
MOCK_QUERY_ROWS = 256
MOCK_DIM = 64


@dataclass(frozen=True)
class TeacherChoice:
    mode: str  # precompute.mode: which shard halves are computed
    mock: bool

    @property
    def loads_teacher_model(self) -> bool:
        """The real teacher LLM is downloaded, pinned and loaded (its query rows too)."""
        return self.mode != "student" and not self.mock

    @property
    def loads_student_model(self) -> bool:
        """The student is loaded by the precompute: for its half, or inside the mock teacher."""
        return self.mode != "teacher" or self.mock

    @property
    def targets_model(self) -> str:
        """The material whose pin the targets' fingerprint carries."""
        return "student" if self.mock else "teacher"

    def targets_settings(self, settings: Settings) -> dict:
        """The settings the targets are computed from, besides dtype and template (a fingerprint part)."""
        m, p = settings.materials, settings.precompute
        if self.mock:
            return {"mock": True, "conditioning": p.conditioning, "student_dtype": p.student_dtype}
        if m.query_rows:  # a material of their own: the setting names them (their sha256 joins the pins)
            return {"query_rows": dict(m.query_rows), "layer": m.teacher_layer}
        return {"query_rows": [m.query_rows_file, m.query_rows_tensor], "layer": m.teacher_layer}

    def provenance(self, materials: MaterialsManifest) -> tuple[str, str]:
        """(repo, commit) the GGUF names as its teacher."""
        teacher = materials.teacher
        if self.mock or teacher is None:
            return MOCK_TEACHER_REPO, MOCK_TEACHER_COMMIT
        return teacher["source"], teacher["commit"]



def teacher_choice(settings: Settings) -> TeacherChoice:
    return TeacherChoice(mode=settings.precompute.mode, mock=settings.precompute.mock_teacher)
