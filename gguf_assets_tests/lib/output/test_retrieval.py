"""Prompt retrieval (lib/output/gguf_eval.py's Retrieval, lib/training/verdict.py's bar): exact where every prompt's
rows fit, a count sketch that agrees with the exact figures where they do not, and a verdict that refuses an adapter
that ignores the prompt, whatever its cosine, while one trained on the same data passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_gguf_format import hparams, save_shard, write

from gguf_assets.lib.core import metrics as m
from gguf_assets.lib.output import gguf_eval
from gguf_assets.lib.output.snapshots import evaluate_snapshot
from gguf_assets.lib.training.adapter import Adapter, AdapterShape, adapter_loss
from gguf_assets.lib.training.verdict import GOOD, retrieval_bar, retrieval_passes, verdict


def retrieved(preds: np.ndarray, targets: np.ndarray, centre: np.ndarray, **kwargs) -> gguf_eval.Retrieval:
    retrieval = gguf_eval.Retrieval(centre, prompts=len(preds), **kwargs)
    for pred, target in zip(preds, targets):
        retrieval.add(pred, target)
    return retrieval


def figures(sims: np.ndarray) -> tuple[dict, np.ndarray]:
    """The retrieval figures and ranks of a full [pred, target] matrix of centred cosines."""
    own = np.diag(sims)
    ranks = (sims >= own[:, None]).sum(axis=1) - 1
    others = sims[~np.eye(len(sims), dtype=bool)].mean()
    return {m.VAL_RETRIEVAL_TOP1: float(np.mean(ranks == 0)), m.VAL_RETRIEVAL_TOP5: float(np.mean(ranks < 5)),
            m.VAL_RETRIEVAL_MARGIN: float(own.mean() - others), m.VAL_RETRIEVAL_PROMPTS: len(sims)}, ranks


def close_targets(rng: np.random.Generator, n: int, rows: int, dims: int, confusion: float):
    """Targets that differ along a few shared directions (so each has near neighbours), and predictions that mix
    those directions up by ``confusion``: the hard case for ranking, where top-1 is far from 0 and from 1."""
    centre = rng.normal(size=(rows, dims))
    basis = rng.normal(size=(6, rows * dims))
    coef = rng.normal(size=(n, 6))
    targets = centre + 0.3 * (coef @ basis).reshape(n, rows, dims) + 0.3 * rng.normal(size=(n, rows, dims))
    mixed = coef + confusion * rng.normal(size=coef.shape)
    preds = centre + 0.3 * (mixed @ basis).reshape(n, rows, dims) + 0.3 * rng.normal(size=(n, rows, dims))
    return preds.astype(np.float32), targets.astype(np.float32), centre.astype(np.float32)


def test_kept_whole_retrieval_is_every_pairs_centred_cosine() -> None:
    """Small enough to keep whole: the figures are those of every (prediction, target) pair scored by the
    evaluator's own centred cosine, one pair at a time."""
    preds, targets, centre = close_targets(np.random.default_rng(0), 40, 4, 6, confusion=0.8)
    retrieval = retrieved(preds, targets, centre)
    assert retrieval.exact
    sims = np.array([[gguf_eval.centred_cosine(p - centre, t - centre) for t in targets] for p in preds])
    want, ranks = figures(sims)
    got = retrieval.result()
    np.testing.assert_array_equal(retrieval.ranks(), ranks)
    assert got == pytest.approx(want, abs=1e-9)
    assert 0.2 < got[m.VAL_RETRIEVAL_TOP1] < 0.9  # neither trivial nor hopeless: the ranks are tested
    # The own cosines are the evaluator's score: the margin's first term is the centred cosine of these prompts.
    own = np.mean([gguf_eval.centred_cosine(p - centre, t - centre) for p, t in zip(preds, targets)])
    assert retrieval.own_sum / len(preds) == pytest.approx(own, abs=1e-12)


@pytest.mark.parametrize("confusion", [0.1, 0.3, 0.6])
def test_the_sketch_agrees_with_the_exact_figures(confusion: float) -> None:
    """At the seed's size the rows are sketched (gguf_eval's RETRIEVAL_SKETCH_DIMS comment); on close targets with
    predictions that confuse them, its top-1 and top-5 come within 0.02 of the exact ones and its margin is exact."""
    n, rows, dims = 250, 32, 256  # Q*D = 8,192 values a prompt, twice the sketch's
    preds, targets, centre = close_targets(np.random.default_rng(1), n, rows, dims, confusion)
    sketched = retrieved(preds, targets, centre, exact_values=0)
    assert not sketched.exact and sketched.preds[0].shape == (gguf_eval.RETRIEVAL_SKETCH_DIMS,)
    # Exact: the mean of row cosines is the dot product of the flattened unit rows, over Q.
    unit = [gguf_eval.unit_rows(x - centre).reshape(n, -1) for x in (preds, targets)]
    want, ranks = figures(unit[0] @ unit[1].T / rows)
    got = sketched.result()
    assert 0.1 < want[m.VAL_RETRIEVAL_TOP1] < 0.95
    for key in (m.VAL_RETRIEVAL_TOP1, m.VAL_RETRIEVAL_TOP5):
        assert abs(got[key] - want[key]) <= 0.02, (key, got[key], want[key])
    assert got[m.VAL_RETRIEVAL_MARGIN] == pytest.approx(want[m.VAL_RETRIEVAL_MARGIN], abs=1e-9)
    assert np.mean((sketched.ranks() == 0) == (ranks == 0)) >= 0.9  # prompt by prompt, mostly the same calls
    # The same seed every time: the same figures for the same outputs.
    assert retrieved(preds, targets, centre, exact_values=0).result() == got


def test_retrieval_needs_two_prompts_and_a_constant_output_retrieves_at_chance() -> None:
    rng = np.random.default_rng(2)
    centre = rng.normal(size=(3, 5)).astype(np.float32)
    targets = rng.normal(size=(20, 3, 5)).astype(np.float32)
    assert retrieved(targets[:1], targets[:1], centre).result() == {
        m.VAL_RETRIEVAL_TOP1: None, m.VAL_RETRIEVAL_TOP5: None, m.VAL_RETRIEVAL_MARGIN: None,
        m.VAL_RETRIEVAL_PROMPTS: 1}
    constant = np.repeat(targets[:1], 20, axis=0)  # every prompt gets the first prompt's target
    result = retrieved(constant, targets, centre).result()
    assert result[m.VAL_RETRIEVAL_TOP1] == 1 / 20 and result[m.VAL_RETRIEVAL_TOP5] == 5 / 20
    # Each target is the "other" of as many prompts as it is anyone's own: a constant output's margin is 0.
    assert result[m.VAL_RETRIEVAL_MARGIN] == pytest.approx(0.0, abs=1e-12)


def test_the_bar_is_a_majority_that_chance_rarely_reaches() -> None:
    """Half the prompts, or on a small val set the count chance reaches less than once in 1,000."""
    assert [retrieval_bar(n).hits for n in (1, 2, 4, 5, 6, 10, 12, 20, 1000)] == [None, None, None, 5, 5, 6, 6, 10,
                                                                                  500]
    assert retrieval_passes(0.5, 1000) and not retrieval_passes(0.499, 1000)
    assert retrieval_passes(0.6, 10) and not retrieval_passes(0.5, 10)
    assert not retrieval_passes(1.0, 4) and not retrieval_passes(None, 100)


def test_the_verdict_refuses_good_to_an_adapter_that_ignores_the_prompt_whatever_its_cosine() -> None:
    blind = {m.VAL_RETRIEVAL_TOP1: 0.01, m.VAL_RETRIEVAL_PROMPTS: 100}
    text, advice = verdict(0.97, retrieval=blind)
    assert text.startswith("Not there yet: val centred cosine 0.970 reaches 0.9, but prompt retrieval top-1 "
                           "0.010 is below 0.500 (chance 0.010)"), text
    assert "ignores the prompt" in advice and "pairs a prompt with its own teacher output" in advice
    # Above chance but below the bar: it reads the prompt, not enough.
    text, advice = verdict(0.97, retrieval={m.VAL_RETRIEVAL_TOP1: 0.3, m.VAL_RETRIEVAL_PROMPTS: 100})
    assert text.startswith("Not there yet") and advice.startswith("It reads the prompt, but not enough")
    text, advice = verdict(0.93, retrieval={m.VAL_RETRIEVAL_TOP1: 0.96, m.VAL_RETRIEVAL_PROMPTS: 100})
    assert text == ("Good: val centred cosine 0.930 (the reference trainer8 run reached 0.965) and prompt retrieval "
                    "top-1 0.960 (chance 0.010).")
    text, advice = verdict(0.93, retrieval={m.VAL_RETRIEVAL_TOP1: 1.0, m.VAL_RETRIEVAL_PROMPTS: 3})
    assert "needs at least 5 non-empty val prompts" in text and "corpus.val_prompts" in advice
    # Below the cosine's bar, the retrieval's shortfall is said too; unmeasured, the cosine decides alone.
    assert "And prompt retrieval top-1 0.010" in verdict(0.5, retrieval=blind)[0]
    assert verdict(0.93)[0].startswith("Good") and verdict(0.93, retrieval=None) == verdict(0.93)
    assert GOOD == 0.9


# --- trained on shuffled pairings -----------------------------------------------------

SHAPE = AdapterShape(student_dim=12, query_rows=8, target_dim=10, width=64, depth=1)
TOKENS = 3


def teacher_data(gen: torch.Generator, n: int, teacher: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Student states [n, L, Ds] and a teacher's targets [n, Q, D] that depend on them: a pattern shared by every
    prompt, its sign flipped (and scaled) for the prompts of one kind, and a part of each prompt's own."""
    states = torch.randn(n, TOKENS, SHAPE.student_dim, generator=gen)
    mean = states.mean(1)
    rare = mean[:, 0] > 1.28 / TOKENS ** 0.5  # about 1 in 10
    sign = torch.where(rare, torch.tensor(-9.0), torch.tensor(1.0))
    own = (mean @ teacher["mix"]).reshape(n, SHAPE.query_rows, SHAPE.target_dim) * 0.8
    return states, teacher["centre"] + sign[:, None, None] * teacher["shared"] + own


def train_adapter(states: torch.Tensor, targets: torch.Tensor, *, steps: int = 150) -> Adapter:
    """A tiny adapter trained with the product's loss, its statistics set as the trainer sets them."""
    torch.manual_seed(0)
    model = Adapter(SHAPE)
    model.target_centre.copy_(targets.mean(0))
    model.target_std.copy_(targets.reshape(-1, SHAPE.target_dim).std(0))
    model.loss_std.copy_(targets.std(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mask = torch.ones(64, TOKENS, dtype=torch.bool)
    order = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = torch.randint(0, len(states), (64,), generator=order)
        loss = adapter_loss(model.loss_space(model(states[batch], mask)), model.loss_targets(targets[batch]),
                            cosine_weight=0.5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_an_adapter_trained_on_shuffled_pairings_retrieves_at_chance_and_is_refused(tmp_path: Path) -> None:
    """The same data, paired or shuffled across prompts: both adapters exported to GGUF and scored by the
    evaluator. The one that learnt the pairing tells the val prompts apart and passes retrieval's bar; the shuffled
    one learnt only what all prompts share: retrieval at chance, refused whatever its cosine."""
    gen = torch.Generator().manual_seed(0)
    teacher = {"centre": torch.randn(SHAPE.query_rows, SHAPE.target_dim, generator=gen) * 2,
               "shared": torch.randn(SHAPE.query_rows, SHAPE.target_dim, generator=gen),
               "mix": torch.randn(SHAPE.student_dim, SHAPE.query_rows * SHAPE.target_dim, generator=gen)}
    train_states, train_targets = teacher_data(gen, 512, teacher)
    val_states, val_targets = teacher_data(gen, 100, teacher)
    val = tmp_path / "val"
    save_shard(val, texts=[f"prompt {i}" for i in range(99)] + [""], prompts=list(val_states), targets=val_targets)
    shuffled = train_targets[torch.randperm(len(train_targets), generator=gen)]
    scores = {}
    for name, targets in (("paired", train_targets), ("shuffled", shuffled)):
        model = train_adapter(train_states, targets)
        write(tmp_path / f"{name}.gguf", model, hparams=hparams(SHAPE))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / f"{name}.safetensors"))
        scores[name] = gguf_eval.evaluate_gguf(tmp_path / f"{name}.gguf", [val],
                                               model.target_centre.numpy().copy())
    paired, blind = scores["paired"], scores["shuffled"]
    # A snapshot's evaluation (`snapshot --eval`, the studio's) carries the same figures.
    snapshot = evaluate_snapshot(tmp_path / "shuffled.gguf", [val], tmp_path / "shuffled.safetensors")
    assert {key: snapshot[key] for key in m.RETRIEVAL_KEYS} == {key: blind[key] for key in m.RETRIEVAL_KEYS}
    assert paired[m.VAL_RETRIEVAL_PROMPTS] == blind[m.VAL_RETRIEVAL_PROMPTS] == 99  # the empty prompt is left out
    assert paired[m.VAL_RETRIEVAL_TOP1] >= 0.8 and paired[m.VAL_RETRIEVAL_MARGIN] > 0.5, paired
    assert blind[m.VAL_RETRIEVAL_TOP1] <= 3 / 99 and abs(blind[m.VAL_RETRIEVAL_MARGIN]) < 0.05, blind
    assert retrieval_passes(paired[m.VAL_RETRIEVAL_TOP1], 99) and not retrieval_passes(blind[m.VAL_RETRIEVAL_TOP1], 99)

    def said(scores: dict, cosine: float) -> str:
        return verdict(cosine, retrieval={key: scores[key] for key in m.RETRIEVAL_KEYS})[0]

    # At the paired adapter's own cosine, only the shuffled one is also held back by retrieval; above the cosine's
    # bar, retrieval alone decides.
    cosine = paired[m.VAL_CENTRED_COSINE]
    assert "retrieval" not in said(paired, cosine) and "prompt retrieval top-1 0.0" in said(blind, cosine)
    assert said(paired, GOOD + 0.05).startswith("Good")
    assert said(blind, GOOD + 0.05).startswith(f"Not there yet: val centred cosine {GOOD + 0.05:.3f} reaches 0.9, "
                                               "but prompt retrieval top-1 0.0")
