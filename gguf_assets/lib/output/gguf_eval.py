"""Score an exported adapter GGUF on precomputed shards, independently of the training code.

Everything here is numpy: a minimal safetensors reader, the adapter forward pass
re-implemented from the math in docs/gguf_layout.md (not from adapter.py's code), and the
val centred cosine. It deliberately imports neither torch nor adapter.py/train.py, so a
bug shared by training and export cannot hide here; the tests enforce that.

The forward (per prompt, states s [L, k*Ds]: k student layers side by side; L may be 0):

    m   = in_proj(fuse(s)); m = [null_memory ; m]          [L+1, W]
    x   = query                                             [Q, W]
    per block: x += MHA(LN_cross(x), m, m)
               x += MHA(LN_self(x), LN_self(x), LN_self(x))
               x += down(gelu_tanh(up(LN_mlp(x))))
    y   = out_proj(LN_out(x))                               [Q, D] standardized
    out = y * target.std + target.mean                      teacher space

fuse(s) = LN_in(s) for one layer (k = 1). For k > 1 each layer's slice s_i = s[:, i*Ds:(i+1)*Ds] is
normalised alone (N: no weight, no bias), then

    concat: [N(s_1) | ... | N(s_k)] * in_norm.weight + in_norm.bias     (in_norm, in_proj k*Ds wide)
    mix:    LN_in(sum_i softmax(layer_mix)_i N(s_i))

Score: per prompt, mean over query rows of cos(pred - mean, target - mean) over D; the
overall score is the mean over prompts.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gguf_assets.lib.core.safetensors_io import SafetensorsFile, to_float32
from gguf_assets.lib.output import gguf_format as fmt
from gguf_assets.lib.project.layout import PROMPTS_FILE, STUDENT_FILE, TEACHER_FILE  # noqa: F401  (the shard layout)

logger = logging.getLogger(__name__)

TARGETS_TENSOR = "targets"
HIDDEN_TENSOR = "hidden"
OFFSETS_TENSOR = "offsets"
TOKEN_IDS_TENSOR = "token_ids"

COSINE_EPS = 1e-8  # as torch.nn.functional.cosine_similarity
WORST_COUNT = 10
# Student rows projected at once (memory and K/V of every block): bounds RAM per group.
GROUP_TOKENS = 32768

# --- the adapter in numpy -------------------------------------------------------------


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    centred = x - mu
    var = (centred * centred).mean(axis=-1, keepdims=True)  # biased, as LayerNorm
    return centred / np.sqrt(var + np.float32(eps)) * weight + bias


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(math.sqrt(2.0 / math.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


@dataclass(frozen=True)
class GGUFAdapter:
    """An adapter loaded from GGUF: hparams, metadata and float32 weights (GGUF names,
    numpy orientation: a linear weight is [out, in])."""

    path: Path
    hparams: dict[str, Any]
    metadata: dict[str, Any]
    weights: dict[str, np.ndarray]

    @property
    def name(self) -> str:
        return str(self.metadata.get(fmt.KEY_NAME, ""))

    @property
    def provenance(self) -> dict[str, Any]:
        return fmt.provenance_from_metadata(self.metadata)

    @property
    def target_mean(self) -> np.ndarray:
        return self.weights["target.mean"]

    @property
    def target_std(self) -> np.ndarray:
        return self.weights["target.std"]

    # -- building blocks --

    def _linear(self, x: np.ndarray, prefix: str) -> np.ndarray:
        return x @ self.weights[f"{prefix}.weight"].T + self.weights[f"{prefix}.bias"]

    def _norm(self, x: np.ndarray, prefix: str) -> np.ndarray:
        return _layer_norm(x, self.weights[f"{prefix}.weight"], self.weights[f"{prefix}.bias"],
                           self.hparams["layer_norm_epsilon"])

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """softmax(q_h k_h^T / sqrt(W/H)) v_h per head, heads concatenated: [n, W]."""
        heads = self.hparams["heads"]
        n, width = q.shape
        dh = width // heads
        qh = q.reshape(n, heads, dh).transpose(1, 0, 2)
        kh = k.reshape(-1, heads, dh).transpose(1, 0, 2)
        vh = v.reshape(-1, heads, dh).transpose(1, 0, 2)
        scores = qh @ kh.transpose(0, 2, 1) * np.float32(1.0 / math.sqrt(dh))  # [H, n, M]
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        return (p @ vh).transpose(1, 0, 2).reshape(n, width)

    @property
    def layers(self) -> int:
        """k: the student layers fed side by side (1 for a version 1 file)."""
        return self.hparams.get("student_layers", 1)

    @property
    def states_width(self) -> int:
        """The width of a token's row of student states: k layers of student_dim."""
        return self.layers * self.hparams["student_dim"]

    def _fuse(self, states: np.ndarray) -> np.ndarray:
        """The normalised input of in_proj (the module docstring's fuse)."""
        if self.layers == 1:
            return self._norm(states, "in_norm")
        ds, eps = self.hparams["student_dim"], self.hparams["layer_norm_epsilon"]
        one = np.ones(ds, np.float32)
        zero = np.zeros(ds, np.float32)
        slices = [_layer_norm(states[:, i * ds:(i + 1) * ds], one, zero, eps) for i in range(self.layers)]
        if self.hparams["layer_fusion"] == "concat":
            return np.concatenate(slices, axis=1) * self.weights["in_norm.weight"] + self.weights["in_norm.bias"]
        logits = self.weights["layer_mix"].astype(np.float64)
        weights = np.exp(logits - logits.max())
        weights = (weights / weights.sum()).astype(np.float32)
        return self._norm(sum(w * part for w, part in zip(weights, slices)), "in_norm")

    def memory(self, states: np.ndarray) -> np.ndarray:
        """in_proj(fuse(states)) for student states [L, k*Ds] → [L, W] (no null row)."""
        states = np.asarray(states)
        if states.ndim != 2 or states.shape[1] != self.states_width:
            raise ValueError(f"states must be [L, {self.states_width}], got {list(states.shape)}")
        return self._linear(self._fuse(states.astype(np.float32, copy=False)), "in_proj")

    def memory_kv(self, memory: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Cross-attention keys and values of every block for memory rows [M, W].

        Rows are independent, so the evaluator projects many prompts' rows at once.
        """
        return [(self._linear(memory, f"blk.{i}.cross_attn.k"), self._linear(memory, f"blk.{i}.cross_attn.v"))
                for i in range(self.hparams["depth"])]

    def null_kv(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return self.memory_kv(self.weights["null_memory"])

    def run_queries(self, kv: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """The query path given each block's cross K/V (null row included) → standardized [Q, D]."""
        x = self.weights["query"]
        for i, (k, v) in enumerate(kv):
            p = f"blk.{i}."
            q = self._linear(self._norm(x, p + "cross_norm"), p + "cross_attn.q")
            x = x + self._linear(self._attend(q, k, v), p + "cross_attn.o")
            y = self._norm(x, p + "self_norm")
            a = self._attend(self._linear(y, p + "self_attn.q"), self._linear(y, p + "self_attn.k"),
                             self._linear(y, p + "self_attn.v"))
            x = x + self._linear(a, p + "self_attn.o")
            h = _gelu_tanh(self._linear(self._norm(x, p + "mlp_norm"), p + "mlp_up"))
            x = x + self._linear(h, p + "mlp_down")
        return self._linear(self._norm(x, "out_norm"), "out_proj")

    # -- public forward --

    def forward_standardized(self, states: np.ndarray) -> np.ndarray:
        """Student states [L, Ds] (L may be 0) → standardized prediction y [Q, D]."""
        m = np.concatenate([self.weights["null_memory"], self.memory(states)], axis=0)
        return self.run_queries(self.memory_kv(m))

    def forward(self, states: np.ndarray) -> np.ndarray:
        """Student states [L, Ds] (L may be 0) → prediction [Q, D] in teacher space."""
        return self.forward_standardized(states) * self.target_std + self.target_mean


def load_adapter_gguf(path: Path) -> GGUFAdapter:
    """Load and check an adapter GGUF (arch, version, tensor names and shapes)."""
    path = Path(path)
    metadata = fmt.read_gguf_metadata(path)
    hparams = fmt.hparams_from_metadata(metadata)
    raw = fmt.read_gguf_tensors(path)
    expected = {fmt.tensor_name(k): shape for k, shape in fmt.expected_tensor_shapes(hparams).items()}
    missing = sorted(set(expected) - set(raw))
    extra = sorted(set(raw) - set(expected))
    if missing or extra:
        raise ValueError(f"{path}: tensors missing {missing}, unexpected {extra}")
    weights: dict[str, np.ndarray] = {}
    for name, shape in expected.items():
        if raw[name].shape != shape:
            raise ValueError(f"{path}: tensor {name} has numpy shape {raw[name].shape}, expected {shape}")
        weights[name] = raw[name].astype(np.float32)
    return GGUFAdapter(path=path, hparams=hparams, metadata=metadata, weights=weights)


# --- evaluation -----------------------------------------------------------------------


def centred_cosine(pred_centred: np.ndarray, target_centred: np.ndarray) -> float:
    """Mean over rows of cos(a_r, b_r) along the last axis, each norm clamped at COSINE_EPS."""
    a = pred_centred.astype(np.float64)
    b = target_centred.astype(np.float64)
    dot = (a * b).sum(axis=-1)
    na = np.maximum(np.sqrt((a * a).sum(axis=-1)), COSINE_EPS)
    nb = np.maximum(np.sqrt((b * b).sum(axis=-1)), COSINE_EPS)
    return float((dot / (na * nb)).mean())


def _read_prompts(path: Path) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{line_no}: expected {{\"text\": <string>}}")
            texts.append(record["text"])
    return texts


def _score_shard(adapter: GGUFAdapter, shard: Path) -> list[tuple[int, str, float]]:
    """(index, text, centred cosine) for every prompt of one shard folder."""
    hp = adapter.hparams
    teacher = SafetensorsFile(shard / TEACHER_FILE)
    student = SafetensorsFile(shard / STUDENT_FILE)
    texts = _read_prompts(shard / PROMPTS_FILE)
    targets, t_dtype = teacher.raw(TARGETS_TENSOR), teacher.dtype(TARGETS_TENSOR)
    hidden, h_dtype = student.raw(HIDDEN_TENSOR), student.dtype(HIDDEN_TENSOR)
    offsets = student.get(OFFSETS_TENSOR).astype(np.int64)
    n = len(texts)
    if t_dtype not in ("F32", "F16", "BF16", "F64") or h_dtype not in ("F32", "F16", "BF16", "F64"):
        raise ValueError(f"{shard}: targets ({t_dtype}) and hidden ({h_dtype}) must be floating point")
    if targets.shape != (n, hp["query_rows"], hp["target_dim"]):
        raise ValueError(f"{shard}: targets shape {list(targets.shape)} != "
                         f"[{n} prompts, Q={hp['query_rows']}, D={hp['target_dim']}]")
    if hidden.ndim != 2 or hidden.shape[1] != adapter.states_width:
        raise ValueError(f"{shard}: hidden shape {list(hidden.shape)} != [tokens, {adapter.layers} layer(s) x "
                         f"Ds={hp['student_dim']}]: the shards' student layers differ from the adapter's")
    if offsets.shape != (n + 1,) or offsets[0] != 0 or offsets[-1] != hidden.shape[0] \
            or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{shard}: offsets must be [n+1] non-decreasing from 0 to {hidden.shape[0]}")
    if TOKEN_IDS_TENSOR in student and student.shape(TOKEN_IDS_TENSOR) != (hidden.shape[0],):
        raise ValueError(f"{shard}: token_ids shape {list(student.shape(TOKEN_IDS_TENSOR))} != [{hidden.shape[0]}]")

    null_kv = adapter.null_kv()
    mean, std = adapter.target_mean, adapter.target_std
    results: list[tuple[int, str, float]] = []
    start = 0
    while start < n:
        # A group of prompts whose student rows are projected together.
        end = start + 1
        while end < n and offsets[end + 1] - offsets[start] <= GROUP_TOKENS:
            end += 1
        base = int(offsets[start])
        rows = to_float32(hidden[base:int(offsets[end])], h_dtype)
        group_kv = adapter.memory_kv(adapter.memory(rows))
        for i in range(start, end):
            a, b = int(offsets[i]) - base, int(offsets[i + 1]) - base
            kv = [(np.concatenate([nk, k[a:b]]), np.concatenate([nv, v[a:b]]))
                  for (nk, nv), (k, v) in zip(null_kv, group_kv)]
            y = adapter.run_queries(kv)
            target = to_float32(targets[i], t_dtype)
            # pred - mean = y * std exactly; skip the add-then-subtract rounding.
            cos = centred_cosine(y * std, target - mean)
            if not math.isfinite(cos):
                raise ValueError(f"{shard}: prompt {i} ({texts[i][:60]!r}) scores {cos} (non-finite inputs?)")
            results.append((i, texts[i], cos))
        start = end
    return results


def evaluate_gguf(gguf_path: Path, shards: list[Path]) -> dict[str, Any]:
    """Val centred cosine of a GGUF adapter over shard folders (see the module docstring).

    Returns ``{val_centred_cosine, empty_prompt_cosine (None without empty prompts),
    per_shard: [{shard, n, val_centred_cosine}], worst: [{text, cosine, shard, index}]
    (the WORST_COUNT lowest), n_prompts, seconds, gguf}``.
    """
    began = time.perf_counter()
    adapter = load_adapter_gguf(Path(gguf_path))
    per_shard: list[dict[str, Any]] = []
    scored: list[tuple[float, str, str, int]] = []
    empty: list[float] = []
    for shard in shards:
        shard = Path(shard)
        results = _score_shard(adapter, shard)
        cosines = [c for _, _, c in results]
        per_shard.append({"shard": str(shard), "n": len(results),
                          "val_centred_cosine": float(np.mean(cosines)) if cosines else None})
        for index, text, cos in results:
            scored.append((cos, text, str(shard), index))
            if text == "":
                empty.append(cos)
    if not scored:
        raise ValueError(f"no prompts to evaluate in {[str(s) for s in shards]}")
    worst = sorted(scored, key=lambda r: r[0])[:WORST_COUNT]
    result = {
        "val_centred_cosine": float(np.mean([r[0] for r in scored])),
        "empty_prompt_cosine": float(np.mean(empty)) if empty else None,
        "per_shard": per_shard,
        "worst": [{"text": t, "cosine": c, "shard": s, "index": i} for c, t, s, i in worst],
        "n_prompts": len(scored),
        "seconds": time.perf_counter() - began,
        "gguf": str(gguf_path),
    }
    logger.info("evaluated %s on %d prompts: val centred cosine %.5f", gguf_path, len(scored),
                result["val_centred_cosine"])
    return result
