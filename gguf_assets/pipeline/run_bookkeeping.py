"""What every run does before its first step and after its last, whichever entry point started it.

Before: mark runs cut off by a kill -9 or a reboot as failed (so their pool slots are free), load
the run's one settings snapshot, observe it (the materializations then record the settings they
were made under), tag the run with its process, and take the project folder's lock. After:
release the lock, then tell output.notify_url how the run ended (pipeline/run_end.py). ProjectResource
calls ``begin`` and ``end``: a resource's setup and teardown are the hooks Dagster runs in the run's own
process before its first step and after its last.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import dagster as dg

from gguf_assets.lib.core.liveness import boot_id, machine_id, process_started
from gguf_assets.lib.core.lock import ProjectLock, RunningRun
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import ProjectPaths, check_output_folders
from gguf_assets.lib.project.settings import Settings, load_settings
from gguf_assets.pipeline import run_tags
from gguf_assets.pipeline.resume import mark_interrupted_runs
from gguf_assets.pipeline.run_end import notify_ending_run
from gguf_assets.pipeline.settings_observation import observe_settings


def run_settings(paths: ProjectPaths, run: dg.DagsterRun | None) -> Settings:
    """A run of a pipeline (`gguf-trainer run`, the resume sensor) uses the snapshot the pipeline
    started with, named by its tag; any other run reads project.yaml now, once."""
    digest = run_tags.get(run.tags, run_tags.PIPELINE_TAG) if run is not None else None
    snapshot = settings_history.recall(paths.root, digest)
    return snapshot if snapshot is not None else load_settings(paths.root)


@dataclass
class RunBookkeeping:
    settings: Settings
    lock: ProjectLock
    paths: ProjectPaths
    instance: dg.DagsterInstance | None = None
    run: dg.DagsterRun | None = None

    @classmethod
    def begin(cls, instance: dg.DagsterInstance | None, run: dg.DagsterRun | None,
              paths: ProjectPaths) -> RunBookkeeping:
        settings = run_settings(paths, run)
        check_output_folders(paths, settings)  # a run that cannot deliver its result does no work
        if instance is not None and run is not None:
            mark_interrupted_runs(instance)  # every entry point cleans up after a kill -9, not only the daemon
            observe_settings(instance, settings, paths)
            instance.add_run_tags(run.run_id, {run_tags.PID_TAG: str(os.getpid()),
                                               run_tags.PID_STARTED_TAG: process_started(os.getpid()),
                                               run_tags.BOOT_TAG: boot_id(),
                                               run_tags.MACHINE_TAG: machine_id(),
                                               run_tags.SETTINGS_TAG: settings_history.settings_hash(settings)})
        describe = f"Dagster run {run.run_id[:8]} of {run.job_name}" if run is not None else ""
        leader = run_tags.get(run.tags, run_tags.LEADER_TAG) if run is not None else None
        running = None if run is None else RunningRun(
            run_id=run.run_id, job=run.job_name,
            assets=tuple(sorted(k.to_user_string() for k in run.asset_selection or ())))
        admitted = run is not None and run_tags.get(run.tags, run_tags.ADMITTED_TAG) is not None
        lock = ProjectLock(paths.lock_file, describe=describe, leader_pid=int(leader) if leader else None,
                           running=running, admitted_run=run.run_id if admitted else None)
        return cls(settings=settings, lock=lock.__enter__(), paths=paths, instance=instance, run=run)

    def end(self, log=None) -> None:
        """Release the project, then tell the run's end (never failing the run; ``log``: the run's logger)."""
        self.lock.__exit__(None, None, None)
        if self.instance is not None and self.run is not None:
            notify_ending_run(self.instance, self.paths, self.settings, self.run, log)
