"""Tests for length-sorted batch packing under a token budget (gguf_assets.lib.precompute.batching)."""

from __future__ import annotations

import random

import pytest
import torch

from gguf_assets.lib.precompute.batching import (
    fixed_batches,
    pack_batches,
    padding_efficiency,
    right_padded,
)


def _check(lengths, batches, *, max_batch, token_budget=None, extra_tokens=0):
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths))), "every index exactly once"
    assert all(batches), "no empty batch"
    for b in batches:
        assert len(b) <= max_batch
        cost = len(b) * (max(lengths[i] for i in b) + extra_tokens)
        if token_budget is not None and cost > token_budget:
            assert len(b) == 1, f"over-budget batch {b} with more than one prompt"


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("max_batch, budget, extra", [(8, 8192, 256), (32, None, 0), (4, 1000, 0), (16, 3000, 77)])
def test_every_index_once_and_limits_hold(seed, max_batch, budget, extra):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 20), rng.randint(20, 400), rng.randint(400, 2000)]) for _ in range(300)]
    batches = pack_batches(lengths, max_batch=max_batch, token_budget=budget, extra_tokens=extra)
    _check(lengths, batches, max_batch=max_batch, token_budget=budget, extra_tokens=extra)


def test_over_long_prompt_gets_a_batch_of_its_own():
    lengths = [10, 5000, 12, 9, 11]
    batches = pack_batches(lengths, max_batch=8, token_budget=1000)
    assert [1] in batches
    _check(lengths, batches, max_batch=8, token_budget=1000)
    assert sum(len(b) for b in batches if 1 not in b) == 4


def test_extra_tokens_count_against_the_budget():
    lengths = [10] * 8
    assert pack_batches(lengths, max_batch=8, token_budget=80) == [list(range(8))]
    batches = pack_batches(lengths, max_batch=8, token_budget=80, extra_tokens=10)
    assert [len(b) for b in batches] == [4, 4]


def test_budget_exactly_met_is_allowed():
    batches = pack_batches([5, 5, 5, 5], max_batch=10, token_budget=20)
    assert batches == [[0, 1, 2, 3]]
    batches = pack_batches([5, 5, 5, 5], max_batch=10, token_budget=19)
    assert [len(b) for b in batches] == [3, 1]


def test_batches_are_longest_first_and_deterministic():
    lengths = [3, 9, 9, 1, 7, 3]
    batches = pack_batches(lengths, max_batch=2)
    assert batches == [[1, 2], [4, 0], [5, 3]]  # ties broken by index
    assert pack_batches(lengths, max_batch=2) == batches


def test_empty_input():
    assert pack_batches([], max_batch=4, token_budget=100) == []
    assert padding_efficiency([], []) == 1.0


def test_packing_beats_fixed_batches_on_skewed_lengths():
    rng = random.Random(0)
    lengths = [rng.choice([4, 6, 8]) if rng.random() < 0.8 else rng.randint(300, 600) for _ in range(512)]
    extra = 16
    packed = pack_batches(lengths, max_batch=16, token_budget=16 * (600 + extra), extra_tokens=extra)
    fixed = [list(range(i, min(i + 16, len(lengths)))) for i in range(0, len(lengths), 16)]
    eff_packed = padding_efficiency(lengths, packed, extra_tokens=extra)
    eff_fixed = padding_efficiency(lengths, fixed, extra_tokens=extra)
    assert eff_packed > eff_fixed + 0.3
    assert 0 < eff_fixed < eff_packed <= 1.0


def test_padding_efficiency_values():
    lengths = [10, 10, 5, 5]
    assert padding_efficiency(lengths, [[0, 1], [2, 3]]) == pytest.approx(1.0)
    assert padding_efficiency(lengths, [[0, 2], [1, 3]]) == pytest.approx(30 / 40)
    assert padding_efficiency(lengths, [[0, 2], [1, 3]], extra_tokens=10) == pytest.approx(70 / 80)


def test_fixed_batches_keep_the_original_order():
    assert fixed_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert fixed_batches(0, 3) == []


def test_right_padded_puts_tokens_then_extra_positions_then_padding():
    ids, mask = right_padded([[5, 6, 7], [], [8]], pad_id=0, extra_tokens=2)
    assert ids.tolist() == [[5, 6, 7, 0, 0], [0, 0, 0, 0, 0], [8, 0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long
    ids, mask = right_padded([[1, 2], [3]], pad_id=9)
    assert ids.tolist() == [[1, 2], [3, 9]] and mask.tolist() == [[1, 1], [1, 0]]
