"""LLaDA-Image's text stack as torch modules: the QueryFormer and the text projection (the pipeline's own small
modules, built from their configs), and what the text encoder's published code needs from transformers 5 while it is
built (the 4.x "default" rope function). The facts are DESIGN.md §10; lib/precompute/llada_teacher.py runs them,
lib/materials/teacher/preflight.py builds them on the meta device to check a pipeline before its weights.

Torch only; no weights are read here.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """A weightless RMSNorm; the variance in f32, as the pipeline computes it."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + eps)).to(x.dtype)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, L, H*D] → [B, H, L, D]."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


class QueryFormerBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.hidden, self.eps = hidden, eps
        # nn.MultiheadAttention's packed in_proj and out_proj are the checkpoint's own names and math.
        self.cross_attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, intermediate)
        self.mlp.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, queries: torch.Tensor, text: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        shape = (self.hidden,)
        queries = F.layer_norm(queries, shape, eps=self.eps)
        attended, _ = self.cross_attn(queries, text, text, key_padding_mask=padding, need_weights=False)
        queries = F.layer_norm(queries + attended, shape, eps=self.eps)
        return queries + self.mlp.fc2(F.gelu(self.mlp.fc1(queries), approximate="tanh"))


class QueryFormer(nn.Module):
    """Learned queries → per-prompt query embeddings [B, Q, D] (queryformer/ of the pipeline)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("norm_eps", 1e-6)
        self.eps = eps
        self.meta_queries = nn.Parameter(torch.zeros(config["num_queries"], hidden))
        self.query_blocks = nn.ModuleList(
            QueryFormerBlock(hidden, config["num_attention_heads"], config["intermediate_size"], eps)
            for _ in range(config.get("num_hidden_layers", 1)))

    def forward(self, embeddings: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``embeddings`` [B, L, D] raw token embeddings, ``keep`` [B, L] bool (False: padding)."""
        text = F.layer_norm(embeddings, (embeddings.shape[-1],), eps=self.eps)
        queries = self.meta_queries.unsqueeze(0).expand(embeddings.shape[0], -1, -1)
        for block in self.query_blocks:
            queries = block(queries, text, ~keep)
        return queries


class ProjectionBlock(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads, self.eps = heads, eps
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, nn.Linear(hidden, hidden))
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(hidden, intermediate)
        self.mlp.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor, key_keep: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        h = rms_norm(x, self.eps)
        q = rms_norm(_heads(a.q_proj(h), self.heads), self.eps)
        k = rms_norm(_heads(a.k_proj(h), self.heads), self.eps)
        v = _heads(a.v_proj(h), self.heads)
        # The original has no mask (it runs one prompt at a time): masking the keys to the prompt's own rows is the
        # same computation for every batch.
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=key_keep[:, None, None, :])
        x = x + a.out_proj(attended.transpose(1, 2).flatten(2))
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(rms_norm(x, self.eps)), approximate="tanh"))


class TextProjection(nn.Module):
    """Backbone states [B, L, D] → conditioning rows [B, L, P] (text_projection/ of the pipeline)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.layers = nn.ModuleList(
            ProjectionBlock(hidden, config["intermediate_size"], config["num_attention_heads"],
                            config.get("norm_eps", 1e-6))
            for _ in range(config.get("num_hidden_layers", 6)))
        self.projector = nn.Linear(hidden, config["projection_dim"])

    def forward(self, states: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            states = layer(states, keep)
        return self.projector(states)


def default_rope_parameters(config, device=None, seq_len=None, **kwargs) -> tuple[torch.Tensor, float]:
    """transformers 4.x's "default" rope function, which 5.x removed and LLaDA2-MoE's code looks up by name."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * (getattr(config, "partial_rotary_factor", None) or 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (config.rope_theta ** exponents), 1.0


@contextlib.contextmanager
def default_rope_registered():
    """The 4.x "default" rope function, registered while the backbone is built, and only then: transformers 5's
    own models (the student's Qwen3) compute that case inline and take a registered "default" over it, which
    reads a config field they no longer have. The backbone keeps the function it looked up (``rope_init_fn``)."""
    from transformers import modeling_rope_utils

    table = modeling_rope_utils.ROPE_INIT_FUNCTIONS
    added = "default" not in table
    if added:
        table["default"] = default_rope_parameters
    try:
        yield
    finally:
        if added:
            table.pop("default", None)


@contextlib.contextmanager
def written_for_transformers_4():
    """The backbone's code and config were written for transformers 4.x: its rope function is registered while it
    is built, and 5.x's deprecation warnings about it (``rope_scaling``) are addressed to the repo's authors, not to
    the user, so they stay out of the console."""
    with warnings.catch_warnings(), default_rope_registered():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
