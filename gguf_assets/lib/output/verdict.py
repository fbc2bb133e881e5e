"""How to read val centred cosine: the verdict and advice shown after training and in the report."""

from __future__ import annotations

GOOD = 0.9
REFERENCE = 0.965  # the seed's RTX 5090 run with the trainer8 recipe


def verdict(val_centred_cosine: float) -> tuple[str, str]:
    """(one-line verdict, advice)."""
    if val_centred_cosine >= GOOD:
        return (f"Good: val centred cosine {val_centred_cosine:.3f} (the reference trainer8 run reached {REFERENCE}).",
                "Use it. More steps or prompts may still add a little.")
    return (f"Not there yet: val centred cosine {val_centred_cosine:.3f} is below {GOOD}.",
            "Widen the adapter (training.width: 1536) or deepen it (training.depth) before touching the "
            "recipe (learning rate, warmup, loss weights).")
