"""Weights that scored higher than the delivered ones: the run's own best validation (a run whose score fell after
its best, or a run ended early by a lowered training.steps), or the run it continues (a continuation that ended
below where its parent had got). The trainer's closing note (lib/training/train.py) and the report say so beside
their verdict and name the command that gives them (`gguf-trainer snapshot DIR --best`; the parent's kept GGUF and
`gguf-trainer runs DIR --use NAME`); `gguf-trainer run`'s closing lines and the studio's Result say the same. Here,
under the output layer, so that the trainer reads it too.

Scores are compared like for like: the best validation against the delivered weights' own torch score (the same
evaluator, so best at the final step is never "better"), the parent's GGUF against the delivered GGUF where both
were evaluated, else the torch scores. A difference under MARGIN is noise, not better weights. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from gguf_assets.lib.core import metrics as m
from gguf_assets.lib.project.layout import ProjectPaths, RecordPathError
from gguf_assets.lib.telemetry.curves_log import run_name
from gguf_assets.lib.training.training_run import finished_meta, kept_gguf, parent_of, read_kept
from gguf_assets.lib.training.verdict import GOOD_VERDICT

# Less than this above the delivered score is not worth another file: it shows in neither the verdict's three
# decimals nor, often, between two evaluations of the same weights in another precision.
MARGIN = 0.001
BEST, PARENT = "best", "parent"

Command = Callable[..., str]  # the words after `gguf-trainer` → one command line to paste


def better_weights(paths: ProjectPaths, final_meta: dict, *, torch_score: float,
                   gguf_score: float | None) -> list[dict]:
    """The weights that scored at least MARGIN above the delivered ones (``final_meta``: the delivered run's
    final/meta.json; ``torch_score`` its torch score, ``gguf_score`` its GGUF's evaluated score or None), as the
    report stores them (no absolute path): {kind, score, delivered, measured, ...}; [] when none did."""
    found = []
    parent = _parent_result(paths, final_meta, torch_score=torch_score, gguf_score=gguf_score)
    if parent is not None and parent["score"] < parent["delivered"] + MARGIN:
        parent = None
    best = final_meta.get("best") or {}
    best_score = best.get(m.VAL_CENTRED_COSINE)
    parent_end = parent["step"] if parent is not None else None
    # Best at the final step is the delivered weights; best at the parent's end is the parent's GGUF, offered below.
    if isinstance(best_score, (int, float)) and best.get("step") not in (final_meta.get("step"), parent_end) \
            and best_score >= torch_score + MARGIN:
        found.append({"kind": BEST, "step": best.get("step"), "score": best_score, "delivered": torch_score,
                      "measured": "torch"})
    return found + ([parent] if parent is not None else [])


def _parent_result(paths: ProjectPaths, final_meta: dict, *, torch_score: float,
                   gguf_score: float | None) -> dict | None:
    """The finished result of the run the delivered one continues, scored like the delivered one; None when it
    continues none, or that run has no finished result."""
    fingerprint = final_meta.get("fingerprint")
    try:
        parent = parent_of(paths, fingerprint) if isinstance(fingerprint, str) else None
    except RecordPathError:  # a lineage.json leading outside: no parent to offer (status says what is wrong)
        return None
    meta = finished_meta(paths.checkpoints_dir(parent)) if parent else None
    if meta is None or meta.get("finished") is not True:
        return None
    kept = read_kept(paths, parent)
    kept_score = ((kept or {}).get("report") or {}).get(m.VAL_CENTRED_COSINE)
    if gguf_score is not None and isinstance(kept_score, (int, float)):
        score, delivered, measured = kept_score, gguf_score, "its GGUF"
    elif isinstance(meta.get(m.VAL_CENTRED_COSINE), (int, float)):
        score, delivered, measured = meta[m.VAL_CENTRED_COSINE], torch_score, "torch"
    else:
        return None
    try:
        name = run_name(SimpleNamespace(**meta["training"]), parent)
    except (KeyError, TypeError, AttributeError, ValueError):
        name = parent
    return {"kind": PARENT, "run": parent, "name": name, "step": meta.get("step"), "score": score,
            "delivered": delivered, "measured": measured,
            "gguf": paths.stored(kept_gguf(paths, parent, kept)) if kept else None}


def shortfall(found: list[dict]) -> str:
    """What the verdict adds: "But earlier weights scored higher (...)."; "" when none did."""
    if not found:
        return ""
    parts = [f"its best validation, step {f['step']}: {f['score']:.4f}" if f["kind"] == BEST else
             f"the run it continues: {f['score']:.4f}" for f in found]
    return f"But earlier weights scored higher ({'; '.join(parts)})."


def with_better_weights(text: str, advice: str, better: list[dict], command: Command,
                        project: object) -> tuple[str, str]:
    """The verdict and advice when earlier weights scored higher (``better``, from ``better_weights``): the verdict
    says so, and the advice starts with where they are (``command``, ``project``: as ``better_advice``); "use it"
    advice gives way to it (the recipe advice stays)."""
    if not better:
        return text, advice
    recipe = "" if text.startswith(GOOD_VERDICT) else f" {advice}"
    return f"{text} {shortfall(better)}", better_advice(better, command, project) + recipe


def better_advice(found: list[dict], command: Command, project: object) -> str:
    """Where each of the better weights is and the command that gives it, as sentences (``command(*words)``: a
    pasteable line, for the project folder ``project`` as the reader names it)."""
    return " ".join(f"{text} `{line}`." for text, line in better_offers(found, command, project))


def better_offers(found: list[dict], command: Command, project: object) -> list[tuple[str, str]]:
    """(what is better and what the command does, ending in ":"; the command) for each of ``found``."""
    offers = []
    for f in found:
        if f["kind"] == BEST:
            offers.append((f"Its best validation, at step {f['step']}, scored {f['score']:.4f} (torch), above the "
                           f"delivered weights' {f['delivered']:.4f}; a GGUF of those weights:",
                           command("snapshot", project, "--best")))
        else:
            kept = f" Its GGUF is kept as {Path(str(project)) / f['gguf']}." if f.get("gguf") else ""
            offers.append((f"The run it continues, {f['name']}, scored {f['score']:.4f} ({f['measured']}), above "
                           f"this run's {f['delivered']:.4f}.{kept} To make it current again, without training:",
                           command("runs", project, "--use", f["name"])))
    return offers
