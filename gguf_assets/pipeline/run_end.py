"""How a run ended, and the notice that tells the user's webhook (output.notify_url; lib/core/webhook.py posts it,
lib/status/run_end.py says what it holds).

Where the notice is sent: at the end of every run, in the run's own process, from the one hook Dagster calls there
whichever entry point started the run (`gguf-trainer run`, the studio's Run, the daemon's resume sensor, Materialize
in the Dagster UI, `dagster asset materialize`): ProjectResource's teardown (defs/resources.py, then
run_bookkeeping.RunBookkeeping.end). Every job runs in-process (definitions.py), so that teardown comes once per run,
after its last step, also when a step failed or a stop interrupted it. Dagster writes the run's final status just
after it; ``ending_outcome`` reads what that status follows from (a stop asked, a failed step).

Why not Dagster's run status sensors (run_status_sensor, run_failure_sensor), the documented way to alert on a run's
end: they are evaluated by dagster-daemon only, and a plain `gguf-trainer run` (and `ui --no-daemon`) has none, so
its ends would never be told; while the daemon is down their cursor waits, and they would tell hours-old ends when it
starts again; and one sensor watches one status, three for finished, failed and stopped. The one end the teardown
cannot tell is a run whose process died (kill -9, out of memory, a reboot): ``mark_interrupted_runs``
(pipeline/resume.py) is where that end becomes known, and it tells it (``notify_interrupted``).

Which ends are told: every failed or stopped run (its pipeline stops there), and a finished run that worked on
training, export or evaluation (a finished materials or shards run is a pipeline going on). Only a run that wrote
the report carries a score.

One pipeline, one notice: with `gguf-trainer run --workers N` (and on a cluster) a job's shards run as several worker
runs at once, and the pipeline ends when the last of them has: one failing leaves the others to finish their shards,
and a stop ends them all. So a worker run never tells its own end; the leader that launched and follows them
(orchestration/workers.py) tells the pipeline's, once (``notify_workers_end``). A worker run marked failed after its
process died is told only when its leader is gone too (nobody else would tell it), once per leader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import dagster as dg

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.liveness import holder_is_gone
from gguf_assets.lib.core.webhook import DEFAULT_TIMEOUT_S, post_json, shown_url
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings, SettingsError, load_settings
from gguf_assets.lib.status.run_end import run_end_notice
from gguf_assets.lib.status.stages import TRAINING_STAGES
from gguf_assets.lib.training.training_run import RunOutcome
from gguf_assets.pipeline import run_tags
from gguf_assets.pipeline.environment import project_dir_from_env
from gguf_assets.pipeline.messages import user_message
from gguf_assets.pipeline.names import TRAIN_AND_EXPORT

log = logging.getLogger(__name__)


def _step_failures(instance, run_id: str) -> list:
    return instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records


def _interrupted(record) -> bool:
    error = getattr(record.event_log_entry.dagster_event.event_specific_data, "error", None)
    return getattr(error, "cls_name", "") == "DagsterExecutionInterruptedError"


def was_interrupted(instance, run_id: str) -> bool:
    """Did the run fail because its process got SIGINT/SIGTERM? (Dagster's own handler catches it in a step.)"""
    return any(_interrupted(record) for record in _step_failures(instance, run_id))


def step_failure_line(instance, run_id: str) -> str | None:
    """"step: why" of the run's first failed step (pipeline/messages.py's one line), or None when none failed."""
    for record in _step_failures(instance, run_id):
        event = record.event_log_entry.dagster_event
        error = getattr(event.event_specific_data, "error", None)
        if error is not None:
            return f"{event.step_key}: {user_message(error)}"
    return None


STOPPED_MESSAGE = "stopped on purpose; the next run continues from where it stopped"


def told_by_its_leader(run: dg.DagsterRun) -> bool:
    """A shard worker's run: its pipeline's end is its leader's to tell (the module's note)."""
    return run_tags.get(run.tags, run_tags.WORKER_TAG) is not None


def ending_outcome(instance, run_id: str) -> tuple[RunOutcome, str]:
    """How the run ending in this process ends, as Dagster records it a moment later (its steps are over, its
    status not yet written), and why: stopped when a stop was asked (the run is CANCELING) or interrupted a step,
    failed when a step failed (its one line), else finished."""
    run = instance.get_run_by_id(run_id)
    failures = _step_failures(instance, run_id)
    stopping = run is not None and run.status in (dg.DagsterRunStatus.CANCELING, dg.DagsterRunStatus.CANCELED)
    if stopping or any(_interrupted(record) for record in failures):
        return RunOutcome.STOPPED, STOPPED_MESSAGE
    if failures:
        return RunOutcome.FAILED, step_failure_line(instance, run_id) or "a step failed"
    return RunOutcome.FINISHED, ""


def _stages(run: dg.DagsterRun) -> set[str]:
    """The assets the run was asked to make (a job launched whole: the training job's are the training stages)."""
    if run.asset_selection:
        return {key.to_user_string() for key in run.asset_selection}
    return set(TRAINING_STAGES) if run.job_name == TRAIN_AND_EXPORT else set()


def _notify_url(paths: ProjectPaths, settings: Settings | None) -> str:
    """output.notify_url as project.yaml says it now (set while a run trains, it tells that run's end), else as the
    run's settings snapshot said it (project.yaml does not load at this moment)."""
    try:
        return load_settings(paths.root).output.notify_url
    except SettingsError:
        return settings.output.notify_url if settings is not None else ""


def notify_run_end(paths: ProjectPaths, settings: Settings | None, run: dg.DagsterRun,
                   outcome_of: Callable[[], tuple[RunOutcome, str]], *, say_sent=log.info,
                   say_failed=log.warning) -> None:
    """POST the run's end (``outcome_of()``: how it ended, and why) to output.notify_url, when one is set and the end
    is one to tell (the module's note says which). Never raises, and never waits more than a few seconds: what
    happened is one line, through ``say_sent`` or ``say_failed`` (the run's log), naming the URL by scheme and host
    only."""
    url, outcome = "", ""
    try:
        url = _notify_url(paths, settings)
        if not url:
            return
        outcome, message = outcome_of()
        stages = _stages(run)
        if outcome == RunOutcome.FINISHED and not stages & set(TRAINING_STAGES):
            return
        doc = run_end_notice(paths, settings or load_settings(paths.root), run_id=run.run_id, job=run.job_name,
                             outcome=str(outcome), message=message,
                             scored=outcome == RunOutcome.FINISHED and "eval_report" in stages)
        problem = post_json(url, doc, timeout_s=DEFAULT_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001  a notice never fails the run it tells of
        problem = f"{type(exc).__name__}: {exc}".replace(url, shown_url(url)) if url else str(exc)
    what = f"run-end notice{f' ({outcome})' if outcome else ''}"
    if problem is None:
        say_sent(f"{what} sent to {shown_url(url)} (output.notify_url)")
    else:
        say_failed(f"{what} not delivered to {shown_url(url)} (output.notify_url): {problem}; the run's outcome is "
                   "unchanged")


def notify_ending_run(instance, paths: ProjectPaths, settings: Settings, run: dg.DagsterRun, run_log=None) -> None:
    """Tell the end of the run this process executes, from its teardown (RunBookkeeping.end; ``run_log``: the
    run's logger, so the line is in its log)."""
    if told_by_its_leader(run):
        return
    said = {} if run_log is None else {"say_sent": run_log.info, "say_failed": run_log.warning}
    notify_run_end(paths, settings, run, lambda: ending_outcome(instance, run.run_id), **said)


def notify_workers_end(paths: ProjectPaths, settings: Settings, ended_by: list[dg.DagsterRun], outcome: RunOutcome,
                       message: str, say_failed: Callable[[str], None]) -> None:
    """Tell, once, the end of a pipeline whose job ran as worker runs (from their leader, when it stops following
    them: they all ended, or a stop ended them). ``ended_by``: the runs that ended it (the failed ones; for a stop,
    all), the first named in the notice; runs of a job that did not need splitting tell their own end."""
    if ended_by and told_by_its_leader(ended_by[0]):
        notify_run_end(paths, settings, ended_by[0], lambda: (outcome, message), say_failed=say_failed)


def _leader_gone(run: dg.DagsterRun) -> bool:
    """Whether the `gguf-trainer run` that launched a worker run on this machine has gone (a cluster's worker runs
    name none: the process that follows them tells their end)."""
    leader = run_tags.get(run.tags, run_tags.LEADER_TAG)
    return bool(leader) and leader.isdigit() and holder_is_gone(
        holder_boot_id=run_tags.get(run.tags, run_tags.BOOT_TAG) or "", holder_pid=int(leader))


def notify_interrupted(run: dg.DagsterRun, reason: str, told_leaders: set[str]) -> None:
    """Tell the end of a run whose process died (mark_interrupted_runs has just marked it failed). A worker run's
    end is its leader's to tell, unless that leader is gone too: then the first of its runs marked tells it
    (``told_leaders``: the leaders whose runs were told of in this marking)."""
    if told_by_its_leader(run):
        leader = run_tags.get(run.tags, run_tags.LEADER_TAG)
        if leader in told_leaders or not _leader_gone(run):
            return
        told_leaders.add(leader)
    try:
        folder = project_dir_from_env()
    except UserError:  # DAGSTER_HOME of another project: every run here refuses to start, saying so
        return
    if folder:
        notify_run_end(ProjectPaths.of(folder), None, run, lambda: (RunOutcome.FAILED, f"interrupted: {reason}"))
