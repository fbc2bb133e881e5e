"""A cluster's workers: Dagster runs executed by Celery workers (dagster-celery's run launcher, Redis broker).

Why the run launcher and not dagster-celery's executor: a shard job is one step over a range of
shard partitions (a single-run backfill), so a Celery task per step would add a hop and nothing
else, and the run's own process would stay on the machine that submitted it. With the run launcher
a whole run is one Celery task, and the worker that takes it executes it in its own process, as
`gguf-trainer run` does locally: the run's pid and machine tags, its lock and its records are the
worker's. Dagster's Terminate (a Celery revoke) and run monitoring's worker health check come with
it.

Queues: `gpu` (precompute and training) and `cpu` (materials and corpus). Each job names its queue
in its tags (defs/jobs.py), so a run launched from the UI lands where `gguf-trainer run` puts it.
A worker runs one run at a time (concurrency 1, one worker per GPU), in a fresh child process per
run, so a run's models and GPU memory leave with it.
"""

from __future__ import annotations

import warnings

from dagster_celery.launcher import CeleryRunLauncher
from dagster_celery.tags import DAGSTER_CELERY_QUEUE_TAG, DAGSTER_CELERY_TASK_ID_TAG

from gguf_assets.cluster import QUEUE_TAG
from gguf_assets.defs.private_api import CheckRunHealthResult, WorkerStatus

assert QUEUE_TAG == DAGSTER_CELERY_QUEUE_TAG, "dagster-celery renamed its queue tag: update gguf_assets.cluster"
PING_TIMEOUT_S = 5.0

# Celery settings for runs that take hours. Late acknowledgement with a prefetch of one: a worker
# busy with a run reserves no second one (which a kill -9 would strand until the broker's
# visibility timeout). A run redelivered after its worker died is ignored by Dagster, which never
# starts a run twice; the pipeline plans the dead run's shards again instead.
CELERY_SETTINGS = {
    "task_acks_late": True,
    "worker_prefetch_multiplier": 1,
    "broker_connection_retry_on_startup": True,
    "result_expires": 7 * 24 * 3600,
    "result_extended": True,  # a finished task's state names the worker that ran it (get_run_worker_debug_info)
}


class ClusterRunLauncher(CeleryRunLauncher):
    """dagster-celery's run launcher, with a worker health check that notices a worker that died.

    Celery's own state of a task whose worker was killed stays STARTED for ever; so for a STARTED
    run the worker that took it (named in the task's state) is pinged, and one that does not answer
    is reported FAILED, which run monitoring and the interrupted-runs check act on.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs["config_source"] = {**CELERY_SETTINGS, **(kwargs.get("config_source") or {})}
        super().__init__(*args, **kwargs)

    def launch_run(self, context) -> None:
        # dagster-celery registers its task again at every launch, and Celery warns each time after the first.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Task name 'execute_job' is already registered")
            super().launch_run(context)

    def check_run_worker_health(self, run) -> CheckRunHealthResult:
        if DAGSTER_CELERY_TASK_ID_TAG not in run.tags:
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, "not handed to Celery yet")
        health = super().check_run_worker_health(run)
        if health.status != WorkerStatus.RUNNING:
            return health
        result = self.celery.AsyncResult(run.tags[DAGSTER_CELERY_TASK_ID_TAG])
        worker = (result.info or {}).get("hostname") if isinstance(result.info, dict) else None
        if worker and not self.celery.control.ping(destination=[worker], timeout=PING_TIMEOUT_S):
            return CheckRunHealthResult(WorkerStatus.FAILED, f"Celery worker {worker} does not answer")
        return health

    def live_workers(self, queue: str) -> list[str]:
        """The workers that answer now and take runs from ``queue``."""
        answers = self.celery.control.inspect(timeout=PING_TIMEOUT_S).active_queues() or {}
        return sorted(name for name, queues in answers.items() if any(q.get("name") == queue for q in queues))


def worker_argv(*, queues: list[str], name: str, loglevel: str = "WARNING") -> list[str]:
    """Celery's worker command line: one run at a time, each in a fresh child process."""
    return ["worker", "--queues", ",".join(queues), "--concurrency", "1", "--prefetch-multiplier", "1",
            "--max-tasks-per-child", "1", "--hostname", name, "--loglevel", loglevel, "--without-gossip"]


def serve_runs(instance, *, queues: list[str], name: str) -> None:
    """Take runs from ``queues`` and execute them, until stopped (Ctrl-C or SIGTERM finishes the current run)."""
    from dagster_celery.tasks import create_execute_job_task, create_resume_job_task

    app = instance.run_launcher.celery
    create_execute_job_task(app)
    create_resume_job_task(app)
    app.worker_main(worker_argv(queues=queues, name=name))
