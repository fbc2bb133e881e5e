"""The adapter: ggk's seedless resampler (llm_adapter.hpp, trainer8 / LLaDA-Image), module for module, so the
checkpoint and the exported file are the same function. Q learned query rows read the student's final-norm
states [L, Ds] and give the Q x D conditioning:

    kv  = in_proj(s)                                       [L, W]
    q   = query                                            [Q, W]
    for each block:
        q = q + self_attn(ln_self(q))                      self-attention over the Q rows
        q = q + cross_attn(ln_q(q), ln_kv(kv))             cross-attention to the student's tokens
        q = q + mlp.2(gelu_erf(mlp.0(ln_mlp(q))))         mlp.0: W -> 4W
    y   = out_proj(ln_out(q))                              [Q, D], in standardized target space
    target ~ y * target_std + target_mean                  per dim, [D]: the export folds it into out_proj

The output's standardization is one scale and offset per dim, shared by the query rows, because ggk has no
tensor for it and only a row-shared affine map folds into out_proj. The loss is trainer8's all the same: it
compares ``loss_space`` values, each (row, dim) centred on its train mean (``target_centre`` [Q, D]) and scaled
by its own std (``loss_std`` [Q, D]); neither reaches the file.

attn(a, b) = o(concat_h softmax(q_h(a) k_h(b)^T / 8) v_h(b)): heads of 64 (heads = W / 64), every linear biased,
LayerNorm eps 1e-5 (lib/core/ggk_contract.py). ggk runs one prompt with no key mask; a padded training batch
masks its padding keys, which is the same function for each prompt.

The module names are ggk's tensor names (minus the file's ``adapter.`` prefix), so the state dict exports
without a renaming table. ``AdapterShape.variant`` names the variant; ggk's token-aligned, seeded and layerwise
variants would be added beside the resampler as modules of their own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gguf_assets.lib.core.ggk_contract import (
    ADAPTER_HEAD_DIM,
    ADAPTER_LAYER_NORM_EPS,
    ADAPTER_MLP_RATIO,
    ADAPTER_VARIANTS,
)

NORM_EPS = ADAPTER_LAYER_NORM_EPS
MLP_RATIO = ADAPTER_MLP_RATIO
HEAD_DIM = ADAPTER_HEAD_DIM
QUERY_INIT_SCALE = 0.02  # the query rows' RMS at initialization, whichever training.init
RANDOM_INIT, ROW_MEANS_INIT = "random", "row_means"  # training.init


@dataclass(frozen=True)
class AdapterShape:
    student_dim: int
    query_rows: int
    target_dim: int
    width: int
    depth: int
    variant: str = "resampler"

    @property
    def heads(self) -> int:
        return self.width // HEAD_DIM

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    """Separate biased q/k/v/o projections over heads of HEAD_DIM (llm_adapter.hpp, Attention)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = width // HEAD_DIM
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x [1 or B, N, W] reads memory [B, L, W]: a batch-1 x (the query rows before any prompt reaches them) is
        projected once and shared by the batch's prompts."""
        n, w = x.shape[1], x.shape[2]
        b = memory.shape[0]
        h = self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(t.shape[0], -1, h, w // h).transpose(1, 2)  # w // h is HEAD_DIM here

        mask = None if key_mask is None else key_mask[:, None, None, :]
        queries = split(self.q(x)).expand(b, -1, -1, -1)
        out = F.scaled_dot_product_attention(queries, split(self.k(memory)), split(self.v(memory)), attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, n, w))


class ResamplerBlock(nn.Module):
    """llm_adapter.hpp, Block: self-attention, then cross-attention, then the MLP, each pre-LN and residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_self = nn.LayerNorm(width, eps=NORM_EPS)
        self.self_attn = Attention(width)
        self.ln_q = nn.LayerNorm(width, eps=NORM_EPS)
        self.ln_kv = nn.LayerNorm(width, eps=NORM_EPS)
        self.cross_attn = Attention(width)
        self.ln_mlp = nn.LayerNorm(width, eps=NORM_EPS)
        # Named mlp.0 / mlp.2 as ggk loads them (torch's Sequential(Linear, GELU, Linear)); exact GELU.
        self.mlp = nn.Sequential(nn.Linear(width, MLP_RATIO * width), nn.GELU(), nn.Linear(MLP_RATIO * width, width))

    def forward(self, q: torch.Tensor, kv: torch.Tensor, kv_mask: torch.Tensor | None) -> torch.Tensor:
        """q [1 or B, Q, W] (batch 1: the same rows for every prompt, as the first block gets them), kv [B, L, W]
        -> [B, Q, W]."""
        x = self.ln_self(q)
        q = q + self.self_attn(x, x, None)
        q = q + self.cross_attn(self.ln_q(q), self.ln_kv(kv), kv_mask)  # the first that differs per prompt
        return q + self.mlp(self.ln_mlp(q))


class TargetStatistics(nn.Module):
    """The train targets' statistics an adapter carries (buffers, so they travel in every checkpoint) and the maps
    the loss, the scores and the export read them by. A subclass calls ``_register_statistics`` where its own
    modules end (the buffers' place in the state dict)."""

    def _register_statistics(self, query_rows: int, target_dim: int) -> None:
        # The output's per-dim scale, which the export folds into out_proj with the mean, and the loss's
        # per-(row, dim) centre and scale.
        self.register_buffer("target_centre", torch.zeros(query_rows, target_dim))
        self.register_buffer("target_std", torch.ones(target_dim))
        self.register_buffer("loss_std", torch.ones(query_rows, target_dim))

    @property
    def target_mean(self) -> torch.Tensor:
        """[D]: the train targets' mean per dim, over prompts and rows (every row has each prompt once)."""
        return self.target_centre.mean(0)

    def to_target_space(self, standardized: torch.Tensor) -> torch.Tensor:
        return standardized * self.target_std + self.target_mean

    def loss_space(self, standardized: torch.Tensor) -> torch.Tensor:
        """The output, [B, Q, D] in standardized space, as the loss reads it: centred and scaled per (row, dim)."""
        return (self.to_target_space(standardized) - self.target_centre) / self.loss_std

    def loss_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Teacher targets as the loss reads them (``loss_space``'s counterpart)."""
        return (targets.float() - self.target_centre) / self.loss_std

    def folded_out_proj(self) -> tuple[torch.Tensor, torch.Tensor]:
        """out_proj with the standardization folded in: (weight [D, W], bias [D]) giving targets directly."""
        std = self.target_std.float()
        weight, bias = self.out_proj.weight.float(), self.out_proj.bias.float()
        return weight * std[:, None], bias * std + self.target_mean.float()


class Adapter(TargetStatistics):
    def __init__(self, shape: AdapterShape, *, grad_checkpoint: bool = False) -> None:
        super().__init__()
        if shape.variant not in ADAPTER_VARIANTS:
            raise ValueError(f"adapter variant {shape.variant!r} is not one of {ADAPTER_VARIANTS}")
        if shape.width % HEAD_DIM or shape.width <= 0:
            raise ValueError(f"width ({shape.width}) must be a positive multiple of ggk's head dim {HEAD_DIM}")
        self.shape = shape
        self.grad_checkpoint = grad_checkpoint
        w = shape.width
        self.query = nn.Parameter(torch.randn(shape.query_rows, w) * QUERY_INIT_SCALE)
        self.in_proj = nn.Linear(shape.student_dim, w)
        self.blocks = nn.ModuleList(ResamplerBlock(w) for _ in range(shape.depth))
        self.ln_out = nn.LayerNorm(w, eps=NORM_EPS)
        self.out_proj = nn.Linear(w, shape.target_dim)
        self._register_statistics(shape.query_rows, shape.target_dim)

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """states [B, L, Ds], mask [B, L] bool (True = real token) -> standardized [B, Q, D]."""
        kv = self.in_proj(states)
        # Batch 1: until the first cross-attention the rows are the same for every prompt, so the first block's
        # self-attention and cross-attention query run once per batch, not once per prompt (the same numbers:
        # a depth-1 training step of the demo's shape took 132 ms, 73 ms with this; benchmarks/bench_train.py).
        q = self.query[None].to(kv.dtype)
        for block in self.blocks:
            if self.grad_checkpoint and self.training:
                q = checkpoint(block, q, kv, mask, use_reentrant=False)
            else:
                q = block(q, kv, mask)
        return self.out_proj(self.ln_out(q))

    def query_bank(self) -> list[nn.Parameter]:
        """The parameters training.query_lr_scale applies to: the query rows."""
        return [self.query]

    def residual_outputs(self) -> list[nn.Linear]:
        """The last linear of each residual branch (self_attn.o, cross_attn.o, mlp.2): at zero, a block passes its
        rows through unchanged."""
        return [linear for block in self.blocks for linear in (block.self_attn.o, block.cross_attn.o, block.mlp[2])]

    def token_linears(self) -> list[nn.Linear]:
        """The linears whose input rows are the prompt's tokens ([B, L, *], padded in a batch): in_proj and each
        cross-attention's k and v. Every other linear reads the query rows."""
        return [self.in_proj, *(linear for block in self.blocks for linear in (block.cross_attn.k, block.cross_attn.v))]


LR_SCALE = "lr_scale"  # an optimizer parameter group's learning rate, as a multiple of the schedule's


def parameter_groups(model: Adapter, *, query_lr_scale: float) -> list[dict]:
    """The optimizer's parameter groups: one (trainer8's), or the query rows at ``query_lr_scale`` times the
    schedule's learning rate (training.query_lr_scale) beside the rest."""
    if query_lr_scale == 1.0:
        return [{"params": list(model.parameters())}]
    bank = {id(p) for p in model.query_bank()}
    return [{"params": model.query_bank(), LR_SCALE: query_lr_scale},
            {"params": [p for p in model.parameters() if id(p) not in bank]}]


@torch.no_grad()
def start_at_row_means(model: Adapter, *, seed: int) -> None:
    """training.init: row_means. The untrained adapter outputs each query row's train mean (``target_centre``) for
    every prompt, so training starts from the prompt-independent part the teacher's rows carry (on the demo's
    shards the row means are 78 to 84 % of the targets' variance) and learns only what the prompt adds. Only the
    starting weights change: the module, the file and ggk's function are the same. Needs the target statistics set.

    - The last linear of every residual branch starts at zero, so the rows leave the blocks as the query bank
      entered them (the first step's gradient reaches those linears, and through them the rest).
    - The query rows get zero mean and the same RMS (QUERY_INIT_SCALE) over the width, so ln_out scales every row
      by the same factor, and they span the row means' column space: M = (centre - mean) / std [Q, D], the row
      means in the output's standardized units, has rank r <= min(Q, D); its top min(r, W - 2) singular directions
      go in as coordinates of an orthonormal basis of the zero-mean width space, one more coordinate evens the
      rows' norms, and the rest carry small seeded noise that tells apart rows with equal means.
    - out_proj maps ln_out(query) onto M by least squares: exactly when r <= W - 2 (the seed's 256 rows at width
      1024; the demo's 64 dims at width 128)."""
    q_rows, width = model.query.shape  # width: a multiple of 64, so r = 0 still leaves room
    # On the CPU in float64, whatever the training device (CUDA's lstsq takes full-rank inputs only).
    centre = model.target_centre.detach().cpu().double()
    means = (centre - centre.mean(0)) / model.target_std.detach().cpu().double()
    u, s, _ = torch.linalg.svd(means, full_matrices=False)
    rank = min(width - 2, int((s > s[0] * 1e-6).sum()) if s.numel() and s[0] > 0 else 0)
    spans = u[:, :rank] * s[:rank]  # [Q, r]: each row's coordinates in the row means' column space
    g = torch.Generator().manual_seed(seed)
    # An orthonormal basis of the width vectors with zero mean (the ones direction, which LayerNorm removes, first).
    basis = torch.linalg.qr(torch.cat([torch.ones(width, 1, dtype=torch.float64),
                                       torch.randn(width, width - 1, generator=g, dtype=torch.float64)], 1))[0][:, 1:]
    norm2 = float(width)  # each row's squared norm in these coordinates: variance 1 over the width
    spans = spans * math.sqrt(norm2 / 2) / spans.norm(dim=1).max().clamp_min(1e-30)
    noise = torch.randn(q_rows, width - 2 - rank, generator=g, dtype=torch.float64) * QUERY_INIT_SCALE
    fill = (norm2 - spans.square().sum(1) - noise.square().sum(1)).clamp_min(0).sqrt()
    rows = (torch.cat([spans, noise, fill[:, None]], 1) @ basis.T * QUERY_INIT_SCALE).float()  # RMS 0.02, mean 0
    ln_out = model.ln_out
    features = F.layer_norm(rows, (width,), ln_out.weight.detach().cpu(), ln_out.bias.detach().cpu(), ln_out.eps)
    # The minimum-norm fit: LayerNorm's ones direction (zero but for rounding) must get no weight.
    fit = torch.linalg.pinv(features.double(), rtol=1e-6) @ means  # [W, D]
    model.query.copy_(rows)
    for linear in model.residual_outputs():
        linear.weight.zero_()
        linear.bias.zero_()
    model.out_proj.weight.copy_(fit.T)
    model.out_proj.bias.zero_()


def adapter_loss(pred: torch.Tensor, standardized_targets: torch.Tensor, *, cosine_weight: float,
                 relational_weight: float = 0.0) -> torch.Tensor:
    """Whitened MSE + cosine_weight * (1 - cos) per query row, both in the loss's space (Adapter.loss_space and
    loss_targets: centred and scaled per row and dim, as trainer8), plus relational_weight * ``relational_loss``
    when it is on."""
    mse = F.mse_loss(pred, standardized_targets)
    cos = F.cosine_similarity(pred, standardized_targets, dim=-1, eps=1e-8)
    loss = mse + cosine_weight * (1.0 - cos).mean()
    if relational_weight:
        loss = loss + relational_weight * relational_loss(pred, standardized_targets)
    return loss


def relational_loss(pred: torch.Tensor, standardized_targets: torch.Tensor) -> torch.Tensor:
    """How far the batch's prompt-to-prompt similarities are from the targets': the mean squared difference
    of the two [B, B] cosine matrices, each prompt's Q x D output flattened (centred by the caller, so
    these are centred cosines). Gives each prompt's place among the others a gradient of its own, as
    relational distillation does (CLIP-KD); 0 for a batch of one."""
    def similarities(x: torch.Tensor) -> torch.Tensor:
        unit = F.normalize(x.flatten(1), dim=-1, eps=1e-8)
        return unit @ unit.T

    return F.mse_loss(similarities(pred), similarities(standardized_targets))


def centred_cosine_rows(pred_std: torch.Tensor, targets: torch.Tensor, model: "Adapter") -> torch.Tensor:
    """Per prompt: mean over query rows of cos(prediction - centre, target - centre) in teacher space, the
    centre being each row's train mean (model.target_centre). Returns [B]."""
    centre = model.target_centre.float()
    cos = F.cosine_similarity(model.to_target_space(pred_std.float()) - centre, targets.float() - centre, dim=-1,
                              eps=1e-8)
    return cos.mean(dim=-1)


def lr_at(step: int, *, peak: float, warmup: int, total: int, floor_ratio: float = 0.1) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``floor_ratio * peak`` at ``total``."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = peak * floor_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
