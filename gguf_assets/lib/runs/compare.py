"""Training runs side by side: their validation curves overlaid, and every compared score step by step
(`gguf-trainer runs --compare`, the studio's Compare). The runs are read by listing.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core import metrics
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.runs.listing import Run, RunsError, RunsView, find_run
from gguf_assets.lib.telemetry.render import compare_panels_svg, compare_svg
from gguf_assets.lib.training.training_run import newest_meta


def _compared(view: RunsView, refs: list[str]) -> list[Run]:
    runs = [find_run(view, ref) for ref in refs]
    if len({r.fingerprint for r in runs}) < len(runs):
        raise RunsError(f"{', '.join(refs)} name the same run twice; compare two different runs")
    return runs


def _shown_name(run: Run) -> str:
    return f"{run.name} ({run.label})" if run.label else run.name


# The charts of compared runs leave the untrained adapter's score (step 0) out: near 0 below validations near 0.9, it
# would flatten every difference between the runs. The table and the JSON keep it.
DRAWN_FROM = "from the first validation; the untrained step 0 is left out"


def _drawn(run: Run, runs: list[Run], points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The points of ``run``'s curve a comparison chart draws: none at step 0, and for a continuation compared with
    the run it continues, none before the step it went on from (that history is the parent's, drawn once, as the
    parent's line; the continuation's starts where it left it)."""
    shared_to = run.parent_step if run.parent and any(r.fingerprint == run.parent for r in runs) else None
    return [(x, y) for x, y in points if x > 0 and (shared_to is None or x >= shared_to)]


def compare_runs(view: RunsView, refs: list[str]) -> tuple[list[Run], str]:
    """The runs ``refs`` name and their val centred cosine curves overlaid (SVG; lib/telemetry/render.py)."""
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
    return curves


@dataclass(frozen=True)
class Comparison:
    """Runs side by side: each run's score curves ({score key: {shown name: [(step, value)]}}), and the SVG of them,
    one chart per score."""

    runs: list[Run]
    curves: dict[str, dict[str, list[tuple[int, float]]]]
    svg: str

    def to_json(self) -> dict:
        return {"runs": [r.to_json() for r in self.runs], "svg": self.svg,
                "scores": {key: {name: [list(p) for p in points] for name, points in by_run.items()}
                           for key, by_run in self.curves.items()}}


def compare_scores(view: RunsView, refs: list[str]) -> Comparison:
    """The runs ``refs`` name (one or more), each compared score step by step (`gguf-trainer runs --compare`)."""
    runs = _compared(view, refs)
    per_run = [(_shown_name(r), score_curves(view.root, r)) for r in runs]
    curves = {score.key: {name: run_curves[score.key] for name, run_curves in per_run} for score in metrics.COMPARED}
    titles = {score.key: score.label + ("" if score.higher_is_better else " (lower is better)")
              for score in metrics.COMPARED}
    drawn = {titles[key]: {name: _drawn(run, runs, by_run[name]) for run, (name, _) in zip(runs, per_run)}
             for key, by_run in curves.items()}
    return Comparison(runs, curves, compare_panels_svg(drawn))
