"""Training runs and snapshots side by side: their validation curves overlaid, and every compared score step by
step (`gguf-trainer runs --compare`, the studio's Compare). The runs are read by listing.py.

A snapshot GGUF (lib/output/snapshots.py) is compared like a run: its curve is its run's, cut at its step (with its
step's own validation where the history has none there), and its scores are its GGUF's evaluation (`snapshot
--eval`, the studio's Evaluate; before one, its step's validation). It is named by its file
(``demo-adapter-step35.gguf``, or a path ending so), or by ``RUN@STEP``: the run's snapshot of that step (refused,
naming the files, where the step has a best and a plain one)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core import metrics
from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.runs.listing import LAST_SCORE_KEYS, Run, RunsError, RunsView, find_run, run_with
from gguf_assets.lib.telemetry.render import compare_panels_svg, compare_svg
from gguf_assets.lib.training.training_run import newest_meta

SNAPSHOT_AT = "@"  # RUN@STEP
GGUF_SUFFIX = ".gguf"
# The torch scores a snapshot records of its step (snapshots.json), drawn at its step where the history has none.
VALIDATED_KEYS = (metrics.VAL_CENTRED_COSINE, metrics.EMPTY_PROMPT_COSINE)


def _snapshot_entries(view: RunsView) -> list[tuple[Run, dict]]:
    """Every snapshot GGUF the runs list (each in the snapshots.json of the run whose weights it holds), oldest
    first; a record this product did not write (no whole step, no file) is left out."""
    from gguf_assets.lib.output.snapshots import read_snapshots, snapshot_evaluation

    paths = ProjectPaths.of(view.root)
    found = [(run, {**entry, "eval": snapshot_evaluation(paths, run.fingerprint, entry)}) for run in view.runs
             for entry in read_snapshots(paths.checkpoints_dir(run.fingerprint))
             if isinstance(entry.get("step"), int) and not isinstance(entry.get("step"), bool)
             and isinstance(entry.get("file"), str) and entry["file"]]
    return sorted(found, key=lambda pair: pair[1]["at"] if isinstance(pair[1].get("at"), (int, float)) else 0)


def _file_name(entry: dict) -> str:
    return Path(entry["file"]).name


def _listed(entries: list[tuple[Run, dict]]) -> str:
    """The files, by step then name (as `snapshot --list` lists them)."""
    steps = {_file_name(entry): entry["step"] for _, entry in entries}
    return ", ".join(sorted(steps, key=lambda name: (steps[name], name))) or "none"


def find_compared(view: RunsView, ref: str) -> Run:
    """The run or snapshot ``ref`` names: a snapshot GGUF's file (its name, or a path ending in it), ``RUN@STEP``
    (that run's snapshot of that step), else a run as ``find_run`` finds it."""
    ref = (ref or "").strip()
    entries = _snapshot_entries(view)
    if ref.endswith(GGUF_SUFFIX):
        named = [(run, entry) for run, entry in entries if _file_name(entry) == Path(ref).name]
        if not named:
            raise RunsError(f"no snapshot GGUF named {Path(ref).name!r}: the runs' snapshots are {_listed(entries)} "
                            f"(`{trainer('snapshot', view.root, '--list')}` lists them)")
        return as_compared(*named[-1])  # written again by another run: the newest record is the file's
    run_ref, at, step = ref.rpartition(SNAPSHOT_AT)
    if not at or not step.isdigit():
        return find_run(view, ref)
    run = find_run(view, run_ref)
    own = [(r, e) for r, e in entries if r.fingerprint == run.fingerprint]
    of_step = [(r, e) for r, e in own if e["step"] == int(step)]
    if not of_step:
        raise RunsError(f"run {run.name} has no snapshot GGUF of step {step}; its snapshots: {_listed(own)} "
                        f"(`{trainer('snapshot', view.root, '--step', step)}` takes one of the run project.yaml "
                        "makes)")
    if len(of_step) > 1:
        raise RunsError(f"step {step} of run {run.name} has {len(of_step)} snapshot GGUFs: {_listed(of_step)}; name "
                        "the file to compare")
    return as_compared(*of_step[0])


def _cut(points: list[tuple[int, float]], step: int, value: object) -> list[tuple[int, float]]:
    """``points`` up to ``step``, ending with (step, value) where they have no point there and value is a score."""
    cut = [(x, y) for x, y in points if x <= step]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and all(x != step for x, _ in cut):
        cut.append((step, float(value)))
    return cut


def as_compared(run: Run, entry: dict) -> Run:
    """The snapshot GGUF ``entry`` (in ``run``'s snapshots.json) as a compared run: named by its file, its curve
    cut at its step, best and final read off that curve (final: its step's validation), and its GGUF's evaluation
    as its scores (its step's validation before it was evaluated)."""
    step, evaluated = entry["step"], entry.get("eval") if isinstance(entry.get("eval"), dict) else {}
    validated = {key: entry.get(key) for key in VALIDATED_KEYS}
    curve = _cut(run.curve, step, validated[metrics.VAL_CENTRED_COSINE])
    best = max(((x, y) for x, y in curve if x > 0), key=lambda point: point[1], default=(None, None))
    last = evaluated or validated
    return run_with(
        run, name=_file_name(entry), label="", step=step, curve=curve, best_step=best[0],
        best_val_centred_cosine=best[1], final_val_centred_cosine=validated[metrics.VAL_CENTRED_COSINE],
        gguf_val_centred_cosine=evaluated.get(metrics.VAL_CENTRED_COSINE),
        gguf_retrieval={key: evaluated.get(key) for key in metrics.RETRIEVAL_KEYS} if evaluated else {},
        last_scores={"step": step, **{key: last.get(key) for key in LAST_SCORE_KEYS}},
        snapshot={"file": entry["file"], "step": step, "weights": entry.get("weights"), "run": run.name,
                  "validated": validated, "evaluated": bool(evaluated)})


def snapshot_choices(view: RunsView) -> list[dict]:
    """The snapshots Compare offers beside the runs (the studio's selects): {ref (what find_compared takes), text},
    one per file (its newest record, as find_compared reads it)."""
    newest = {_file_name(entry): (run, entry) for run, entry in _snapshot_entries(view)}
    return [{"ref": name, "text": f"{name} (step {entry['step']} of {run.name})"}
            for name, (run, entry) in newest.items()]


def compared_scores(run: Run) -> dict:
    """What the studio's Compare lists of a run or snapshot under the curves: its best validation, its end's (a
    snapshot: its step's), its GGUF's score and prompt retrieval (a snapshot: its own GGUF's evaluation)."""
    return {"name": run.name, "snapshot": run.snapshot, "step": run.step, "best_step": run.best_step,
            "best": run.best_val_centred_cosine, "final": run.final_val_centred_cosine,
            "gguf": run.gguf_val_centred_cosine, **{key: run.gguf_retrieval.get(key) for key in metrics.RETRIEVAL_KEYS}}


def _compared(view: RunsView, refs: list[str]) -> list[Run]:
    runs = [find_compared(view, ref) for ref in refs]
    if len({(r.fingerprint, r.name) for r in runs}) < len(runs):
        raise RunsError(f"{', '.join(refs)} name the same run twice (or the same snapshot); compare two different "
                        "ones")
    return runs


def _shown_name(run: Run) -> str:
    return f"{run.name} ({run.label})" if run.label else run.name


# The charts of compared runs leave the untrained adapter's score (step 0) out: near 0 below validations near 0.9, it
# would flatten every difference between the runs. The table and the JSON keep it.
DRAWN_FROM = "from the first validation; the untrained step 0 is left out"


def _drawn(run: Run, runs: list[Run], points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The points of ``run``'s curve a comparison chart draws: none at step 0, and none of a history another line
    draws already (once, as that line): for a continuation compared with the run it continues, none before the
    step it went on from; for a snapshot compared with its own run, its point at its step only."""
    whole_runs = {r.fingerprint for r in runs if r.snapshot is None}
    if run.snapshot is not None and run.fingerprint in whole_runs:
        shared_to = run.snapshot["step"]
    else:
        shared_to = run.parent_step if run.parent in whole_runs else None
    return [(x, y) for x, y in points if x > 0 and (shared_to is None or x >= shared_to)]


def compare_runs(view: RunsView, refs: list[str]) -> tuple[list[Run], str]:
    """The runs and snapshots ``refs`` name and their val centred cosine curves overlaid (SVG;
    lib/telemetry/render.py)."""
    runs = _compared(view, refs)
    return runs, compare_svg({_shown_name(r): _drawn(r, runs, r.curve) for r in runs},
                             title=f"val centred cosine ({DRAWN_FROM})")


def score_curves(root: Path, run: Run) -> dict[str, list[tuple[int, float]]]:
    """Each of metrics.COMPARED's scores over the run's validations, (step, value) in step order, from its newest
    record (a run still training: its newest checkpoint's); val centred cosine starts at the untrained adapter's
    (step 0). A score a validation did not record (from before it existed) has no point there."""
    history = (newest_meta(ProjectPaths.of(root).checkpoints_dir(run.fingerprint)) or {}).get("history") or []
    curves = {score.key: sorted((int(e["step"]), float(e[score.key])) for e in history
                                if isinstance(e, dict) and "step" in e and isinstance(e.get(score.key), (int, float)))
              for score in metrics.COMPARED}
    curves[metrics.VAL_CENTRED_COSINE] = list(run.curve)
    if run.snapshot is not None:  # its run's, cut at its step (as_compared cut its val centred cosine already)
        step, validated = run.snapshot["step"], run.snapshot["validated"]
        curves = {key: _cut(points, step, validated.get(key)) for key, points in curves.items()}
    return curves


@dataclass(frozen=True)
class Comparison:
    """Runs (and snapshots, as runs) side by side: each one's score curves ({score key: {shown name: [(step,
    value)]}}), and the SVG of them, one chart per score."""

    runs: list[Run]
    curves: dict[str, dict[str, list[tuple[int, float]]]]
    svg: str

    def to_json(self) -> dict:
        return {"runs": [r.to_json() for r in self.runs], "svg": self.svg,
                "scores": {key: {name: [list(p) for p in points] for name, points in by_run.items()}
                           for key, by_run in self.curves.items()}}


def compare_scores(view: RunsView, refs: list[str]) -> Comparison:
    """The runs and snapshots ``refs`` name (one or more), each compared score step by step (`gguf-trainer runs
    --compare`)."""
    runs = _compared(view, refs)
    per_run = [(_shown_name(r), score_curves(view.root, r)) for r in runs]
    curves = {score.key: {name: run_curves[score.key] for name, run_curves in per_run} for score in metrics.COMPARED}
    titles = {score.key: score.label + ("" if score.higher_is_better else " (lower is better)")
              for score in metrics.COMPARED}
    drawn = {titles[key]: {name: _drawn(run, runs, by_run[name]) for run, (name, _) in zip(runs, per_run)}
             for key, by_run in curves.items()}
    return Comparison(runs, curves, compare_panels_svg(drawn))
