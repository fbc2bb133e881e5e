"""Shards as several Dagster runs at once: on this machine through the instance's run launcher, or on a cluster's
Celery workers (orchestration/cluster_workers.py), followed until they end."""

from __future__ import annotations

import os
from collections.abc import Callable

import dagster as dg

from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.core.lock import admit_runs
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.precompute.half_state import HalfState
from gguf_assets.lib.precompute.shards_run import plan_shards, shard_status
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.telemetry.hardware import AUTO_WORKERS, visible_gpus
from gguf_assets.lib.training.training_run import RunOutcome
from gguf_assets.orchestration.cluster import GPU_QUEUE, QUEUE_TAG
from gguf_assets.orchestration.instance import CODE_LOCATION, create_run, open_workspace
from gguf_assets.orchestration.outages import PipelineFailed, through_outages
from gguf_assets.orchestration.run_outcomes import failure_message, wait_for_runs
from gguf_assets.pipeline import run_tags
from gguf_assets.pipeline.plan import Work, split_range
from gguf_assets.pipeline.run_end import STOPPED_MESSAGE, notify_workers_end
from gguf_assets.pipeline.run_tags import ADMITTED_TAG, GPU_TAG, INTERRUPTED_TAG, LEADER_TAG, WORKER_TAG


def worker_gpus(settings: Settings, workers: int | str | None) -> list[str | None]:
    """The shard workers of this machine: per worker, the GPU it is pinned to (a CUDA_VISIBLE_DEVICES entry), or
    None when it is not pinned. ``auto`` means one per visible GPU (one on a CPU machine); several workers on a GPU
    machine take the GPUs in turn. A precompute.device naming one device (cpu, cuda:N) is the user's choice: no pin.
    """
    if workers in (None, 1):
        return [None]
    gpus = visible_gpus() if settings.precompute.device in ("auto", "cuda") else []
    count = max(1, len(gpus)) if workers == AUTO_WORKERS else workers
    if count == 1 or not gpus:
        return [None] * count
    return [gpus[index % len(gpus)] for index in range(count)]


def run_workers(paths: ProjectPaths, instance, work: Work, settings: Settings, gpus: list[str | None],
                 echo: Callable[[str], None]) -> None:
    """Launch one Dagster run per contiguous shard range through the instance's run launcher, each pinned to its
    GPU of ``gpus`` (worker_gpus: one entry per worker); wait for all.

    The launcher starts each run in its own process under a code server that this process
    starts, so the runs are this pipeline's descendants and share its lock. Each keeps torch's
    default thread count: CPU matmul results depend on it, and shards must be byte-identical
    whatever the number of workers.
    """
    ranges = split_range(work.partitions, len(gpus))
    with open_workspace(instance, in_process=False) as workspace:
        run_ids = []
        try:
            for keys, gpu in zip(ranges, gpus):
                pin = {GPU_TAG: gpu} if gpu is not None else {}
                run = create_run(workspace, work, {**work.tags(settings, keys), LEADER_TAG: str(os.getpid()),
                                                    WORKER_TAG: f"{len(run_ids) + 1}/{len(ranges)}", **pin})
                instance.launch_run(run.run_id, workspace)
                run_ids.append(run.run_id)
                on = f", GPU {gpu}" if gpu is not None else ""
                echo(f"→ {work.job} shards {keys[0]}..{keys[-1]} as run {run.run_id[:8]} "
                     f"(worker {len(run_ids)}/{len(ranges)}{on})")
            wait_for_runs(instance, run_ids, echo)
        except KeyboardInterrupt:
            for run_id in run_ids:
                if not instance.get_run_by_id(run_id).is_finished:
                    instance.run_launcher.terminate(run_id)
            _tell_stop(paths, settings, instance, run_ids, STOPPED_MESSAGE, echo)
            raise
    failed = [instance.get_run_by_id(r) for r in run_ids]
    failed = [run for run in failed if run.status != dg.DagsterRunStatus.SUCCESS]
    if failed:
        split = "train" if "train" in work.assets[0] else "val"
        lines = [worker_failure(paths, settings, instance, run, split) for run in failed]
        notify_workers_end(paths, settings, failed, RunOutcome.FAILED, "; ".join(lines), echo)
        raise PipelineFailed("\n".join(lines) + f"\nThe shards finished so far are kept (the other workers' too); "
                             f"`{trainer('run', paths.root)}` continues with the rest. Logs: "
                             f"`{trainer('ui', paths.root)}`.")


def run_on_workers(paths: ProjectPaths, instance, workspace, work: Work, settings: Settings, workers: int | str | None,
                    echo: Callable[[str], None], *, cancel_on_stop: bool) -> bool:
    """On a cluster: launch ``work`` as runs to the Celery workers' queue, admitted to this pipeline, and
    follow them. True when all succeeded; False when a worker died under one (its shards are planned
    again); a run that failed on its own ends the pipeline with its reason."""
    location = workspace.get_code_location(CODE_LOCATION)
    queue = next(iter(location.get_repositories().values())).get_full_job(work.job).tags.get(QUEUE_TAG, GPU_QUEUE)
    # A cluster's Celery workers are one per GPU already (`gguf-trainer worker`): auto asks them how many answer.
    count = workers if workers != AUTO_WORKERS else None
    parts = count or max(1, len(through_outages(lambda: instance.run_launcher.live_workers(queue), echo)))
    ranges = split_range(work.partitions, parts) if work.partitions else [None]
    runs = []
    for index, keys in enumerate(ranges, 1):
        worker = {WORKER_TAG: f"{index}/{len(ranges)}"} if len(ranges) > 1 else {}
        runs.append(create_run(workspace, work, {**work.tags(settings, keys), ADMITTED_TAG: "true", **worker}))
    admit_runs(paths.lock_file, [run.run_id for run in runs])  # before any worker can start one
    for run, keys in zip(runs, ranges):
        through_outages(lambda: instance.launch_run(run.run_id, workspace), echo)
        shards = f" shards {keys[0]}..{keys[-1]}" if keys else ""
        echo(f"→ {work.job}{shards} as run {run.run_id[:8]} on the workers' `{queue}` queue")
    run_ids = [run.run_id for run in runs]
    try:
        wait_for_runs(instance, run_ids, echo, cluster=True)
    except KeyboardInterrupt:
        going = [r for r in run_ids if not instance.get_run_by_id(r).is_finished]
        if cancel_on_stop:
            for run_id in going:
                instance.run_launcher.terminate(run_id)
            echo(f"cancelled {len(going)} run(s) on the workers")
        elif going:
            echo(f"stopped following; {len(going)} run(s) go on on the workers ({', '.join(r[:8] for r in going)}): "
                 f"`{trainer('status', paths.root)}` shows what they finished, Terminate in the Dagster UI stops them")
        _tell_stop(paths, settings, instance, run_ids, STOPPED_MESSAGE if cancel_on_stop or not going else
                   f"stopped following; {len(going)} worker run(s) go on, and no next job starts", echo)
        raise
    finished = [instance.get_run_by_id(r) for r in run_ids]
    failed = [run for run in finished if run.status != dg.DagsterRunStatus.SUCCESS]
    if not failed:
        return True
    if all(INTERRUPTED_TAG in run.tags for run in failed):
        for run in failed:
            echo(f"a worker died under run {run.run_id[:8]} ({work.job}); its work goes back to the queue")
        return False
    split = next((s for s in ("train", "val") if work.assets == (f"{s}_shards",)), None)
    lines = [worker_failure(paths, settings, instance, run, split) if split else
             f"run {run.run_id[:8]} of {work.job}: {failure_message(instance, run.run_id)}" for run in failed]
    notify_workers_end(paths, settings, failed, RunOutcome.FAILED, "; ".join(lines), echo)
    raise PipelineFailed("\n".join(lines) + f"\nWhat finished is kept; `{trainer('run', paths.root)}` continues. "
                         f"Logs: `{trainer('ui', paths.root)}`.")


def _tell_stop(paths: ProjectPaths, settings: Settings, instance, run_ids: list[str], message: str,
               echo: Callable[[str], None]) -> None:
    """A stop ended the pipeline while its worker runs ran: its one notice (pipeline/run_end.py)."""
    notify_workers_end(paths, settings, [instance.get_run_by_id(r) for r in run_ids], RunOutcome.STOPPED, message,
                       echo)


def worker_failure(paths: ProjectPaths, settings: Settings, instance, run, split: str) -> str:
    """One line for a failed worker run: which worker, its shards, the shard it stopped at, and why."""
    start, end = run_tags.get(run.tags, run_tags.RANGE_START_TAG), run_tags.get(run.tags, run_tags.RANGE_END_TAG)
    plans = [p for p in plan_shards(paths, settings, load_manifest(paths), split) if start <= p.key <= end]
    at = next((p.key for p in plans if set(shard_status(paths, settings, p).values()) != {HalfState.CURRENT}), None)
    why = ("its process was killed" if run_tags.INTERRUPTED_TAG in run.tags
           else failure_message(instance, run.run_id))
    where = f", at shard {split}/{at}" if at else ""
    return (f"worker {run_tags.get(run.tags, WORKER_TAG) or '?'} (run {run.run_id[:8]}, {split} shards "
            f"{start}..{end}) stopped{where}: {why}")
