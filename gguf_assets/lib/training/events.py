"""What training tells its caller while it runs: one frozen dataclass per kind of event.

``train_adapter(..., on_event=...)`` (lib/training/train.py) calls ``on_event`` with a ``TrainingEvent``; the
Dagster asset (defs/training.py) records the ``figures()`` of each ``LogStep`` and ``Validation`` as an
observation, which the Dagster UI plots and the studio reads (its keys are those observations' metadata keys).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from gguf_assets.lib.core.metrics import (
    EMPTY_PROMPT_COSINE,
    VAL_CENTRED_COSINE,
    VAL_LOSS,
    VAL_REL_MSE,
    VAL_RMS_COSINE,
    WORST_ROW,
    WORST_ROW_COSINE,
)


@dataclass(frozen=True)
class Note:
    """A message for the user (also logged by the trainer itself); ``warning`` when something was wrong."""

    message: str
    warning: bool = False


@dataclass(frozen=True)
class LogStep:
    """A log step: loss, learning rate and gradient norm of this step, the throughput since the previous log
    step, the hardware sampled now (GPU/CPU/RAM figures by name) and the console's ETA (None when unknown)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    steps_per_s: float
    samples_per_s: float
    data_wait_fraction: float
    read_mb_per_s: float
    hardware: Mapping[str, float] = field(default_factory=dict)
    eta_s: float | None = None

    def history_entry(self) -> dict:
        """The step's entry in the run's history (checkpoint and final meta.json): no hardware, no ETA."""
        return {"step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
                "steps_per_s": self.steps_per_s, "samples_per_s": self.samples_per_s,
                "data_wait_fraction": self.data_wait_fraction, "read_mb_per_s": self.read_mb_per_s}

    def figures(self) -> dict:
        """Every figure by name, as the adapter's observation records them: the history entry, the hardware
        sample, then ``eta_s`` when known."""
        return {**self.history_entry(), **self.hardware, **({"eta_s": self.eta_s} if self.eta_s is not None else {})}


@dataclass(frozen=True)
class Validation:
    """The validation at ``step`` (of the weights judged: the average when ``training.ema_decay`` is on); its
    scores are lib/core/metrics.py's, in the raw target space. Those added later are None in older histories."""

    step: int
    val_centred_cosine: float
    empty_prompt_cosine: float | None
    val_loss: float
    val_rel_mse: float | None = None
    val_rms_cosine: float | None = None
    worst_row: int | None = None
    worst_row_cosine: float | None = None

    @classmethod
    def of(cls, step: int, scores: Mapping[str, object]) -> Validation:
        """The validation at ``step`` from train.evaluate's scores (keyed by lib/core/metrics.py's names)."""
        return cls(step=step, **{f.name: scores.get(f.name) for f in fields(cls) if f.name != "step"})

    def figures(self) -> dict:
        """The figures by name (lib/core/metrics.py's), as the run's history and the adapter's observation record
        them."""
        return {"step": self.step, VAL_CENTRED_COSINE: self.val_centred_cosine,
                EMPTY_PROMPT_COSINE: self.empty_prompt_cosine, VAL_LOSS: self.val_loss, VAL_REL_MSE: self.val_rel_mse,
                VAL_RMS_COSINE: self.val_rms_cosine, WORST_ROW: self.worst_row, WORST_ROW_COSINE: self.worst_row_cosine}


@dataclass(frozen=True)
class NewBest:
    """A validation better than every earlier one of the run: its weights were saved to best/."""

    step: int
    val_centred_cosine: float
    empty_prompt_cosine: float | None
    val_loss: float


@dataclass(frozen=True)
class CheckpointWritten:
    """A checkpoint of ``step`` was written (a resume continues from it)."""

    step: int


@dataclass(frozen=True)
class Finished:
    """The run finished: the final weights are saved, with their validation score."""

    step: int
    val_centred_cosine: float


TrainingEvent = Note | LogStep | Validation | NewBest | CheckpointWritten | Finished
OnEvent = Callable[[TrainingEvent], None]
