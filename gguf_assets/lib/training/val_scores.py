"""The trainer's val scores beside centred cosine, batch by batch in torch: relative MSE, the cosine after a per-row
RMSNorm and the worst query row, all in the raw target space (lib/core/metrics.py defines them; the GGUF's
evaluator, lib/output/gguf_eval.py, computes the same in numpy, independently)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gguf_assets.lib.core import metrics as m

COSINE_EPS = 1e-8  # torch's cosine_similarity default, as centred_cosine_rows uses


class ValScores:
    """Running sums over val batches. ``centre`` [Q, D]: the training targets' per-row mean."""

    def __init__(self, centre: torch.Tensor) -> None:
        self.centre = centre.float()
        self.n = 0
        self.squared_error = torch.zeros((), dtype=torch.float64, device=centre.device)
        self.squared_spread = torch.zeros((), dtype=torch.float64, device=centre.device)
        self.rms_cosine = torch.zeros((), dtype=torch.float64, device=centre.device)
        self.row_cosine = torch.zeros(centre.shape[0], dtype=torch.float64, device=centre.device)

    def add(self, pred: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Count a batch: ``pred`` and ``targets`` [B, Q, D] in the raw target space. Returns each prompt's centred
        cosine [B] (the mean over its rows)."""
        pred, targets = pred.float(), targets.float()
        rows = F.cosine_similarity(pred - self.centre, targets - self.centre, dim=-1, eps=COSINE_EPS)  # [B, Q]
        self.row_cosine += rows.double().sum(dim=0)
        self.squared_error += (pred - targets).double().square().sum()
        self.squared_spread += (targets - self.centre).double().square().sum()
        self.rms_cosine += F.cosine_similarity(rms_normed(pred), rms_normed(targets), dim=-1,
                                               eps=COSINE_EPS).double().mean(dim=-1).sum()
        self.n += pred.shape[0]
        return rows.mean(dim=-1)

    def result(self) -> dict:
        if not self.n:
            return {m.VAL_REL_MSE: None, m.VAL_RMS_COSINE: None, m.WORST_ROW: None, m.WORST_ROW_COSINE: None}
        per_row = self.row_cosine / self.n
        worst = int(torch.argmin(per_row))
        return {m.VAL_REL_MSE: float(self.squared_error / self.squared_spread.clamp_min(COSINE_EPS)),
                m.VAL_RMS_COSINE: float(self.rms_cosine / self.n), m.WORST_ROW: worst,
                m.WORST_ROW_COSINE: float(per_row[worst])}


def rms_normed(x: torch.Tensor, eps: float = m.RMS_EPS) -> torch.Tensor:
    """Each row (last axis) divided by sqrt(mean(x^2) + eps): an RMSNorm without a weight."""
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)
