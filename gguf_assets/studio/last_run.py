"""What the studio says about the project's last Dagster run, whoever started it (the studio's Run, the CLI, the
Dagster UI, the daemon): running, finished, failed at which stage and why, or stopped and where; with the tail
of that run's own log. The truth is the project's Dagster instance: nothing here is kept by the studio."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from gguf_assets.lib.training.training_run import RunOutcome

LOG_LINES = 30  # the tail the page shows; the whole log is the run's page in the Dagster UI


def _first_line(text: str) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _user_message(error) -> str:
    """A step's error as the console says it: the innermost cause (Dagster wraps the asset's own error), without
    the exception class in front."""
    while error is not None and getattr(error, "cause", None) is not None:
        error = error.cause
    if error is None:
        return ""
    message = _first_line(error.message)
    name = getattr(error, "cls_name", None)
    if name and message.startswith(f"{name}: "):
        message = message[len(name) + 2:]
    elif ": " in message and message.split(": ", 1)[0].replace(".", "").replace("_", "").isalnum():
        message = message.split(": ", 1)[1]  # "gguf_assets.lib.core.errors.UserError: ..." -> "..."
    return message


def _log_tail(instance, run_id: str) -> list[str]:
    lines = []
    for entry in instance.all_logs(run_id)[-LOG_LINES * 3:]:
        event = entry.dagster_event
        failure = event.step_failure_data if event is not None and event.is_step_failure else None
        text = (f"failed: {_user_message(failure.error)}" if failure is not None and failure.error is not None
                else _first_line(entry.user_message or (event.message if event else "")))
        if not text:
            continue
        when = dt.datetime.fromtimestamp(entry.timestamp).strftime("%H:%M:%S")
        lines.append(f"{when} {entry.step_key or '':<14} {text}")
    return lines[-LOG_LINES:]


def last_run_view(instance, where_stopped: Callable[[], str] | None = None) -> dict | None:
    """{run_id, job, state, stage, message, log} of the newest run (its state a RunOutcome: running, finished,
    failed or stopped), or None when the project has none. ``where_stopped()``: the pipeline's stopping point,
    asked only for a stopped run."""
    import dagster as dg

    runs = instance.get_runs(limit=1)
    if not runs:
        return None
    run = runs[0]
    status = run.status
    view = {"run_id": run.run_id, "job": run.job_name, "stage": None, "message": "",
            "log": _log_tail(instance, run.run_id)}
    if status == dg.DagsterRunStatus.SUCCESS:
        return {**view, "state": RunOutcome.FINISHED, "message": f"{run.job_name}, run {run.run_id[:8]}"}
    if status == dg.DagsterRunStatus.FAILURE:
        failures = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
        if failures:
            event = failures[0].dagster_event
            return {**view, "state": RunOutcome.FAILED, "stage": failures[0].step_key,
                    "message": _user_message(event.step_failure_data.error) or "failed"}
        run_failure = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
        message = _first_line(run_failure[0].dagster_event.message) if run_failure else "failed"
        return {**view, "state": RunOutcome.FAILED, "message": message}
    if status in (dg.DagsterRunStatus.CANCELED, dg.DagsterRunStatus.CANCELING):
        where = f"{where_stopped()}; " if where_stopped else ""
        return {**view, "state": RunOutcome.STOPPED, "message": f"{where}Run continues from there"}
    return {**view, "state": RunOutcome.RUNNING, "message": f"{status.value.lower()}"}
