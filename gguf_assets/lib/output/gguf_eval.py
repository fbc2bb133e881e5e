"""Score an exported adapter GGUF on precomputed shards, independently of the training code.

Everything here is numpy: a minimal safetensors reader, the adapter forward pass re-implemented from ggk's
math (docs/gguf_layout.md, llm_adapter.hpp), not from adapter.py's code, and the val centred cosine. It
deliberately imports neither torch nor adapter.py/train.py, so a bug shared by training and export cannot hide
here; the tests enforce that, and the ggk tests hold this forward to ggk's own `adapter_out.bin`.

The forward (per prompt, the student's final-norm states s [L, Ds]):

    kv  = in_proj(s)                                        [L, W]
    q   = query                                             [Q, W]
    per block: q += attn_self(LN_self(q), LN_self(q))
               q += attn_cross(LN_q(q), LN_kv(kv))
               q += mlp.2(gelu_erf(mlp.0(LN_mlp(q))))
    out = out_proj(LN_out(q))                               [Q, D] teacher space (standardization folded in)

attn: heads of 64, softmax(q k^T / 8) v, separate biased q/k/v/o; LayerNorm eps from the file.

Score: per prompt, mean over query rows of cos(pred - centre, target - centre) over D, the centre being each
row's train mean (the caller passes it: it is the training's, and never part of the file); the overall score is
the mean over prompts. Beside it, in the same raw target space: relative MSE, the cosine after a per-row RMSNorm,
the worst query row, the empty prompt's score, prompt retrieval (is each prompt's own target the nearest to its
prediction, of all val targets?) and (given the torch checkpoint's outputs) how closely the GGUF agrees with the
checkpoint; lib/core/metrics.py defines each.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gguf_assets.lib.core import metrics as m
from gguf_assets.lib.core.safetensors_io import SafetensorsFile, to_float32
from gguf_assets.lib.output import gguf_format as fmt
from gguf_assets.lib.project.layout import PROMPTS_FILE, STUDENT_FILE, TEACHER_FILE  # noqa: F401  (the shard layout)

logger = logging.getLogger(__name__)

TARGETS_TENSOR = "targets"
HIDDEN_TENSOR = "hidden"
OFFSETS_TENSOR = "offsets"
TOKEN_IDS_TENSOR = "token_ids"
CENTRE_TENSOR = "target_centre"  # in a checkpoint's weights (lib/training/adapter.py's buffer)

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


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 from Numerical Recipes' erfc approximation (fractional error < 1.2e-7 everywhere), so the
    exact GELU needs no scipy."""
    t = np.abs(x.astype(np.float64))
    z = 1.0 / (1.0 + 0.5 * t)
    erfc = z * np.exp(-t * t - 1.26551223 + z * (1.00002368 + z * (0.37409196 + z * (0.09678418 + z * (
        -0.18628806 + z * (0.27886807 + z * (-1.13520398 + z * (1.48851587 + z * (-0.82215223 + z * 0.17087277)))))))))
    return np.where(x >= 0, 1.0 - erfc, erfc - 1.0).astype(np.float32)


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return np.float32(0.5) * x * (np.float32(1.0) + _erf(x * np.float32(1.0 / math.sqrt(2.0))))


@dataclass(frozen=True)
class GGUFAdapter:
    """An adapter loaded from GGUF: hparams, metadata and float32 weights (by torch state-dict key, numpy
    orientation: a linear weight is [out, in])."""

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

    # -- building blocks --

    def _linear(self, x: np.ndarray, prefix: str) -> np.ndarray:
        return x @ self.weights[f"{prefix}.weight"].T + self.weights[f"{prefix}.bias"]

    def _norm(self, x: np.ndarray, prefix: str) -> np.ndarray:
        return _layer_norm(x, self.weights[f"{prefix}.weight"], self.weights[f"{prefix}.bias"],
                           self.hparams["layer_norm_epsilon"])

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """softmax(q_h k_h^T / sqrt(head_dim)) v_h per head, heads concatenated: [n, W]."""
        heads, dh = self.hparams["heads"], self.hparams["head_dim"]
        n, width = q.shape
        qh = q.reshape(n, heads, dh).transpose(1, 0, 2)
        kh = k.reshape(-1, heads, dh).transpose(1, 0, 2)
        vh = v.reshape(-1, heads, dh).transpose(1, 0, 2)
        scores = qh @ kh.transpose(0, 2, 1) * np.float32(1.0 / math.sqrt(dh))  # [H, n, M]
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        return (p @ vh).transpose(1, 0, 2).reshape(n, width)

    @property
    def states_width(self) -> int:
        """The width of a token's row of student states."""
        return self.hparams["in_dim"]

    def memory_kv(self, states: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Cross-attention keys and values of every block for student states [M, Ds].

        Rows are independent (in_proj and LN_kv act per row), so the evaluator projects many prompts' rows at once.
        """
        states = np.asarray(states)
        if states.ndim != 2 or states.shape[1] != self.states_width:
            raise ValueError(f"states must be [L, {self.states_width}], got {list(states.shape)}")
        kv = self._linear(states.astype(np.float32, copy=False), "in_proj")
        out = []
        for i in range(self.hparams["depth"]):
            normed = self._norm(kv, f"blocks.{i}.ln_kv")
            out.append((self._linear(normed, f"blocks.{i}.cross_attn.k"),
                        self._linear(normed, f"blocks.{i}.cross_attn.v")))
        return out

    def run_queries(self, kv: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """The query path given each block's cross K/V -> the conditioning [Q, D]."""
        q = self.weights["query"]
        for i, (k, v) in enumerate(kv):
            p = f"blocks.{i}."
            x = self._norm(q, p + "ln_self")
            a = self._attend(self._linear(x, p + "self_attn.q"), self._linear(x, p + "self_attn.k"),
                             self._linear(x, p + "self_attn.v"))
            q = q + self._linear(a, p + "self_attn.o")
            a = self._attend(self._linear(self._norm(q, p + "ln_q"), p + "cross_attn.q"), k, v)
            q = q + self._linear(a, p + "cross_attn.o")
            h = _gelu_erf(self._linear(self._norm(q, p + "ln_mlp"), p + "mlp.0"))
            q = q + self._linear(h, p + "mlp.2")
        return self._linear(self._norm(q, "ln_out"), "out_proj")

    # -- public forward --

    def forward(self, states: np.ndarray) -> np.ndarray:
        """Student final-norm states [L, Ds] -> the conditioning [Q, D] (what ggk's adapter_out.bin holds)."""
        return self.run_queries(self.memory_kv(states))


def load_adapter_gguf(path: Path) -> GGUFAdapter:
    """Load and check an adapter GGUF (arch, version, tensor names and shapes)."""
    path = Path(path)
    metadata = fmt.read_gguf_metadata(path)
    hparams = fmt.hparams_from_metadata(metadata)
    raw = fmt.read_gguf_tensors(path)
    expected = {fmt.tensor_name(k): (k, shape) for k, shape in fmt.expected_tensor_shapes(hparams).items()}
    missing = sorted(set(expected) - set(raw))
    extra = sorted(set(raw) - set(expected))
    if missing or extra:
        raise ValueError(f"{path}: tensors missing {missing}, unexpected {extra}")
    weights: dict[str, np.ndarray] = {}
    for name, (key, shape) in expected.items():
        if raw[name].shape != shape:
            raise ValueError(f"{path}: tensor {name} has numpy shape {raw[name].shape}, expected {shape}")
        weights[key] = raw[name].astype(np.float32)
    return GGUFAdapter(path=path, hparams=hparams, metadata=metadata, weights=weights)


# --- evaluation -----------------------------------------------------------------------


def training_centre(weights_file: Path) -> np.ndarray:
    """The rows' train mean [Q, D] (``target_centre``) from a checkpoint's weights file, read without torch."""
    weights = SafetensorsFile(Path(weights_file))
    return to_float32(weights.raw(CENTRE_TENSOR), weights.dtype(CENTRE_TENSOR))


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """cos(a_r, b_r) along the last axis, each norm clamped at COSINE_EPS (float64, one per row)."""
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    dot = (a * b).sum(axis=-1)
    na = np.maximum(np.sqrt((a * a).sum(axis=-1)), COSINE_EPS)
    nb = np.maximum(np.sqrt((b * b).sum(axis=-1)), COSINE_EPS)
    return dot / (na * nb)


def centred_cosine(pred_centred: np.ndarray, target_centred: np.ndarray) -> float:
    """Mean over rows of cos(a_r, b_r) along the last axis, each norm clamped at COSINE_EPS."""
    return float(row_cosines(pred_centred, target_centred).mean())


def rms_normed(x: np.ndarray, eps: float = m.RMS_EPS) -> np.ndarray:
    """Each row (last axis) divided by its RMS, sqrt(mean(x^2) + eps): an RMSNorm without a weight."""
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def rms_cosine(pred: np.ndarray, target: np.ndarray) -> float:
    """Mean over rows of the cosine after each row of ``pred`` and ``target`` is RMS-normalized (metrics.py)."""
    return float(row_cosines(rms_normed(pred), rms_normed(target)).mean())


def relative_mse(pred: np.ndarray, target: np.ndarray, centre: np.ndarray) -> float:
    """sum ||pred - target||^2 / sum ||target - centre||^2 over every value (0: perfect; the centre scores 1)."""
    return _squared(pred - target) / _squared(target - centre)


def worst_row(mean_row_cosines: np.ndarray) -> tuple[int, float]:
    """(index, value) of the lowest of the rows' mean centred cosines."""
    index = int(np.argmin(mean_row_cosines))
    return index, float(mean_row_cosines[index])


def _squared(x: np.ndarray) -> float:
    x = x.astype(np.float64)
    return float((x * x).sum())


class ScoreSums:
    """The scores over val prompts, one prompt at a time: the sums relative MSE, the RMS cosine and the rows'
    mean centred cosines are made of (lib/core/metrics.py)."""

    def __init__(self, centre: np.ndarray) -> None:
        self.centre = np.asarray(centre, dtype=np.float32)
        self.n = 0
        self.squared_error = 0.0
        self.squared_spread = 0.0
        self.rms_cosine = 0.0
        self.row_cosine = np.zeros(self.centre.shape[0], dtype=np.float64)

    def add(self, pred: np.ndarray, target: np.ndarray) -> float:
        """Count one prompt (``pred``, ``target`` [Q, D]); returns its centred cosine."""
        rows = row_cosines(pred - self.centre, target - self.centre)
        self.row_cosine += rows
        self.squared_error += _squared(pred - target)
        self.squared_spread += _squared(target - self.centre)
        self.rms_cosine += rms_cosine(pred, target)
        self.n += 1
        return float(rows.mean())

    def result(self) -> dict[str, Any]:
        if not self.n:
            return {m.VAL_REL_MSE: None, m.VAL_RMS_COSINE: None, m.WORST_ROW: None, m.WORST_ROW_COSINE: None}
        index, value = worst_row(self.row_cosine / self.n)
        return {m.VAL_REL_MSE: self.squared_error / max(self.squared_spread, COSINE_EPS),
                m.VAL_RMS_COSINE: self.rms_cosine / self.n, m.WORST_ROW: index, m.WORST_ROW_COSINE: value}


# Prompt retrieval needs every val prompt's prediction against every val target, but the evaluation streams: at the
# seed's size a prompt's [Q, D] = [256, 4096] is 4 MiB in f32, so 1,000 prompts' predictions and targets would be
# 8 GiB. The score is a mean of row cosines, sim(i, j) = <u_i, v_j> / Q, where u_i (v_j) is the prediction (target)
# less the centre with each row scaled to unit length, flattened. Where all the u and v fit in
# RETRIEVAL_EXACT_VALUES (the demo's 200 x 256 x 64 do), they are kept whole and retrieval is exact. Otherwise each
# prompt keeps a count sketch of u_i and of v_i (Charikar et al. 2002; Weinberger et al. 2009): coordinate c is
# added, with a random sign s(c), into bucket h(c) of RETRIEVAL_SKETCH_DIMS, the same seeded (h, s) for every
# prompt. <sketch(u), sketch(v)> estimates <u, v> without bias, with a standard deviation of
# sqrt((|u|^2 |v|^2 + <u, v>^2) / dims), here sqrt((1 + sim^2) / dims) <= 0.022 on a sim; what ranks two targets
# is sim(i, i) - sim(i, j), whose error shrinks with |v_i - v_j|, so near targets are told apart more finely than
# that. On close, low-rank targets (gguf_assets_tests/lib/output/test_retrieval.py) top-1 and top-5 come within
# 0.02 of the exact figures. 4,096 f32 buckets are 16 KiB a side: 1,000 prompts keep 32 MiB, and a prompt costs one
# bincount over its Q*D values, against its forward's O(L*Q*W). The margin needs no sketch: the sums of the u_i and
# of the v_j give every pair's mean exactly (Retrieval.result). A random projection would do the same at a cost of
# Q*D*dims a prompt, and its matrix would not fit at the seed's size.
RETRIEVAL_SKETCH_DIMS = 4096
RETRIEVAL_EXACT_VALUES = 1 << 23  # prompts x Q x D kept whole (32 MiB a side in f32)
RETRIEVAL_SEED = 20240613  # fixed: the same GGUF and shards give the same figures on every run
RETRIEVAL_BLOCK = 1024  # prompts' sims ranked at once: bounds the [block, N] matrix


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Each row (last axis) over its norm, the norm clamped at COSINE_EPS as row_cosines does (float64)."""
    x = x.astype(np.float64)
    return x / np.maximum(np.sqrt((x * x).sum(axis=-1, keepdims=True)), COSINE_EPS)


class Retrieval:
    """Prompt retrieval over the non-empty val prompts (lib/core/metrics.py): each prompt's prediction against every
    val target, by centred cosine, kept one prompt at a time as a sketch (the comment above)."""

    def __init__(self, centre: np.ndarray, *, prompts: int, dims: int | None = None,
                 exact_values: int | None = None) -> None:
        """``prompts``: how many will be added, kept whole where they fit ``exact_values``, else sketched in
        ``dims`` (None: RETRIEVAL_EXACT_VALUES and RETRIEVAL_SKETCH_DIMS)."""
        dims = RETRIEVAL_SKETCH_DIMS if dims is None else dims
        exact_values = RETRIEVAL_EXACT_VALUES if exact_values is None else exact_values
        self.centre = np.asarray(centre, dtype=np.float32)
        rows, size = self.centre.shape[0], self.centre.size
        self.rows = rows
        self.exact = size <= dims or prompts * size <= exact_values
        if not self.exact:
            rng = np.random.default_rng(RETRIEVAL_SEED)
            self.buckets = rng.integers(0, dims, size=size, dtype=np.intp)
            self.signs = rng.choice(np.array([-1.0, 1.0]), size=size)
        self.dims = size if self.exact else dims
        self.preds: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []
        self.pred_sum = np.zeros(self.centre.shape, dtype=np.float64)
        self.target_sum = np.zeros(self.centre.shape, dtype=np.float64)
        self.own_sum = 0.0

    def _compact(self, unit: np.ndarray) -> np.ndarray:
        flat = unit.reshape(-1)
        if self.exact:
            return flat.astype(np.float32)
        return np.bincount(self.buckets, weights=flat * self.signs, minlength=self.dims).astype(np.float32)

    def add(self, pred: np.ndarray, target: np.ndarray) -> None:
        """Count one non-empty prompt (``pred``, ``target`` [Q, D], raw target space)."""
        u, v = unit_rows(pred - self.centre), unit_rows(target - self.centre)
        self.pred_sum += u
        self.target_sum += v
        self.own_sum += float((u * v).sum()) / self.rows
        self.preds.append(self._compact(u))
        self.targets.append(self._compact(v))

    def ranks(self) -> np.ndarray:
        """Per prompt, how many other prompts' targets are at least as near its prediction as its own (0: its own
        is the nearest)."""
        preds, targets = np.stack(self.preds), np.stack(self.targets).T.astype(np.float64)
        out = []
        for start in range(0, len(preds), RETRIEVAL_BLOCK):
            sims = preds[start:start + RETRIEVAL_BLOCK].astype(np.float64) @ targets
            own = sims[np.arange(len(sims)), np.arange(start, start + len(sims))]
            out.append((sims >= own[:, None]).sum(axis=1) - 1)  # less its own
        return np.concatenate(out)

    def result(self) -> dict[str, float | int | None]:
        n = len(self.preds)
        if n < 2:  # nothing to retrieve from
            return {m.VAL_RETRIEVAL_TOP1: None, m.VAL_RETRIEVAL_TOP5: None, m.VAL_RETRIEVAL_MARGIN: None,
                    m.VAL_RETRIEVAL_PROMPTS: n}
        ranks = self.ranks()
        # Every pair's sim summed is <sum u, sum v> / Q; less the own pairs, over the n(n-1) others.
        others = (float((self.pred_sum * self.target_sum).sum()) / self.rows - self.own_sum) / (n * (n - 1))
        return {m.VAL_RETRIEVAL_TOP1: float(np.mean(ranks == 0)),
                m.VAL_RETRIEVAL_TOP5: float(np.mean(ranks < m.RETRIEVAL_TOP)),
                m.VAL_RETRIEVAL_MARGIN: self.own_sum / n - others, m.VAL_RETRIEVAL_PROMPTS: n}


class Agreement:
    """The GGUF's outputs against the torch checkpoint's on the same inputs, one prompt at a time: per row the cosine
    of the two less the centre, and the largest absolute difference (alone, and over the RMS of the checkpoint's
    centred outputs)."""

    def __init__(self, centre: np.ndarray) -> None:
        self.centre = np.asarray(centre, dtype=np.float32)
        self.min_row, self.row_sum, self.rows = math.inf, 0.0, 0
        self.max_abs, self.squared, self.values = 0.0, 0.0, 0

    def add(self, gguf: np.ndarray, checkpoint: np.ndarray) -> None:
        if gguf.shape != checkpoint.shape:
            raise ValueError(f"the checkpoint's output has shape {list(checkpoint.shape)}, the GGUF's "
                             f"{list(gguf.shape)}")
        rows = row_cosines(gguf - self.centre, checkpoint - self.centre)
        self.min_row = min(self.min_row, float(rows.min()))
        self.row_sum += float(rows.sum())
        self.rows += rows.size
        self.max_abs = max(self.max_abs, float(np.abs(gguf.astype(np.float64) - checkpoint).max()))
        self.squared += _squared(checkpoint - self.centre)
        self.values += checkpoint.size

    def result(self) -> dict[str, float] | None:
        if not self.rows:
            return None
        scale = math.sqrt(self.squared / self.values)
        return {m.MIN_ROW_COSINE: self.min_row, m.MEAN_ROW_COSINE: self.row_sum / self.rows,
                m.MAX_ABS_DIFF: self.max_abs, m.MAX_ABS_DIFF_RELATIVE: self.max_abs / max(scale, COSINE_EPS)}


# The torch checkpoint's outputs for a val shard folder, prompt by prompt in the shard's order, [Q, D] each in the
# raw target space (lib/output/checkpoint_outputs.py makes them; this module never imports torch).
CheckpointOutputs = Callable[[Path], Iterable[np.ndarray]]


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


def _score_shard(adapter: GGUFAdapter, shard: Path, centre: np.ndarray, *, sums: ScoreSums | None = None,
                 checkpoint: Iterator[np.ndarray] | None = None, agreement: Agreement | None = None,
                 retrieval: Retrieval | None = None) -> list[tuple[int, str, float]]:
    """(index, text, centred cosine) for every prompt of one shard folder; each prompt is also counted in ``sums``
    (and, unless empty, in ``retrieval``), and compared with the ``checkpoint``'s output for it in ``agreement``."""
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
    if targets.shape != (n, hp["query_count"], hp["out_dim"]):
        raise ValueError(f"{shard}: targets shape {list(targets.shape)} != "
                         f"[{n} prompts, Q={hp['query_count']}, D={hp['out_dim']}]")
    if centre.shape != (hp["query_count"], hp["out_dim"]):
        raise ValueError(f"the centre has shape {list(centre.shape)}, expected [{hp['query_count']}, {hp['out_dim']}]")
    if hidden.ndim != 2 or hidden.shape[1] != adapter.states_width:
        raise ValueError(f"{shard}: hidden shape {list(hidden.shape)} != [tokens, Ds={hp['in_dim']}]: the shards' "
                         "student differs from the adapter's")
    if offsets.shape != (n + 1,) or offsets[0] != 0 or offsets[-1] != hidden.shape[0] \
            or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{shard}: offsets must be [n+1] non-decreasing from 0 to {hidden.shape[0]}")
    if TOKEN_IDS_TENSOR in student and student.shape(TOKEN_IDS_TENSOR) != (hidden.shape[0],):
        raise ValueError(f"{shard}: token_ids shape {list(student.shape(TOKEN_IDS_TENSOR))} != [{hidden.shape[0]}]")

    results: list[tuple[int, str, float]] = []
    start = 0
    while start < n:
        # A group of prompts whose student rows are projected together.
        end = start + 1
        while end < n and offsets[end + 1] - offsets[start] <= GROUP_TOKENS:
            end += 1
        base = int(offsets[start])
        group_kv = adapter.memory_kv(to_float32(hidden[base:int(offsets[end])], h_dtype))
        for i in range(start, end):
            a, b = int(offsets[i]) - base, int(offsets[i + 1]) - base
            pred = adapter.run_queries([(k[a:b], v[a:b]) for k, v in group_kv])
            target = to_float32(targets[i], t_dtype)
            cos = sums.add(pred, target) if sums is not None else centred_cosine(pred - centre, target - centre)
            if retrieval is not None and texts[i] != "":  # the empty prompts are one prompt, the CFG's
                retrieval.add(pred, target)
            if checkpoint is not None and agreement is not None:
                theirs = next(checkpoint, None)
                if theirs is None:
                    raise ValueError(f"{shard}: the checkpoint's outputs end before prompt {i}")
                agreement.add(pred, np.asarray(theirs, dtype=np.float32))
            if not math.isfinite(cos):
                raise ValueError(f"{shard}: prompt {i} ({texts[i][:60]!r}) scores {cos} (non-finite inputs?)")
            results.append((i, texts[i], cos))
        start = end
    return results


def evaluate_gguf(gguf_path: Path, shards: list[Path], centre: np.ndarray, *,
                  checkpoint: CheckpointOutputs | None = None) -> dict[str, Any]:
    """Val centred cosine of a GGUF adapter over shard folders (see the module docstring), and the other scores;
    ``centre`` [Q, D] is the rows' train mean the scores are centred on (``training_centre`` reads it from the
    checkpoint). ``checkpoint(shard)``: the torch checkpoint's outputs for that shard's prompts, in order, which the
    GGUF's are compared with.

    Returns ``{val_centred_cosine, empty_prompt_cosine (None without empty prompts), val_rel_mse, val_rms_cosine,
    worst_row, worst_row_cosine, val_retrieval_top1, val_retrieval_top5, val_retrieval_margin (None with fewer
    than 2 non-empty prompts), val_retrieval_prompts, gguf_vs_checkpoint (None without ``checkpoint``),
    per_shard: [{shard, n, val_centred_cosine}], worst: [{text, cosine, shard, index}] (the WORST_COUNT lowest
    prompts), n_prompts, seconds, gguf}`` (keys: lib/core/metrics.py).
    """
    began = time.perf_counter()
    adapter = load_adapter_gguf(Path(gguf_path))
    centre = np.asarray(centre, dtype=np.float32)
    sums, agreement = ScoreSums(centre), Agreement(centre)
    non_empty = sum(1 for shard in shards for text in _read_prompts(Path(shard) / PROMPTS_FILE) if text != "")
    retrieval = Retrieval(centre, prompts=non_empty)
    per_shard: list[dict[str, Any]] = []
    scored: list[tuple[float, str, str, int]] = []
    empty: list[float] = []
    for shard in shards:
        shard = Path(shard)
        theirs = iter(checkpoint(shard)) if checkpoint is not None else None
        results = _score_shard(adapter, shard, centre, sums=sums, checkpoint=theirs, agreement=agreement,
                               retrieval=retrieval)
        if theirs is not None and next(theirs, None) is not None:
            raise ValueError(f"{shard}: the checkpoint gave more outputs than the shard has prompts")
        cosines = [c for _, _, c in results]
        per_shard.append({"shard": str(shard), "n": len(results),
                          m.VAL_CENTRED_COSINE: float(np.mean(cosines)) if cosines else None})
        for index, text, cos in results:
            scored.append((cos, text, str(shard), index))
            if text == "":
                empty.append(cos)
    if not scored:
        raise ValueError(f"no prompts to evaluate in {[str(s) for s in shards]}")
    worst = sorted(scored, key=lambda r: r[0])[:WORST_COUNT]
    result = {
        m.VAL_CENTRED_COSINE: float(np.mean([r[0] for r in scored])),
        m.EMPTY_PROMPT_COSINE: float(np.mean(empty)) if empty else None,
        **sums.result(),
        **retrieval.result(),
        m.GGUF_VS_CHECKPOINT: agreement.result() if checkpoint is not None else None,
        "per_shard": per_shard,
        "worst": [{"text": t, "cosine": c, "shard": s, "index": i} for c, t, s, i in worst],
        "n_prompts": len(scored),
        "seconds": time.perf_counter() - began,
        "gguf": str(gguf_path),
    }
    top1 = result[m.VAL_RETRIEVAL_TOP1]  # None with under two non-empty val prompts
    logger.info("evaluated %s on %d prompts: val centred cosine %.5f, relative MSE %.5f, prompt retrieval top-1 %s",
                gguf_path, len(scored), result[m.VAL_CENTRED_COSINE], result[m.VAL_REL_MSE],
                "not measured" if top1 is None else f"{top1:.3f}")
    return result
