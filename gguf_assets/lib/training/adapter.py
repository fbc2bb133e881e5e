"""The adapter: Q learned query rows attend to the student's hidden states → Q x D target.

Only plain ops (linear, LayerNorm, softmax attention, tanh-GELU), so a GGML runtime can
run it. The math, exactly (docs/adapter.md and the GGUF layout repeat it):

    m   = in_proj(fuse(s))                       s: student states [L, k*Ds] → [L, W]
    m   = [null_memory ; m]                      one learned row, so the empty prompt
                                                 (zero tokens) still has a key to attend to
    x   = query                                  [Q, W]
    for each block:
        x = x + MHA(LN_cross(x), m, m)           cross-attention, padded tokens masked
        x = x + MHA(LN_self(x), x', x')          self-attention over the Q rows (x' = LN_self(x))
        x = x + down(gelu_tanh(up(LN_mlp(x))))   up: W → 4W
    y   = out_proj(LN_out(x))                    [Q, D], in standardized target space
    target ≈ y * target_std + target_mean

MHA(a, b, c) = o(concat_h softmax(q_h(a) k_h(b)^T / sqrt(W/H)) v_h(c)); all linears have bias.
LayerNorm eps is ``NORM_EPS``.

fuse(s) is LN_in(s) for one student layer (k = 1). For k layers side by side, s = [s_1 | ... | s_k],
each s_i normalised on its own first (N: LayerNorm without weight or bias; the layers' scales differ a lot):

    concat:  fuse(s) = [N(s_1) | ... | N(s_k)] * LN_in.weight + LN_in.bias     LN_in over k*Ds
    mix:     fuse(s) = LN_in(sum_i softmax(layer_mix)_i * N(s_i))              layer_mix [k], zeros at init
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

NORM_EPS = 1e-5
MLP_RATIO = 4
LAYER_FUSIONS = ("concat", "mix")


@dataclass(frozen=True)
class AdapterShape:
    student_dim: int
    query_rows: int
    target_dim: int
    width: int
    depth: int
    heads: int
    student_layers: int = 1         # k: student layers fed side by side (student_dim is one layer's width)
    layer_fusion: str = "concat"    # how k > 1 layers are fused (LAYER_FUSIONS); "concat" for one layer

    def to_dict(self) -> dict:
        shape = asdict(self)
        if self.student_layers == 1:  # recorded as before several layers existed: old checkpoints still resume
            del shape["student_layers"], shape["layer_fusion"]
        return shape


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, n, w = x.shape
        h = self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, -1, h, w // h).transpose(1, 2)

        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(memory)), split(self.v(memory)),
                                             attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, n, w))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.cross_norm = nn.LayerNorm(width, eps=NORM_EPS)
        self.cross_attn = Attention(width, heads)
        self.self_norm = nn.LayerNorm(width, eps=NORM_EPS)
        self.self_attn = Attention(width, heads)
        self.mlp_norm = nn.LayerNorm(width, eps=NORM_EPS)
        self.mlp_up = nn.Linear(width, MLP_RATIO * width)
        self.mlp_down = nn.Linear(MLP_RATIO * width, width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, memory_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.cross_attn(self.cross_norm(x), memory, memory_mask)
        y = self.self_norm(x)
        x = x + self.self_attn(y, y, None)
        return x + self.mlp_down(F.gelu(self.mlp_up(self.mlp_norm(x)), approximate="tanh"))


class Adapter(nn.Module):
    def __init__(self, shape: AdapterShape, *, grad_checkpoint: bool = False) -> None:
        super().__init__()
        if shape.width % shape.heads:
            raise ValueError(f"heads ({shape.heads}) must divide width ({shape.width})")
        self.shape = shape
        self.grad_checkpoint = grad_checkpoint
        w = shape.width
        self.query = nn.Parameter(torch.randn(shape.query_rows, w) * 0.02)
        self.null_memory = nn.Parameter(torch.randn(1, w) * 0.02)
        if shape.layer_fusion not in LAYER_FUSIONS:
            raise ValueError(f"layer_fusion {shape.layer_fusion!r} is not one of {LAYER_FUSIONS}")
        fused = shape.student_dim * (shape.student_layers if shape.layer_fusion == "concat" else 1)
        if shape.student_layers > 1 and shape.layer_fusion == "mix":
            self.layer_mix = nn.Parameter(torch.zeros(shape.student_layers))  # equal weights at the start
        self.in_norm = nn.LayerNorm(fused, eps=NORM_EPS)
        self.in_proj = nn.Linear(fused, w)
        self.blocks = nn.ModuleList(Block(w, shape.heads) for _ in range(shape.depth))
        self.out_norm = nn.LayerNorm(w, eps=NORM_EPS)
        self.out_proj = nn.Linear(w, shape.target_dim)
        # Standardization statistics travel with the weights (checkpoint and GGUF).
        self.register_buffer("target_mean", torch.zeros(shape.query_rows, shape.target_dim))
        self.register_buffer("target_std", torch.ones(shape.query_rows, shape.target_dim))

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """states [B, L, Ds], mask [B, L] bool (True = real token) → standardized [B, Q, D]."""
        b = states.shape[0]
        memory = self.in_proj(self.fuse(states))
        memory = torch.cat([self.null_memory.expand(b, 1, -1).to(memory.dtype), memory], dim=1)
        memory_mask = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=mask.device), mask], dim=1)
        x = self.query.expand(b, -1, -1).to(memory.dtype)
        for block in self.blocks:
            if self.grad_checkpoint and self.training:
                x = checkpoint(block, x, memory, memory_mask, use_reentrant=False)
            else:
                x = block(x, memory, memory_mask)
        return self.out_proj(self.out_norm(x))

    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """[B, L, k*Ds] student states → the normalised input of in_proj (the module docstring's fuse)."""
        k = self.shape.student_layers
        if k == 1:
            return self.in_norm(states)
        per_layer = F.layer_norm(states.unflatten(-1, (k, self.shape.student_dim)), (self.shape.student_dim,),
                                 eps=NORM_EPS)
        if self.shape.layer_fusion == "concat":
            return per_layer.flatten(-2) * self.in_norm.weight + self.in_norm.bias
        return self.in_norm((torch.softmax(self.layer_mix, 0)[:, None] * per_layer).sum(-2))

    def to_target_space(self, standardized: torch.Tensor) -> torch.Tensor:
        return standardized * self.target_std + self.target_mean


def standardize(targets: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (targets - mean) / std


def adapter_loss(pred: torch.Tensor, standardized_targets: torch.Tensor, *, cosine_weight: float,
                 relational_weight: float = 0.0) -> torch.Tensor:
    """Whitened MSE + cosine_weight * (1 - cos) per query row, both in standardized space, plus
    relational_weight * ``relational_loss`` when it is on."""
    mse = F.mse_loss(pred, standardized_targets)
    cos = F.cosine_similarity(pred, standardized_targets, dim=-1, eps=1e-8)
    loss = mse + cosine_weight * (1.0 - cos).mean()
    if relational_weight:
        loss = loss + relational_weight * relational_loss(pred, standardized_targets)
    return loss


def relational_loss(pred: torch.Tensor, standardized_targets: torch.Tensor) -> torch.Tensor:
    """How far the batch's prompt-to-prompt similarities are from the targets': the mean squared difference
    of the two [B, B] cosine matrices, each prompt's Q x D output flattened (the targets are centred, so
    these are centred cosines). Gives each prompt's place among the others a gradient of its own, as
    relational distillation does (CLIP-KD); 0 for a batch of one."""
    def similarities(x: torch.Tensor) -> torch.Tensor:
        unit = F.normalize(x.flatten(1), dim=-1, eps=1e-8)
        return unit @ unit.T

    return F.mse_loss(similarities(pred), similarities(standardized_targets))


def centred_cosine_rows(pred_std: torch.Tensor, targets: torch.Tensor, mean: torch.Tensor,
                        std: torch.Tensor) -> torch.Tensor:
    """Per prompt: mean over query rows of cos(prediction - mean, target - mean) in teacher space.

    prediction - mean = pred_std * std, so the mean cancels exactly. Returns [B].
    """
    cos = F.cosine_similarity(pred_std.float() * std, targets.float() - mean, dim=-1, eps=1e-8)
    return cos.mean(dim=-1)


def lr_at(step: int, *, peak: float, warmup: int, total: int, floor_ratio: float = 0.1) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``floor_ratio * peak`` at ``total``."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = peak * floor_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
