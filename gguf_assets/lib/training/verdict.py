"""How to read val centred cosine and prompt retrieval: the verdict and advice shown after training and in the report.

The advice reads the validation curve when there is one: a score still rising at the end of training
is limited by the steps, and more steps help before a wider adapter does (at width 64, 400 steps gave
0.88 and 1,000 steps 0.909); only a flat curve points at the adapter's size.

"Good" needs val centred cosine >= GOOD and, where the GGUF was evaluated, prompt retrieval well above chance
(``retrieval_passes``): centred cosine counts what all prompts' targets share, so an adapter that ignores the prompt
can score high on it, while its retrieval stays at chance. The training's own verdict (torch, which does not measure
retrieval) reads the cosine alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gguf_assets.lib.core.metrics import (
    VAL_CENTRED_COSINE,
    VAL_RETRIEVAL_PROMPTS,
    VAL_RETRIEVAL_TOP1,
    retrieval_chance,
)
from gguf_assets.lib.project.presets import CPU_START

GOOD = 0.9
GOOD_VERDICT = "Good"  # how a verdict that passes starts (the studio colours the result by it)
REFERENCE = 0.965  # the seed's RTX 5090 run with the trainer8 recipe
# Still rising: at least this much gained over the last quarter of training.
RISING = 0.005

# Prompt retrieval's bar. An adapter that ignores the prompt finds its own target first for 1 val prompt in N by
# chance: its hits are about Binomial(N, 1/N), one on average, whatever N. "Good" needs both:
# - top-1 >= LISTENS_TOP1: most val prompts find their own target first, a bar that does not fall as N grows
#   (at 1,000 prompts, 10x chance would be 1%, far from an adapter that reads the prompt);
# - hits that chance gives less than once in 1/CHANCE_P (a one-sided binomial test), which is what binds on a small
#   val set: 10 prompts need 6 hits, not 5, and 5 prompts need all 5; under 5 prompts nothing can show it.
LISTENS_TOP1 = 0.5
CHANCE_P = 1e-3


@dataclass(frozen=True)
class RetrievalBar:
    """What prompt retrieval must reach among ``prompts`` non-empty val prompts: ``hits`` prompts whose own target
    is the nearest (None: too few prompts for any count to show it)."""

    prompts: int
    hits: int | None

    @property
    def top1(self) -> float | None:
        return None if self.hits is None else self.hits / self.prompts


def _chance_tail(hits: int, prompts: int) -> float:
    """P(X >= hits) for X ~ Binomial(prompts, 1/prompts): chance's top-1 hits."""
    p = 1.0 / prompts
    pmf, below = (1.0 - p) ** prompts, 0.0
    for k in range(hits):
        below += pmf
        pmf *= (prompts - k) / (k + 1) * p / (1.0 - p)
    return max(0.0, 1.0 - below)


def retrieval_bar(prompts: int) -> RetrievalBar:
    if prompts < 2:
        return RetrievalBar(prompts, None)
    significant = next((h for h in range(1, prompts + 1) if _chance_tail(h, prompts) <= CHANCE_P), None)
    if significant is None:
        return RetrievalBar(prompts, None)
    return RetrievalBar(prompts, max(significant, math.ceil(LISTENS_TOP1 * prompts)))


# The fewest non-empty val prompts on which retrieval can show anything (5).
FEWEST_PROMPTS = next(n for n in range(2, 100) if retrieval_bar(n).hits is not None)


def retrieval_passes(top1: float | None, prompts: int) -> bool:
    bar = retrieval_bar(prompts)
    # round(): top-1 is a share of whole prompts
    return bar.hits is not None and top1 is not None and round(top1 * prompts) >= bar.hits


def validation_curve(history: list[dict]) -> list[tuple[int, float]]:
    """(step, val centred cosine) of the training history's validations, in step order."""
    return sorted((int(h["step"]), float(h[VAL_CENTRED_COSINE])) for h in history or ()
                  if VAL_CENTRED_COSINE in h and "step" in h)


# Offered below GOOD to a run that did not start there (#68, docs/recipe.md "ggk's format: where the quality goes"):
# the same cost, measured only on 64- to 128-wide CPU runs, so it is advice, not trainer8's default.
START_ADVICE = (" At the same cost, the query rows' start may gain more: "
                + ", ".join(f"training.{key}: {value:g}" if isinstance(value, float) else f"training.{key}: {value}"
                            for key, value in CPU_START.items())
                + " (the CPU scale preset's; +0.03 to +0.10 val centred cosine on 64- to 128-wide runs, not measured "
                "at the seed's 1024 x 6).")


def training_start(training) -> dict:
    """The keys of a run's start (CPU_START's), from its training settings."""
    return {key: getattr(training, key) for key in CPU_START}


def verdict(val_centred_cosine: float, curve: list[tuple[int, float]] | None = None, *,
            width: int | None = None, steps: int | None = None, retrieval: dict | None = None,
            start: dict | None = None) -> tuple[str, str]:
    """(one-line verdict, advice). ``curve``: the validations (validation_curve), ``width`` and ``steps`` the
    training settings the adapter was trained with; without them the advice is the general one. ``retrieval``: the
    GGUF evaluation's prompt retrieval (val_retrieval_top1 and val_retrieval_prompts); None where it was not
    measured, and the verdict reads the cosine alone. ``start``: the run's ``training_start``; below GOOD, a run
    that did not start at CPU_START is told of it."""
    text, advice = _verdict(val_centred_cosine, curve, width=width, steps=steps, retrieval=retrieval)
    # Not to an adapter that ignores the prompt: its pairs are what to check, not its start.
    if val_centred_cosine < GOOD and start is not None and start != CPU_START and not _at_chance(retrieval):
        advice += START_ADVICE
    return text, advice


def _verdict(val_centred_cosine: float, curve: list[tuple[int, float]] | None, *, width: int | None,
             steps: int | None, retrieval: dict | None) -> tuple[str, str]:
    shortfall = None if retrieval is None else _retrieval_shortfall(retrieval)
    if val_centred_cosine >= GOOD and shortfall is None:
        heard = "" if retrieval is None else (
            f" and prompt retrieval top-1 {retrieval[VAL_RETRIEVAL_TOP1]:.3f} (chance "
            f"{retrieval_chance(retrieval[VAL_RETRIEVAL_PROMPTS]):.3f})")
        return (f"{GOOD_VERDICT}: val centred cosine {val_centred_cosine:.3f} (the reference trainer8 run reached "
                f"{REFERENCE}){heard}.", "Use it. More steps or prompts may still add a little.")
    if val_centred_cosine >= GOOD:
        return (f"Not there yet: val centred cosine {val_centred_cosine:.3f} reaches {GOOD}, but {shortfall[0]}.",
                shortfall[1])
    text = f"Not there yet: val centred cosine {val_centred_cosine:.3f} is below {GOOD}."
    if shortfall is not None:
        text += f" And {shortfall[0]}."
        if _at_chance(retrieval):  # no more steps or width fix an adapter that does not read the prompt
            return text, shortfall[1]
    gain, span = _late_gain(curve or [])
    if gain is not None and gain >= RISING and steps:
        return text, (f"It was still rising ({gain:+.3f} over the last {span} steps): train longer first "
                      f"(training.steps: {2 * steps}); widen the adapter once the curve flattens.")
    wider = f"training.width: {2 * width}" if width else "training.width: 1536"
    flat = f"It has flattened ({gain:+.3f} over the last {span} steps). " if gain is not None else ""
    return text, (f"{flat}Widen the adapter ({wider}) or deepen it (training.depth) before touching the recipe "
                  "(learning rate, warmup, loss weights).")


def _retrieval_shortfall(retrieval: dict) -> tuple[str, str] | None:
    """(why prompt retrieval does not show that the adapter reads the prompt, advice), or None when it does."""
    prompts, top1 = int(retrieval.get(VAL_RETRIEVAL_PROMPTS) or 0), float(retrieval.get(VAL_RETRIEVAL_TOP1) or 0.0)
    bar = retrieval_bar(prompts)
    if bar.hits is None:
        return (f"prompt retrieval needs at least {FEWEST_PROMPTS} non-empty val prompts to show that it reads the "
                f"prompt (there are {prompts})",
                f"Raise corpus.val_prompts: with fewer than {FEWEST_PROMPTS} non-empty val prompts, chance alone "
                "finds their own targets too often to tell an adapter that reads the prompt from one that ignores it.")
    if retrieval_passes(top1, prompts):
        return None
    why = f"prompt retrieval top-1 {top1:.3f} is below {bar.top1:.3f} (chance {retrieval_chance(prompts):.3f})"
    if _at_chance(retrieval):
        return why, ("It ignores the prompt: its outputs do not tell the val prompts apart, and its cosine is what "
                     "all prompts' targets share. Check that each shard pairs a prompt with its own teacher output "
                     "and that the teacher reads the prompt, then train again.")
    return why, ("It reads the prompt, but not enough to tell most val prompts apart: train longer (training.steps) "
                 "or widen the adapter (training.width), and look at the report's worst val prompts.")


def _at_chance(retrieval: dict | None) -> bool:
    """Prompt retrieval no better than chance, where it was measured on enough prompts to tell."""
    if retrieval is None:
        return False
    prompts, top1 = int(retrieval.get(VAL_RETRIEVAL_PROMPTS) or 0), float(retrieval.get(VAL_RETRIEVAL_TOP1) or 0.0)
    return retrieval_bar(prompts).hits is not None and _chance_tail(round(top1 * prompts), prompts) > CHANCE_P


def _late_gain(curve: list[tuple[int, float]]) -> tuple[float | None, int]:
    """The score gained from the last validation at or before 3/4 of the run to the end, and over how many steps."""
    if len(curve) < 2:
        return None, 0
    last_step, last = curve[-1]
    earlier = [(s, c) for s, c in curve[:-1] if s <= 0.75 * last_step] or curve[:1]
    step, cosine = earlier[-1]
    return last - cosine, last_step - step
