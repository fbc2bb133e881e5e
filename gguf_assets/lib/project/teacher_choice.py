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

from gguf_assets.lib.core.errors import UserError
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


class TeacherLayerError(UserError, ValueError):
    """materials.teacher_layer outside the teacher's layers; the message gives the range."""


def blocks_for_layer(num_hidden_layers: int | None, layer: int) -> int | None:
    """How many of the teacher's blocks ``materials.teacher_layer = layer`` needs, or None when it reads the last
    state (every block runs; the state is taken after the final norm), or the config gives no layer count.

    The layer indexes transformers' ``hidden_states``: 0 is the embeddings, k (0 < k < n, for n blocks) the output of
    block k - 1 before the final norm, n (like -1) the last state after the final norm; negative indexes count from
    the end as in Python. Here, with no torch, so the precompute and the estimate read the setting alike."""
    n = num_hidden_layers
    if not isinstance(n, int):
        return None
    if not -(n + 1) <= layer <= n:
        raise TeacherLayerError(
            f"materials.teacher_layer = {layer}, but the teacher has {n} layers: use -1 (the last, after the final "
            f"norm), 0 to {n} (0 = the embeddings, k = the output of the first k layers) or -{n + 1} to -1 (counted "
            "from the end).")
    index = layer % (n + 1)
    return None if index == n else index
