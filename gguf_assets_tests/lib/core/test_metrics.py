"""The scores beside val centred cosine (lib/core/metrics.py), each against a hand computation on small arrays, in
both implementations: the GGUF evaluator's numpy (lib/output/gguf_eval.py) and the trainer's torch
(lib/training/val_scores.py); and that every place that stores them uses the names metrics.py gives."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from gguf_assets.lib.core import metrics
from gguf_assets.lib.output import gguf_eval
from gguf_assets.lib.project.manifests import Report
from gguf_assets.lib.training.events import Validation
from gguf_assets.lib.training.val_scores import ValScores

RNG = np.random.default_rng(7)
CENTRE = RNG.standard_normal((3, 4)).astype(np.float32)  # Q=3 rows of D=4
TARGETS = (CENTRE + RNG.standard_normal((5, 3, 4))).astype(np.float32)  # 5 prompts


def numpy_scores(preds: np.ndarray, targets: np.ndarray = TARGETS) -> dict:
    sums = gguf_eval.ScoreSums(CENTRE)
    for pred, target in zip(preds, targets):
        sums.add(pred, target)
    return sums.result()


def torch_scores(preds: np.ndarray, targets: np.ndarray = TARGETS) -> dict:
    scores = ValScores(torch.from_numpy(CENTRE))
    scores.add(torch.from_numpy(preds[:2]), torch.from_numpy(targets[:2]))  # two batches, as evaluate() adds them
    scores.add(torch.from_numpy(preds[2:]), torch.from_numpy(targets[2:]))
    return scores.result()


@pytest.mark.parametrize("scores", [numpy_scores, torch_scores])
def test_relative_mse_is_0_for_the_target_and_1_for_the_centre(scores):
    assert scores(TARGETS)[metrics.VAL_REL_MSE] == pytest.approx(0.0, abs=1e-12)
    assert scores(np.broadcast_to(CENTRE, TARGETS.shape).copy())[metrics.VAL_REL_MSE] == pytest.approx(1.0, rel=1e-6)
    # By hand: one value off by 2 in all 5 prompts, over the targets' squared distance to the centre.
    off = TARGETS.copy()
    off[:, 1, 2] += 2.0
    want = 5 * 4.0 / float(((TARGETS.astype(np.float64) - CENTRE) ** 2).sum())
    assert scores(off)[metrics.VAL_REL_MSE] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("scores", [numpy_scores, torch_scores])
def test_the_cosine_after_rmsnorm_ignores_each_rows_scale_and_counts_the_centre(scores):
    rng = np.random.default_rng(1)
    scale = rng.uniform(0.1, 10.0, size=(5, 3, 1)).astype(np.float32)
    noisy = (TARGETS + 0.3 * rng.standard_normal(TARGETS.shape)).astype(np.float32)
    assert scores(noisy * scale)[metrics.VAL_RMS_COSINE] == pytest.approx(scores(noisy)[metrics.VAL_RMS_COSINE],
                                                                          abs=1e-6)
    assert scores(TARGETS * scale)[metrics.VAL_RMS_COSINE] == pytest.approx(1.0, abs=1e-6)
    # Relative MSE does count the scale.
    assert scores(TARGETS * scale)[metrics.VAL_REL_MSE] > 0.1
    # By hand, one row: pred (1, 0), target (1, 1): cos 1/sqrt(2) whatever their RMS.
    assert gguf_eval.rms_cosine(np.array([[3.0, 0.0]]), np.array([[0.5, 0.5]])) == pytest.approx(1 / math.sqrt(2))
    # Uncentred: predicting the centre scores the cosine of the centre with the targets, not 0.
    centre_pred = np.broadcast_to(CENTRE, TARGETS.shape).copy()
    plain = (CENTRE * TARGETS).sum(-1) / np.linalg.norm(CENTRE, axis=-1) / np.linalg.norm(TARGETS, axis=-1)
    assert scores(centre_pred)[metrics.VAL_RMS_COSINE] == pytest.approx(plain.mean(), abs=1e-6)


@pytest.mark.parametrize("scores", [numpy_scores, torch_scores])
def test_the_worst_row_is_the_one_corrupted(scores):
    noisy = (TARGETS + 0.1 * np.random.default_rng(2).standard_normal(TARGETS.shape)).astype(np.float32)
    corrupted = noisy.copy()
    corrupted[:, 2] = 2 * CENTRE[2] - TARGETS[:, 2]  # row 2 points away from its target around the centre
    result = scores(corrupted)
    assert result[metrics.WORST_ROW] == 2 and isinstance(result[metrics.WORST_ROW], int)
    assert result[metrics.WORST_ROW_COSINE] == pytest.approx(-1.0, abs=1e-6)
    assert scores(TARGETS)[metrics.WORST_ROW_COSINE] == pytest.approx(1.0, abs=1e-6)


def test_numpy_and_torch_give_the_same_scores_and_prompt_cosines():
    preds = (TARGETS + np.random.default_rng(3).standard_normal(TARGETS.shape)).astype(np.float32)
    a, b = numpy_scores(preds), torch_scores(preds)
    assert a.keys() == b.keys() == {metrics.VAL_REL_MSE, metrics.VAL_RMS_COSINE, metrics.WORST_ROW,
                                    metrics.WORST_ROW_COSINE}
    for key in a:
        assert a[key] == pytest.approx(b[key], abs=1e-5), key
    sums, scores = gguf_eval.ScoreSums(CENTRE), ValScores(torch.from_numpy(CENTRE))
    per_prompt = scores.add(torch.from_numpy(preds), torch.from_numpy(TARGETS))
    want = [gguf_eval.centred_cosine(p - CENTRE, t - CENTRE) for p, t in zip(preds, TARGETS)]
    assert [sums.add(p, t) for p, t in zip(preds, TARGETS)] == pytest.approx(want, abs=1e-12)
    assert per_prompt.tolist() == pytest.approx(want, abs=1e-5)


def test_agreement_of_two_outputs_by_hand():
    agreement = gguf_eval.Agreement(CENTRE)
    for t in TARGETS:
        agreement.add(t, t.copy())
    assert agreement.result() == {metrics.MIN_ROW_COSINE: pytest.approx(1.0), metrics.MEAN_ROW_COSINE:
                                  pytest.approx(1.0), metrics.MAX_ABS_DIFF: 0.0, metrics.MAX_ABS_DIFF_RELATIVE: 0.0}
    agreement = gguf_eval.Agreement(CENTRE)
    gguf = TARGETS.copy()
    gguf[3, 0, 1] += 0.5
    gguf[4, 1] = 2 * CENTRE[1] - TARGETS[4, 1]  # one row opposite, around the centre
    for g, t in zip(gguf, TARGETS):
        agreement.add(g, t)
    result = agreement.result()
    spread = math.sqrt(float(((TARGETS.astype(np.float64) - CENTRE) ** 2).mean()))
    largest = max(0.5, float(np.abs(gguf[4, 1] - TARGETS[4, 1]).max()))
    assert result[metrics.MIN_ROW_COSINE] == pytest.approx(-1.0)
    assert -1.0 < result[metrics.MEAN_ROW_COSINE] < 1.0
    assert result[metrics.MAX_ABS_DIFF] == pytest.approx(largest, rel=1e-6)
    assert result[metrics.MAX_ABS_DIFF_RELATIVE] == pytest.approx(largest / spread, rel=1e-6)
    assert gguf_eval.Agreement(CENTRE).result() is None
    with pytest.raises(ValueError, match="shape"):
        agreement.add(TARGETS[0], TARGETS[0][:2])


def test_the_stores_of_the_scores_use_the_names_metrics_gives():
    """A training run's history (Validation.figures), report.json (Report) and train.evaluate's keys are one set of
    names: a renamed field here would silently drop a score."""
    figures = Validation.of(7, {metrics.VAL_CENTRED_COSINE: 0.5, metrics.EMPTY_PROMPT_COSINE: 0.4,
                                metrics.VAL_LOSS: 1.2, metrics.VAL_REL_MSE: 0.3, metrics.VAL_RMS_COSINE: 0.9,
                                metrics.WORST_ROW: 2, metrics.WORST_ROW_COSINE: 0.1, "n": 30}).figures()
    assert figures == {"step": 7, metrics.VAL_CENTRED_COSINE: 0.5, metrics.EMPTY_PROMPT_COSINE: 0.4,
                       metrics.VAL_LOSS: 1.2, metrics.VAL_REL_MSE: 0.3, metrics.VAL_RMS_COSINE: 0.9,
                       metrics.WORST_ROW: 2, metrics.WORST_ROW_COSINE: 0.1}
    # A validation from before the newer scores: they are None, not missing.
    old = Validation.of(3, {metrics.VAL_CENTRED_COSINE: 0.5, metrics.EMPTY_PROMPT_COSINE: None,
                            metrics.VAL_LOSS: 1.0}).figures()
    assert old[metrics.VAL_REL_MSE] is None and old[metrics.WORST_ROW] is None
    fields = {f.name for f in dataclasses.fields(Report)}
    assert {s.key for s in metrics.COMPARED} | {metrics.WORST_ROW, metrics.GGUF_VS_CHECKPOINT} <= fields
