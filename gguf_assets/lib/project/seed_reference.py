"""The seed app's measurements (its reference run on an RTX 5090), and the demo's on a 2-core CPU: the one place
their numbers live.

The generated project.yaml quotes the seed's beside the settings they are about (settings.SECTION_HINTS), and
`gguf-trainer estimate` scales them to a project before anything of it was measured (lib/planning/time_estimate.py).
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

# The demo (`gguf-trainer demo`, lib/demo/demo.py) on the project's 2-core development machine, 2026-12-07 (a fresh
# clone's run: its final/meta.json's train_seconds, its shard sidecars' busy seconds): the only CPU figures measured.
# Training is compute-bound on a CPU, so `estimate` scales it by the adapter's work per step as it scales the
# seed's; the precompute's pace depends on the teacher, so its figure is only quoted for scale.
DEMO_CPU_TRAINING = Measured(1_200, "steps", 62.4 / 3600, "2 CPU cores")
DEMO_CPU_TRAINING_SHAPE = {"width": 128, "depth": 1, "batch_size": 16}
DEMO_CPU_PRECOMPUTE = Measured(1_800, "prompts", 11.6 / 3600, "2 CPU cores")
DEMO_TEACHER = "a teacher of 0.3 M parameters"
