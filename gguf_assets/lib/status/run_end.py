"""The signal that a run ended, in the two places a user waits for it: the studio page's title (a mark, the step or
the score, the project) and the webhook's JSON (output.notify_url; pipeline/run_end.py sends it). One set of marks
and one score line for both.
"""

from __future__ import annotations

import time
from pathlib import Path

from gguf_assets.lib.core.metrics import VAL_CENTRED_COSINE
from gguf_assets.lib.output.report import read_report
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.manifests import Report
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.training.training_run import RunOutcome

MARKS = {RunOutcome.RUNNING: "⏳", RunOutcome.FINISHED: "✓", RunOutcome.FAILED: "✗", RunOutcome.STOPPED: "■"}
NOTICE_EVENT = "gguf_assets.run_end"


def signal_line(outcome: str, what: str, project: str) -> str:
    """``⏳ 1740/2400 · demo``, ``✓ 0.914 · demo``: the outcome's mark, what to say of it, the project's name."""
    return " · ".join(part for part in (f"{MARKS.get(outcome, '')} {what}".strip(), project) if part)


def report_score(report: Report) -> float:
    """The score a report's verdict reads: the GGUF's, or the torch checkpoint's when it was not evaluated."""
    return report.val_centred_cosine if report.evaluated else report.val_centred_cosine_torch


def run_end_notice(paths: ProjectPaths, settings: Settings, *, run_id: str, job: str, outcome: str, message: str,
                   scored: bool) -> dict:
    """The webhook's JSON for a run that ended: the project (its folder's name: a path would name the user's
    folders), the Dagster run, the outcome and why (a failed step's one line), and, when the run wrote the report
    (``scored``), the score, the verdict and the GGUF's file name (else null: a report there is an earlier run's).
    ``text`` says it in one line, for a chat webhook."""
    report = read_report(paths, settings) if scored else None
    score = report_score(report) if report is not None else None
    gguf = Path(report.gguf_path).name if report is not None else None
    said = f"{score:.3f}" if score is not None else outcome
    text = signal_line(outcome, said, paths.root.name) + f" ({job}, run {run_id[:8]})" + (
        f": {message}" if message else "") + (f"; {gguf}: {report.verdict}" if report is not None else "")
    return {"event": NOTICE_EVENT, "project": paths.root.name, "run_id": run_id, "job": job, "outcome": outcome,
            "message": message, VAL_CENTRED_COSINE: score, "score_source": report.score_source if report else None,
            "verdict": report.verdict if report is not None else None, "gguf": gguf,
            "ended_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "text": text}
