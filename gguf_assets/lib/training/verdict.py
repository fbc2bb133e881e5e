"""How to read val centred cosine: the verdict and advice shown after training and in the report.

The advice reads the validation curve when there is one: a score still rising at the end of training
is limited by the steps, and more steps help before a wider adapter does (at width 64, 400 steps gave
0.88 and 1,000 steps 0.909); only a flat curve points at the adapter's size.
"""

from __future__ import annotations

from gguf_assets.lib.core.metrics import VAL_CENTRED_COSINE

GOOD = 0.9
REFERENCE = 0.965  # the seed's RTX 5090 run with the trainer8 recipe
# Still rising: at least this much gained over the last quarter of training.
RISING = 0.005


def validation_curve(history: list[dict]) -> list[tuple[int, float]]:
    """(step, val centred cosine) of the training history's validations, in step order."""
    return sorted((int(h["step"]), float(h[VAL_CENTRED_COSINE])) for h in history or ()
                  if VAL_CENTRED_COSINE in h and "step" in h)


def verdict(val_centred_cosine: float, curve: list[tuple[int, float]] | None = None, *,
            width: int | None = None, steps: int | None = None) -> tuple[str, str]:
    """(one-line verdict, advice). ``curve``: the validations (validation_curve), ``width`` and ``steps`` the
    training settings the adapter was trained with; without them the advice is the general one."""
    if val_centred_cosine >= GOOD:
        return (f"Good: val centred cosine {val_centred_cosine:.3f} (the reference trainer8 run reached {REFERENCE}).",
                "Use it. More steps or prompts may still add a little.")
    text = f"Not there yet: val centred cosine {val_centred_cosine:.3f} is below {GOOD}."
    gain, span = _late_gain(curve or [])
    if gain is not None and gain >= RISING and steps:
        return text, (f"It was still rising ({gain:+.3f} over the last {span} steps): train longer first "
                      f"(training.steps: {2 * steps}); widen the adapter once the curve flattens.")
    wider = f"training.width: {2 * width}" if width else "training.width: 1536"
    flat = f"It has flattened ({gain:+.3f} over the last {span} steps). " if gain is not None else ""
    return text, (f"{flat}Widen the adapter ({wider}) or deepen it (training.depth) before touching the recipe "
                  "(learning rate, warmup, loss weights).")


def _late_gain(curve: list[tuple[int, float]]) -> tuple[float | None, int]:
    """The score gained from the last validation at or before 3/4 of the run to the end, and over how many steps."""
    if len(curve) < 2:
        return None, 0
    last_step, last = curve[-1]
    earlier = [(s, c) for s, c in curve[:-1] if s <= 0.75 * last_step] or curve[:1]
    step, cosine = earlier[-1]
    return last - cosine, last_step - step
