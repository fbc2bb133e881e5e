"""The scores a trainer compares adapters by, named once: the keys of report.json, of a training run's history (one
entry per validation), of the adapter's observations and the eval_report's metadata in Dagster, of
`gguf-trainer runs --compare` and of the studio.

Every score is measured in the raw target space, the conditioning the DiT reads (the GGUF's output; the torch
model's output mapped back through its standardization), never in the loss's whitened space. The centre is the
training targets' per-row mean (``target_centre`` [Q, D], in every checkpoint's weights), the one centred cosine
subtracts. Per val prompt, with pred and target [Q, D]:

- ``val_centred_cosine`` (the verdict): the mean over rows of cos(pred_r - centre_r, target_r - centre_r); then
  the mean over prompts.
- ``val_rel_mse``: sum ||pred - target||^2 / sum ||target - centre||^2, both sums over every val prompt, row and
  dimension (one ratio of totals, not a mean of ratios): 0 is perfect; predicting the centre scores 1.
- ``val_rms_cosine``: each row of pred and of target divided by its RMS (sqrt(mean of squares + 1e-6)), then the
  cosine per row, averaged over rows and prompts. What a DiT that RMS-normalizes each conditioning row sees (its
  own per-dimension weight aside). A row's RMS is a positive number and a cosine ignores scale, so this is the
  raw rows' uncentred cosine: it counts the centre, which centred cosine removes, and ignores each row's scale,
  which relative MSE counts.
- ``worst_row`` / ``worst_row_cosine``: the query row whose centred cosine, averaged over val prompts, is the
  lowest: its index (0-based) and that average.
- ``empty_prompt_cosine``: the centred cosine of the empty prompt (the CFG embedding), over the val prompts that
  are empty.
- Prompt retrieval (the GGUF evaluation's only), over the N non-empty val prompts (the empty ones are all the same
  prompt): with sim(i, j) the centred cosine of prompt i's prediction against prompt j's target,
  ``val_retrieval_top1`` is the share of prompts whose own target is the nearest of the N (strictly: a tie counts
  against), ``val_retrieval_top5`` the share whose own target is among the 5 nearest, and
  ``val_retrieval_margin`` the mean own sim(i, i) less the mean sim(i, j) over every pair i != j.
  ``val_retrieval_prompts`` is N: an adapter that ignores the prompt retrieves at chance, 1/N and 5/N. Centred
  cosine cannot see such an adapter where the prompts' targets share much (a teacher that barely reads the
  prompt); retrieval can, and the verdict's "Good" needs it (lib/training/verdict.py).

``gguf_vs_checkpoint`` (the evaluation's only: report.json, and flattened in the eval_report's metadata): the
exported GGUF's outputs against the torch checkpoint's on the same val inputs; per row the cosine of the two outputs
less the centre (their lowest and their mean), and the largest |GGUF - checkpoint| over every value, alone and
divided by the RMS of the checkpoint's centred outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

VAL_CENTRED_COSINE: Final = "val_centred_cosine"
EMPTY_PROMPT_COSINE: Final = "empty_prompt_cosine"
VAL_REL_MSE: Final = "val_rel_mse"
VAL_RMS_COSINE: Final = "val_rms_cosine"
WORST_ROW: Final = "worst_row"  # an index
WORST_ROW_COSINE: Final = "worst_row_cosine"
VAL_LOSS: Final = "val_loss"
VAL_RETRIEVAL_TOP1: Final = "val_retrieval_top1"
VAL_RETRIEVAL_TOP5: Final = "val_retrieval_top5"
VAL_RETRIEVAL_MARGIN: Final = "val_retrieval_margin"
VAL_RETRIEVAL_PROMPTS: Final = "val_retrieval_prompts"  # N, the non-empty val prompts: chance is 1/N and 5/N
RETRIEVAL_KEYS: Final = (VAL_RETRIEVAL_TOP1, VAL_RETRIEVAL_TOP5, VAL_RETRIEVAL_MARGIN, VAL_RETRIEVAL_PROMPTS)
RETRIEVAL_TOP: Final = 5  # the k of top-k

# The GGUF against the torch checkpoint (report.json's GGUF_VS_CHECKPOINT object; flattened with its name in front
# in the Dagster metadata).
GGUF_VS_CHECKPOINT: Final = "gguf_vs_checkpoint"
MIN_ROW_COSINE: Final = "min_row_cosine"
MEAN_ROW_COSINE: Final = "mean_row_cosine"
MAX_ABS_DIFF: Final = "max_abs_diff"
MAX_ABS_DIFF_RELATIVE: Final = "max_abs_diff_relative"
AGREEMENT_KEYS: Final = (MIN_ROW_COSINE, MEAN_ROW_COSINE, MAX_ABS_DIFF, MAX_ABS_DIFF_RELATIVE)

RMS_EPS: Final = 1e-6  # in val_rms_cosine's RMS, as an RMSNorm's


@dataclass(frozen=True)
class Score:
    """A score as tables show it: its key, its label, whether higher is better, and its format."""

    key: str
    label: str
    higher_is_better: bool = True
    fmt: str = ".4f"

    def text(self, value: float | None) -> str:
        return "n/a" if value is None else format(value, self.fmt)

    @property
    def better(self) -> str:
        """Which way is better, in words (the report's and the studio's score labels say it)."""
        return "higher is better" if self.higher_is_better else "lower is better"


# The scores compared run by run and step by step, in the order tables list them (the verdict first). The worst
# row's index goes with WORST_ROW_COSINE.
COMPARED: Final = (
    Score(VAL_CENTRED_COSINE, "val centred cosine"),
    Score(VAL_REL_MSE, "val relative MSE", higher_is_better=False),
    Score(VAL_RMS_COSINE, "cosine after RMSNorm"),
    Score(WORST_ROW_COSINE, "worst query row"),
    Score(EMPTY_PROMPT_COSINE, "empty prompt cosine"),
)

# Prompt retrieval, as the report, `runs --compare` and the studio label it (the GGUF evaluation's; no training
# history has it).
RETRIEVAL_SCORES: Final = (
    Score(VAL_RETRIEVAL_TOP1, "prompt retrieval top-1", fmt=".3f"),
    Score(VAL_RETRIEVAL_TOP5, f"prompt retrieval top-{RETRIEVAL_TOP}", fmt=".3f"),
    Score(VAL_RETRIEVAL_MARGIN, "prompt retrieval margin"),
)


def retrieval_chance(prompts: int, top: int = 1) -> float:
    """The top-``top`` retrieval of an adapter that ignores the prompt, among ``prompts`` val prompts."""
    return min(top, prompts) / prompts


SHOWN_DIGITS = 5


def shown(value: float) -> float:
    """A score as Dagster's metadata shows and plots it: five significant digits (0.90695, 1.1136e-03). The UI
    prints a float's full repr, sixteen digits of which the last eleven say nothing."""
    return float(f"{value:.{SHOWN_DIGITS}g}")
