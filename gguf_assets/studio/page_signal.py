"""What the studio page's title says, and what its browser notification follows: the project's state in one line
(``⏳ 1740/2400 · demo`` while it trains, ``✓ 0.914 · demo`` once the pipeline is done, ``✗ failed · demo``), from the
page's own view (studio/page.py's PageView), so a tab in the background tells the user when training ends.

The page notifies (when the user allowed it) once per run, when the state becomes finished or failed after it was
running while the page watched (templates/project.html: showSignal).
"""

from __future__ import annotations

from gguf_assets.lib.status.run_end import signal_line
from gguf_assets.lib.status.states import State
from gguf_assets.lib.training.training_run import RunOutcome


def page_signal(project: str, *, busy: bool, stages: list[dict], training: dict | None, last_run: dict | None,
                report: dict | None) -> dict:
    """{state, title, detail, run_id}: ``state`` running (a pipeline holds the project, or the last run runs),
    failed or stopped (the last run's), finished (every stage current, with the result's score), or idle; ``title``
    the page's; ``detail`` a notification's body; ``run_id`` the last Dagster run's."""
    last_state = last_run["state"] if last_run else None
    run_id = last_run["run_id"] if last_run else None
    progress = (training or {}).get("progress") or {}

    def said(state: str, what: str, detail: str = "") -> dict:
        return {"state": state, "title": signal_line(state, what, project), "detail": detail, "run_id": run_id}

    if busy or last_state == RunOutcome.RUNNING:
        if training and training.get("running") and progress:
            return said(RunOutcome.RUNNING, f"{progress['step']}/{progress['steps']}")
        working = next((s["title"] for s in stages if s["state"] == State.RUNNING), "working")
        return said(RunOutcome.RUNNING, working)
    if last_state == RunOutcome.FAILED:
        where = f" at {last_run['stage']}" if last_run.get("stage") else ""
        return said(RunOutcome.FAILED, "failed", f"failed{where}: {last_run['message']}")
    if last_state == RunOutcome.STOPPED:
        step, steps = progress.get("step"), progress.get("steps")
        at = f" at {step}/{steps}" if step and steps and step < steps else ""
        return said(RunOutcome.STOPPED, f"stopped{at}", last_run["message"])
    if report and all(s["state"] == State.CURRENT for s in stages):
        return said(RunOutcome.FINISHED, f"{report['score']:.3f}", report["verdict"])
    return {"state": "idle", "title": f"{project} · gguf_assets studio", "detail": "", "run_id": run_id}
