"""`gguf-trainer run`: a thin client of the project's Dagster instance.

What is left to do is decided by one function, pipeline/plan.py's ``next_work``, from the project
status (the fingerprints each stage owns, composed in lib/status/states.py): the next named job
(defs/jobs.py) and the shard partitions it covers. `run` executes those jobs in-process until
nothing is left; the daemon's resume sensor (defs/sensors.py, pipeline/resume.py) requests the very same
jobs, one at a time. Several workers, and the cluster's, are orchestration/workers.py's.
"""

from __future__ import annotations

from collections.abc import Callable

import dagster as dg

from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.core.lock import ProjectLock
from gguf_assets.lib.corpus.prompt_files import check_prompt_files
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings, SettingsError, load_settings
from gguf_assets.lib.status.states import StageState, State, project_status, status_view
from gguf_assets.lib.telemetry.hardware import AUTO_WORKERS
from gguf_assets.orchestration.cluster import load_cluster
from gguf_assets.orchestration.instance import create_run, open_workspace, prepare_instance, size_gpu_pool
from gguf_assets.orchestration.outages import PipelineFailed
from gguf_assets.orchestration.run_outcomes import failure_message
from gguf_assets.orchestration.stopping import StopRequest, stop_tags_the_latest_run
from gguf_assets.orchestration.workers import run_on_workers, run_workers, worker_gpus
from gguf_assets.pipeline.plan import Work, next_work
from gguf_assets.pipeline.private_api import execute_run, recon_job_from_origin
from gguf_assets.pipeline.resume import mark_interrupted_runs
from gguf_assets.pipeline.run_end import was_interrupted
from gguf_assets.pipeline.settings_observation import observe_settings

MAX_LOST_WORKERS = 3  # cluster runs cut off by a dead worker, planned again before the pipeline gives up


def run_pipeline(paths: ProjectPaths, *, echo: Callable[[str], None] = print, workers: int | str | None = None,
                 cancel_on_stop: bool = False) -> list[StageState]:
    """Materialize everything missing or stale through the project's Dagster instance; returns the final status.

    ``workers`` > 1 runs each split's shards as that many Dagster runs at once, launched by the
    instance's run launcher; they join this pipeline, each holding a lock of its own while it writes
    (lib/core/lock.py). ``"auto"`` starts one per visible GPU, and on a GPU machine each worker is pinned
    to its own GPU (orchestration/workers.py: worker_gpus). On a cluster with Celery workers (cluster.yaml)
    every job is launched to the workers' queues and followed; shards are split into ``workers`` ranges
    (default, and auto: as many as workers answer). A stop (Ctrl-C) there stops following, and the runs go on, unless
    ``cancel_on_stop``.
    """
    cluster = load_cluster(paths.root)
    on_workers = cluster is not None and cluster.runs_on_workers
    prepare_instance(paths)

    instance = dg.DagsterInstance.get()
    size_gpu_pool(instance)
    with StopRequest(instance).installed() as stop, \
            ProjectLock(paths.lock_file, describe=f"gguf-trainer run {paths.root.name}"), \
            stop_tags_the_latest_run(instance), open_workspace(instance, in_process=True) as workspace:
        marked = mark_interrupted_runs(instance)
        if marked:
            echo(f"marked {len(marked)} run(s) cut off by a kill or reboot as failed; resuming where they stopped")
        # Read once: every job of this pipeline loads this snapshot by its tag (defs/resources.py), so an
        # edit of project.yaml while it runs affects only the next run.
        settings = load_settings(paths.root)
        settings_history.remember(paths.root, settings)
        view = status_view(paths, settings)  # one status question for the observation and the first plan
        observe_settings(instance, settings, paths, view=view)  # the UI's stale marks follow project.yaml now
        # A typo in a prompt file path should fail in seconds, not after a teacher download.

        check_prompt_files(paths, settings)
        gpus = worker_gpus(settings, workers)
        if workers == AUTO_WORKERS and not on_workers:
            pinned = f"one per GPU ({', '.join(gpus)})" if gpus[0] is not None else "no GPU to share out here"
            echo(f"--workers auto: {len(gpus)} shard worker(s), {pinned}")
        done: set[Work] = set()
        lost = 0
        while (work := next_work(paths, settings, instance, view)) is not None:
            view = None  # asked again after each job: it changed what is current
            if stop.asked:  # a stop that Dagster's handler swallowed while the last job finished
                raise KeyboardInterrupt
            if work in done:
                raise PipelineFailed(f"{work.describe()} ran successfully but is still not current; see "
                                     f"`{trainer('status', paths.root)}`")
            if on_workers:
                if not run_on_workers(paths, instance, workspace, work, settings, workers, echo,
                                       cancel_on_stop=cancel_on_stop):
                    lost += 1
                    if lost > MAX_LOST_WORKERS:
                        raise PipelineFailed(f"workers were lost {lost} times; check them (`celery inspect ping`, "
                                             f"their logs), then `{trainer('run', paths.root)}` continues.")
                    continue  # planned again: the lost runs' shards go back to the queue
            elif len(gpus) > 1 and len(work.partitions) > 1:
                run_workers(paths, instance, work, settings, gpus, echo)
            else:
                echo(f"→ {work.describe()}")
                run = create_run(workspace, work, work.tags(settings))
                stop.run_id = run.run_id
                result = execute_run(recon_job_from_origin(run.job_code_origin), run, instance)
                stop.run_id = None
                if not result.success and (stop.asked or was_interrupted(instance, result.run_id)):
                    stop.record_cancel(result.run_id)
                    raise KeyboardInterrupt  # stopped on purpose (tagged by stop_tags_the_latest_run)
                if not result.success:
                    raise PipelineFailed(f"{failure_message(instance, result.run_id)}\nThe full log, stack trace "
                                         f"included: `{trainer('ui', paths.root)}`, run {result.run_id[:8]}.")
            done.add(work)
        status = project_status(paths, settings)
        blocked = [s for s in status if s.state == State.BLOCKED]
        if blocked and all(s.detail.startswith("precompute.mode") for s in blocked):
            echo(f"not running {', '.join(s.stage for s in blocked)}: {blocked[0].detail}")
        tell_about_edits(paths, settings, instance, echo)
        return status


def tell_about_edits(paths: ProjectPaths, settings: Settings, instance, echo: Callable[[str], None]) -> None:
    """project.yaml edited while the pipeline ran: say so, and let the UI's stale marks follow the edit."""
    try:
        now = load_settings(paths.root)
    except SettingsError as exc:
        echo(f"project.yaml was edited during the run and is not valid now: {exc}")
        return
    edits = settings_history.changed_keys(settings, now, lambda s: s.to_dict())
    if not edits:
        return
    # A lowered training.steps is followed live (lib/training/train.py ends the run at the lowered count); every
    # other edit, a raised count included, applies to the next run.
    lowered = now.training.steps < settings.training.steps
    followed = [e for e in edits if e.startswith("training.steps ")] if lowered else []
    later = [e for e in edits if e not in followed]
    if followed:
        echo(f"project.yaml changed during the run ({followed[0]}): the run followed it, ending training at the "
             "lowered count (or at the step it had reached, if that was later)")
    if later:
        echo(f"project.yaml changed during the run ({', '.join(later)}): this run finished under the settings it "
             f"started with; the edit applies to the next run (`{trainer('run', paths.root)}`)")
    observe_settings(instance, now, paths)
