"""How long a project's precompute and training take, before any of it ran: the seed's measurements
(lib/project/seed_reference.py) scaled to the project's size; once something was measured here, that instead
(lib/status/pace.py). `gguf-trainer estimate` prints these lines."""

from __future__ import annotations

from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.seed_reference import SEED_PRECOMPUTE, SEED_TRAINING, SEED_TRAINING_SHAPE
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.teacher_choice import teacher_choice
from gguf_assets.lib.status.pace import pace_view, precompute_pace, training_pace
from gguf_assets.lib.status.states import ProjectView
from gguf_assets.lib.telemetry.progress import format_seconds


def time_lines(paths: ProjectPaths, settings: Settings) -> list[str]:
    """One line for the precompute, one for training: measured here when they were, else predicted from the seed's
    measurement, naming it and what it was scaled by."""
    view = pace_view(paths, settings)  # one reading of the corpus for both lines; None: nothing to measure yet
    return [_precompute_line(paths, settings, view), _training_line(paths, settings, view)]


def _precompute_line(paths: ProjectPaths, settings: Settings, view: ProjectView | None) -> str:
    if view is not None and (measured := precompute_pace(paths, settings, view)) is not None:
        return f"{measured.text()} (on this machine)"
    prompts = settings.corpus.train_prompts + settings.corpus.val_prompts
    if not teacher_choice(settings).loads_teacher_model:
        return (f"precompute: {prompts:,} prompts with no teacher model to run (precompute.mode, mock teacher): "
                "the seed's teacher figure does not apply; `gguf-trainer status` shows the measured rate and ETA "
                "from the first shard on")
    seconds = prompts / SEED_PRECOMPUTE.per_second
    return (f"precompute: about {format_seconds(seconds)} of teacher time for {prompts:,} prompts, scaled from the "
            f"seed's measurement ({SEED_PRECOMPUTE.text()}, a 30 GB MoE teacher all on the GPU); a smaller GPU, an "
            "offloaded teacher or another teacher size changes it. From the first shard on, `gguf-trainer status` "
            "shows this machine's measured rate and ETA")


def _training_line(paths: ProjectPaths, settings: Settings, view: ProjectView | None) -> str:
    if view is not None and (measured := training_pace(paths, settings, view)) is not None:
        return f"{measured.text()} (on this machine)"
    t, ref = settings.training, SEED_TRAINING_SHAPE
    # Work per step grows with the batch, the depth and the square of the width (the adapter's matmuls).
    scale = (t.batch_size / ref["batch_size"]) * (t.depth / ref["depth"]) * (t.width / ref["width"]) ** 2
    seconds = t.steps / SEED_TRAINING.per_second * scale
    about = "under 1s" if seconds < 1 else f"about {format_seconds(seconds)}"  # "about 0s" reads as a fault
    return (f"training: {about} on a GPU like the seed's for {t.steps:,} steps, scaled from the seed's measurement "
            f"({SEED_TRAINING.text()} at width {ref['width']}, depth {ref['depth']}, batch {ref['batch_size']}) by "
            "steps x batch x depth x width squared")
