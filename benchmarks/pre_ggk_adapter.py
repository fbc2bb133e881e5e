"""The adapter as it was before #55 (e698145's lib/training/adapter.py, one student layer), as a benchmark prototype.

ggk cannot load it: its modules, its block order, its heads and its null memory row are not ggk's resampler. It
exists only for bench_quality.py's "pre-ggk-adapter" row, to measure what the switch to ggk's architecture cost or
gained. The network between the student's states and ``out_proj`` is the old one:

    m   = in_proj(LN_in(s))                      s: student states [L, Ds] -> [L, W]
    m   = [null_memory ; m]                      one learned row, so the empty prompt still has a key
    x   = query                                  [Q, W]
    for each block:
        x = x + MHA(LN_cross(x), m, m)           cross-attention, padded tokens masked
        x = x + MHA(LN_self(x), x', x')          self-attention over the Q rows (x' = LN_self(x))
        x = x + down(gelu_tanh(up(LN_mlp(x))))   up: W -> 4W
    y   = out_proj(LN_out(x))                    [Q, D], in standardized target space

MHA over ``heads`` heads of W / heads (W / 16 unless given: the old demo's 4 heads at width 64),
scaled by sqrt(W / heads). Everything the current trainer and evaluator read is the product Adapter's, copied:
the buffers (``target_centre`` [Q, D], ``target_std`` [D], ``loss_std`` [Q, D]), ``target_mean``,
``to_target_space``, ``loss_space``, ``loss_targets`` and ``folded_out_proj``, so the loss and the val centred
cosine are computed exactly as for the product's adapter; and ``token_linears``, which validation reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gguf_assets.lib.training.adapter import AdapterShape, TargetStatistics
from gguf_assets.lib.training.adapter import Attention as ProductAttention

NORM_EPS = 1e-5
MLP_RATIO = 4
OLD_HEAD_DIM = 16  # the old demo's heads: width / 16 (4 at 64 wide)


class Attention(ProductAttention):
    """The product's attention (the same q/k/v/o, created in the same order) over the old head count."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__(width)
        self.heads = heads


class Block(nn.Module):
    """Cross-attention, then self-attention, then the tanh-GELU MLP, each pre-LN and residual."""

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


class PreGgkAdapter(TargetStatistics):
    def __init__(self, shape: AdapterShape, *, grad_checkpoint: bool = False, heads: int | None = None) -> None:
        super().__init__()
        heads = heads or max(1, shape.width // OLD_HEAD_DIM)
        if shape.width % heads:
            raise ValueError(f"heads ({heads}) must divide width ({shape.width})")
        self.shape = shape
        self.heads = heads
        self.grad_checkpoint = grad_checkpoint
        w = shape.width
        # Created in the old order, so a seed draws the old initialization.
        self.query = nn.Parameter(torch.randn(shape.query_rows, w) * 0.02)
        self.null_memory = nn.Parameter(torch.randn(1, w) * 0.02)
        self.in_norm = nn.LayerNorm(shape.student_dim, eps=NORM_EPS)
        self.in_proj = nn.Linear(shape.student_dim, w)
        self.blocks = nn.ModuleList(Block(w, heads) for _ in range(shape.depth))
        self.out_norm = nn.LayerNorm(w, eps=NORM_EPS)
        self.out_proj = nn.Linear(w, shape.target_dim)
        # The product Adapter's statistics, as the trainer fills them, and the maps the loss and the scores read.
        self._register_statistics(shape.query_rows, shape.target_dim)

    def forward(self, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """states [B, L, Ds], mask [B, L] bool (True = real token) -> standardized [B, Q, D]."""
        b = states.shape[0]
        memory = self.in_proj(self.in_norm(states))
        memory = torch.cat([self.null_memory.expand(b, 1, -1).to(memory.dtype), memory], dim=1)
        memory_mask = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=mask.device), mask], dim=1)
        x = self.query.expand(b, -1, -1).to(memory.dtype)
        for block in self.blocks:
            if self.grad_checkpoint and self.training:
                x = checkpoint(block, x, memory, memory_mask, use_reentrant=False)
            else:
                x = block(x, memory, memory_mask)
        return self.out_proj(self.out_norm(x))

    def token_linears(self) -> list[nn.Linear]:
        """The linears whose input rows are the prompt's tokens, one per mask entry (the trainer's validation records
        input peaks by them, lib/training/input_peaks.py): in_proj alone. The cross-attentions' k and v read the
        null row too, so theirs are recorded over every row, padding included: nothing of this adapter is exported."""
        return [self.in_proj]
