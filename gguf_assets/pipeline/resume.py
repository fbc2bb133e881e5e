"""Interrupted runs and resuming: find runs left STARTED by a reboot or a kill -9, mark them failed, free their
slots; and what the daemon resumes next (the sensors in defs/sensors.py ask ``resume_decision``).

Under the default run launcher such a run stays STARTED forever and counts against the `gpu`
pool, so the run queue would hold the next GPU run forever. Every job runs in-process, and
every run that uses the project resource is tagged with that process's pid, start time and the
boot id (see resources.py): a live run is never marked, whatever its step boundaries, and a
dead one is recognised.
"""

import datetime as dt
import os

import dagster as dg
import psutil

from gguf_assets.lib.core.liveness import holder_is_gone, machine_id
from gguf_assets.lib.core.lock import is_locked
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import SettingsError, load_settings
from gguf_assets.lib.status.states import status_view
from gguf_assets.pipeline import run_tags
from gguf_assets.pipeline.environment import project_dir_from_env
from gguf_assets.pipeline.names import CONSOLE
from gguf_assets.pipeline.plan import next_work
from gguf_assets.pipeline.private_api import WorkerStatus
from gguf_assets.pipeline.run_end import notify_interrupted
from gguf_assets.pipeline.run_tags import INTERRUPTED_TAG, PIPELINE_TAG, SETTINGS_TAG, STOPPED_TAG
from gguf_assets.pipeline.settings_observation import observe_settings

ACTIVE = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.CANCELING]


def _is_cut_off(record, instance: dg.DagsterInstance) -> str | None:
    """The reason a run is dead, or None if it may still be running."""
    tags = record.dagster_run.tags
    machine = run_tags.get(tags, run_tags.MACHINE_TAG)
    if machine and machine != machine_id():  # a pid from another machine means nothing here
        return _worker_lost(instance, record.dagster_run)
    pid_text, boot = run_tags.get(tags, run_tags.PID_TAG), run_tags.get(tags, run_tags.BOOT_TAG)
    pid = int(pid_text) if pid_text else None
    if pid is not None or boot is not None:
        if pid == os.getpid():
            return None
        if holder_is_gone(holder_boot_id=boot or "", holder_pid=pid,
                          holder_started=run_tags.get(tags, run_tags.PID_STARTED_TAG) or ""):
            return f"its process (pid {pid}) is gone or the machine rebooted since it started"
        return None
    started = record.start_time or record.create_timestamp.timestamp()
    if started < psutil.boot_time():
        return "it started before the last boot"
    return None


def _worker_lost(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str | None:
    """A run on another machine: the run launcher's worker health check (run monitoring's) decides."""
    launcher = instance.run_launcher
    if not launcher.supports_check_run_worker_health:
        return None
    health = launcher.check_run_worker_health(run)
    return f"its worker is gone ({health.msg})" if health.status == WorkerStatus.FAILED else None


def mark_interrupted_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark dead runs as failed with the reason and free their pool slots; returns their ids."""
    marked = []
    told_leaders: set[str] = set()  # one notice per pipeline of worker runs (pipeline/run_end.py)
    for record in instance.get_run_records(filters=dg.RunsFilter(statuses=ACTIVE)):
        reason = _is_cut_off(record, instance)
        if reason is None:
            continue
        run = record.dagster_run
        instance.report_run_failed(run, message=f"Interrupted: {reason}. Marked failed at "
                                   f"{dt.datetime.now().isoformat(timespec='seconds')}; the pipeline resumes "
                                   "from the last finished shard and checkpoint.")
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        instance.add_run_tags(run.run_id, {INTERRUPTED_TAG: "true"})
        marked.append(run.run_id)
        # its own process, which tells a run's end, is gone (pipeline/run_end.py)
        notify_interrupted(run, reason, told_leaders)
    return marked


# How often the daemon looks for work to resume and for cut-off runs (seconds).
SENSOR_INTERVAL_ENV = "GGUF_ASSETS_SENSOR_INTERVAL_S"
WAITING = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, *ACTIVE]


def sensor_interval_s() -> int:
    return int(os.environ.get(SENSOR_INTERVAL_ENV, "30"))


def resume_decision(instance: dg.DagsterInstance) -> dg.RunRequest | dg.SkipReason:
    """What the daemon does for the project now: launch the next job of an unfinished pipeline, or why not.

    It finishes what is missing (never made, or cut off part-way) and what a pipeline asked for
    under the current settings; it never starts work that a settings edit made stale (that waits
    for Materialize, `gguf-trainer run`, or an edit back), and never retries a genuine failure.
    """
    marked = mark_interrupted_runs(instance)
    folder = project_dir_from_env()
    if not folder:
        return dg.SkipReason("no project folder in the environment (GGUF_ASSETS_PROJECT or DAGSTER_HOME)")
    paths = ProjectPaths.of(folder)
    try:
        settings = load_settings(paths.root)
    except SettingsError as exc:
        return dg.SkipReason(f"project.yaml is not valid: {exc}")
    view = status_view(paths, settings)  # one status question for the observation and the plan
    observe_settings(instance, settings, paths, view=view)  # the UI's stale marks follow project.yaml edits
    if busy := instance.get_run_records(filters=dg.RunsFilter(statuses=WAITING), limit=1):
        return dg.SkipReason(f"run {busy[0].dagster_run.run_id[:8]} ({busy[0].dagster_run.job_name}) is "
                             f"{busy[0].dagster_run.status.value.lower()}")
    if is_locked(paths.lock_file):
        return dg.SkipReason(f"another pipeline holds {paths.lock_file}")
    latest = next(iter(instance.get_run_records(limit=1)), None)
    if latest is None:
        # A new project: its first run is the user's decision (it may start a 30 GB download).
        return dg.SkipReason("nothing has run in this project yet: `gguf-trainer run`, or Materialize all, starts it")
    latest_run = latest.dagster_run
    if STOPPED_TAG in latest_run.tags or latest_run.status == dg.DagsterRunStatus.CANCELED:
        return dg.SkipReason(f"the last run ({latest_run.run_id[:8]}, {latest_run.job_name}) was stopped on "
                             "purpose; Materialize or `gguf-trainer run` continues it")
    if latest_run.status == dg.DagsterRunStatus.FAILURE and latest_run.run_id not in marked \
            and INTERRUPTED_TAG not in latest_run.tags:
        return dg.SkipReason(f"the last run ({latest_run.run_id[:8]}, {latest_run.job_name}) failed; the daemon "
                             "does not retry a failure: fix its cause, then Materialize or `gguf-trainer run`")
    work = next_work(paths, settings, instance, view)
    if work is None:
        return dg.SkipReason("everything is current")
    current = settings_history.settings_hash(settings)
    asked = (run_tags.get(latest_run.tags, PIPELINE_TAG) == current
             or (INTERRUPTED_TAG in latest_run.tags and run_tags.get(latest_run.tags, SETTINGS_TAG) == current))
    if not (work.missing or asked):
        return dg.SkipReason(f"{work.describe()} waits after a settings edit ({work.why}); it starts when you ask "
                             "(Materialize, or `gguf-trainer run`)")
    settings_history.remember(paths.root, settings)  # the run loads its settings by the tag's hash
    return dg.RunRequest(job_name=work.job, asset_selection=[dg.AssetKey(a) for a in work.assets],
                         tags=work.tags(settings), run_config=CONSOLE)
