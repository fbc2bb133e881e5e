"""The seed app's measurements (its reference run on an RTX 5090): the one place their numbers live.

The generated project.yaml quotes them beside the settings they are about (settings.SECTION_HINTS), and
`gguf-trainer estimate` scales them to a project before anything of it was measured (lib/status/time_estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    """``amount`` units of work in ``hours`` on ``where``."""

    amount: int
    unit: str
    hours: float
    where: str

    @property
    def per_second(self) -> float:
        return self.amount / (self.hours * 3600)

    def text(self) -> str:
        return f"{self.amount:,} {self.unit} in {self.hours:.2g} h on {self.where}, {self.per_second:.1f} {self.unit}/s"


# Teacher time of the precompute: a 30 GB Qwen3-MoE teacher, sequential placement, all of it on the GPUs.
SEED_PRECOMPUTE = Measured(60_000, "prompts", 3.7, "an RTX 5090 (+ a 4050)")
# Training with the trainer8 recipe (width 1024, depth 6, batch 32).
SEED_TRAINING = Measured(20_000, "steps", 55 / 60, "an RTX 5090")
SEED_TRAINING_SHAPE = {"width": 1024, "depth": 6, "batch_size": 32}
