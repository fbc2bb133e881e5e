"""Interrupted runs: find runs left STARTED by a reboot or a kill -9, mark them failed, free their slots.

Under the default run launcher such a run stays STARTED forever and keeps its `gpu` pool
slot, so the next GPU run would queue forever. Every run that uses the project resource is
tagged with its worker's pid and the boot id (see resources.py), which is how a dead one
is recognised.
"""

import datetime as dt
import os

import dagster as dg
import psutil

from gguf_assets.lib.liveness import holder_is_gone

PID_TAG = "gguf_assets/pid"
BOOT_TAG = "gguf_assets/boot_id"
ACTIVE = [dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.CANCELING]


def _is_cut_off(record) -> str | None:
    """The reason a run is dead, or None if it may still be running."""
    tags = record.dagster_run.tags
    pid = int(tags[PID_TAG]) if PID_TAG in tags else None
    if pid is not None or BOOT_TAG in tags:
        if pid == os.getpid():
            return None
        if holder_is_gone(holder_boot_id=tags.get(BOOT_TAG, ""), holder_pid=pid):
            return f"its process (pid {pid}) is gone or the machine rebooted since it started"
        return None
    started = record.start_time or record.create_timestamp.timestamp()
    if started < psutil.boot_time():
        return "it started before the last boot"
    return None


def mark_interrupted_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark dead runs as failed with the reason and free their pool slots; returns their ids."""
    marked = []
    for record in instance.get_run_records(filters=dg.RunsFilter(statuses=ACTIVE)):
        reason = _is_cut_off(record)
        if reason is None:
            continue
        run = record.dagster_run
        instance.report_run_failed(run, message=f"Interrupted: {reason}. Marked failed at "
                                   f"{dt.datetime.now().isoformat(timespec='seconds')}; the pipeline resumes "
                                   "from the last finished shard and checkpoint.")
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        marked.append(run.run_id)
    return marked


def _mark_and_report(context: dg.SensorEvaluationContext) -> dg.SkipReason:
    marked = mark_interrupted_runs(context.instance)
    return dg.SkipReason(f"marked {len(marked)} interrupted run(s) as failed: {marked}" if marked
                         else "no interrupted runs")


def interrupted_runs_sensor(*, running: bool = True) -> dg.SensorDefinition:
    """The sensor; it runs by default when the project's output.auto_resume is true, and can be
    switched on in the UI otherwise."""
    return dg.SensorDefinition(
        name="interrupted_runs_sensor", evaluation_fn=_mark_and_report, minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING if running else dg.DefaultSensorStatus.STOPPED,
        description="Marks runs cut off by a reboot or a kill -9 as failed and frees their gpu pool slots.")
