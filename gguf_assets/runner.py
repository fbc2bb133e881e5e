"""`gguf-trainer run`: a thin client of the project's Dagster instance.

What is left to do is decided by one function, defs/plan.py's ``next_work``, from the project
status (the fingerprints each stage owns, composed in lib/status/states.py): the next named job
(defs/jobs.py) and the shard partitions it covers. `run` executes those jobs in-process until
nothing is left; the daemon's resume sensor (defs/resume.py) requests the very same jobs, one at a
time.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from gguf_assets import DEFINITIONS_MODULE
from gguf_assets.cluster import OUTAGE_S  # how long a cluster's Postgres or Redis may be away
from gguf_assets.defs.plan import Work, next_work, split_range
from gguf_assets.defs.run_tags import LEADER_TAG, STOPPED_TAG, WORKER_TAG
from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.core.lock import ProjectLock
from gguf_assets.lib.precompute.half_state import HalfState
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings, load_settings
from gguf_assets.lib.status.states import StageState, State, project_status

log = logging.getLogger(__name__)

DAGSTER_YAML = "dagster.yaml"
CODE_LOCATION = DEFINITIONS_MODULE  # the name dagster-webserver and dagster-daemon give `-m` (the module's)
POLL_S = 1.0
REPORT_EVERY_S = 10.0
MAX_LOST_WORKERS = 3  # cluster runs cut off by a dead worker, planned again before the pipeline gives up


class PipelineFailed(RuntimeError):
    pass


def prepare_instance(paths: ProjectPaths) -> Path:
    """Put the instance config into <project>/.dagster and point this process at it.

    The config holds no path (every folder is `env: DAGSTER_HOME`), so a copied or moved project
    folder is its own instance as soon as DAGSTER_HOME points into it.
    """
    home = paths.dagster_home
    home.mkdir(parents=True, exist_ok=True)
    from gguf_assets.cluster import instance_config, load_cluster

    template = resources.files("gguf_assets").joinpath(DAGSTER_YAML).read_text(encoding="utf-8")
    cluster = load_cluster(paths.root)
    template = instance_config(template, cluster)  # Postgres when cluster.yaml says so
    target = home / DAGSTER_YAML
    if not target.is_file() or target.read_text(encoding="utf-8") != template:
        atomic.write_text(target, template)
    os.environ.update(instance_env(paths))
    if cluster is None:  # Postgres makes its tables in transactions of its own; SQLite's first open races
        _create_storage_once(home)
    return home


STORAGE_CREATED = ".storage-created"  # in <project>/.dagster: the instance's tables exist


def _create_storage_once(home: Path) -> None:
    """Create the instance's storage before anyone else opens it, one process at a time.

    Dagster creates its SQLite tables (and stamps their alembic version) on first open, unguarded: two
    processes opening a new instance at once collide ("table alembic_version already exists", "more than
    one head"). Every gguf-trainer entry point comes through here first; the Dagster CLI, webserver and
    daemon started on a project that gguf-trainer has opened once find the tables made.
    """
    if (home / STORAGE_CREATED).is_file():
        return
    import fcntl

    with open(home / ".storage-create.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also by a kill -9
        if (home / STORAGE_CREATED).is_file():
            return
        import dagster as dg

        dg.DagsterInstance.get().dispose()
        atomic.write_text(home / STORAGE_CREATED, "")


def size_gpu_pool(instance) -> int:
    """One `gpu` pool slot per GPU (1 on a CPU machine), so queued GPU runs never share a card."""
    from gguf_assets.defs.precompute import GPU_POOL
    from gguf_assets.lib.telemetry.hardware import gpu_snapshot

    slots = max(1, len(gpu_snapshot()))
    instance.event_log_storage.set_concurrency_slots(GPU_POOL, slots)
    return slots


def instance_env(paths: ProjectPaths) -> dict[str, str]:
    """What the Dagster CLI, webserver and daemon need to work on this project."""
    from gguf_assets.defs.environment import PROJECT_ENV

    return {"DAGSTER_HOME": str(paths.dagster_home), PROJECT_ENV: str(paths.root)}


def _was_interrupted(instance, run_id: str) -> bool:
    """Did the run fail because this process got SIGINT/SIGTERM? (Dagster's own handler catches it in a step.)"""
    import dagster as dg

    return any(getattr(getattr(r.event_log_entry.dagster_event.event_specific_data, "error", None), "cls_name", "")
               == "DagsterExecutionInterruptedError"
               for r in instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records)


_KILLED_BY = re.compile(r"was terminated by signal (\d+) \((\w+)\)")


def failure_message(instance, run_id: str) -> str:
    import dagster as dg

    from gguf_assets.defs.console import user_message

    for record in instance.get_records_for_run(run_id, of_type={dg.DagsterEventType.STEP_FAILURE,
                                                                dg.DagsterEventType.RUN_FAILURE}).records:
        event = record.event_log_entry.dagster_event
        data = event.event_specific_data
        error = getattr(data, "error", None)
        if event.event_type == dg.DagsterEventType.STEP_FAILURE and error is not None:
            return f"{event.step_key}: {user_message(error)}"
    # No step failed: the run's process died. Dagster's code server says how, in an engine event.
    for record in instance.get_records_for_run(run_id, of_type={dg.DagsterEventType.ENGINE_EVENT}).records:
        found = _KILLED_BY.search(record.event_log_entry.dagster_event.message or "")
        if found:
            return f"its process was killed (signal {found.group(1)}, {found.group(2)})"
    return "the run failed"


class _StopRequest:
    """A stop on purpose: Ctrl-C, SIGTERM (systemd stop, kill), or Terminate in the Dagster UI.

    Each ends the current run CANCELED, as Dagster does for a run it terminates itself: Dagster
    records an interrupted run as canceled when the run is CANCELING at that moment, so a signal
    marks the run CANCELING, and Terminate in the UI (which marks it CANCELING but cannot reach an
    in-process run) is seen here by polling the run's status, and turned into an interrupt.

    Dagster's own handler raises inside whatever code runs when the signal lands; in a
    garbage-collector callback that exception is swallowed and the stop is lost. So the signal is
    also seen through the wakeup fd by a watcher thread, which delivers SIGINT again every 2 s
    until the pipeline has stopped.
    """

    RESEND_S = 2.0
    POLL_S = 1.0

    def __init__(self, instance=None) -> None:
        self.asked = False
        self.by = ""  # what asked: "Ctrl-C", "SIGTERM" or "Terminate in the Dagster UI"
        self.instance = instance
        self.run_id: str | None = None  # the run this process executes now
        self._over = threading.Event()

    def _interrupt(self, signum, _frame):
        self.asked = True
        self.by = self.by or _SIGNAL_NAMES.get(signum, "a signal")
        raise KeyboardInterrupt

    def _run_status(self):
        if self.instance is None or self.run_id is None:
            return None
        try:
            run = self.instance.get_run_by_id(self.run_id)
        except Exception:  # noqa: BLE001  storage unreadable for now (a full disk): the run itself reports that
            return None
        return run.status if run is not None else None

    def _mark_canceling(self) -> None:
        import dagster as dg

        run = self.instance.get_run_by_id(self.run_id) if self.instance and self.run_id else None
        if run is not None and run.status in (dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING):
            self.instance.report_run_canceling(run, message=f"Stopped on purpose ({self.by}).")

    def _watch(self, read_fd: int) -> None:
        import select

        import dagster as dg

        while not self._over.is_set():
            ready, _, _ = select.select([read_fd], [], [], self.POLL_S)
            if self._over.is_set():
                return
            if ready:
                data = os.read(read_fd, 64)
                if not data:
                    return
                signals = [b for b in data if b in (signal.SIGINT, signal.SIGTERM)]
                if not signals:
                    continue
                self.asked = True
                self.by = self.by or _SIGNAL_NAMES[signals[0]]
                self._mark_canceling()
            elif self._run_status() == dg.DagsterRunStatus.CANCELING:
                self.asked, self.by = True, self.by or "Terminate in the Dagster UI"
                os.kill(os.getpid(), signal.SIGINT)
            else:
                continue
            while not self._over.wait(self.RESEND_S):
                os.kill(os.getpid(), signal.SIGINT)
            return

    def record_cancel(self, run_id: str) -> None:
        """The run this stop cut short is CANCELED, never a failure (a signal may have beaten the mark)."""
        import dagster as dg

        run = self.instance.get_run_by_id(run_id)
        if run is not None and run.status != dg.DagsterRunStatus.CANCELED:
            self.instance.report_run_canceled(run, message=f"Stopped on purpose ({self.by or 'a stop'}); "
                                              "`gguf-trainer run` continues from the last finished shard and "
                                              "checkpoint.")

    @contextmanager
    def installed(self) -> Iterator["_StopRequest"]:
        if threading.current_thread() is not threading.main_thread():  # e.g. inside a test runner thread
            yield self
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        previous = {sig: signal.signal(sig, self._interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
        watcher = threading.Thread(target=self._watch, args=(read_fd,), name="stop-watcher", daemon=True)
        watcher.start()
        try:
            yield self
        finally:
            self._over.set()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_fd)
            os.write(write_fd, b"\0")  # wakes the watcher so it can end
            watcher.join(timeout=5)
            os.close(write_fd)
            os.close(read_fd)


_SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@contextmanager
def _stop_tags_the_latest_run(instance) -> Iterator[None]:
    """A stop on purpose (Ctrl-C, SIGTERM) tags the project's latest run as stopped, wherever it
    landed: inside a run, or between two (a run had just succeeded). The daemon's resume sensor
    then leaves the pipeline for the user to continue (defs/resume.py). The lock is still held."""
    try:
        yield
    except KeyboardInterrupt:
        latest = next(iter(instance.get_run_records(limit=1)), None)
        if latest is not None and STOPPED_TAG not in latest.dagster_run.tags:
            instance.add_run_tags(latest.dagster_run.run_id, {STOPPED_TAG: "true"})
        raise


def run_pipeline(paths: ProjectPaths, *, echo: Callable[[str], None] = print, workers: int | None = None,
                 cancel_on_stop: bool = False) -> list[StageState]:
    """Materialize everything missing or stale through the project's Dagster instance; returns the final status.

    ``workers`` > 1 runs each split's shards as that many Dagster runs at once, launched by the
    instance's run launcher; they join this pipeline, each holding a lock of its own while it writes
    (lib/core/lock.py). On a cluster with Celery workers (cluster.yaml) every job is launched to the
    workers' queues and followed; shards are split into ``workers`` ranges (default: as many as
    workers answer). A stop (Ctrl-C) there stops following, and the runs go on, unless
    ``cancel_on_stop``.
    """
    from gguf_assets.cluster import load_cluster

    cluster = load_cluster(paths.root)
    on_workers = cluster is not None and cluster.runs_on_workers
    prepare_instance(paths)
    import dagster as dg

    from gguf_assets.defs.private_api import execute_run, recon_job_from_origin
    from gguf_assets.defs.resume import mark_interrupted_runs
    from gguf_assets.defs.settings import observe_settings

    instance = dg.DagsterInstance.get()
    size_gpu_pool(instance)
    with _StopRequest(instance).installed() as stop, \
            ProjectLock(paths.lock_file, describe=f"gguf-trainer run {paths.root.name}"), \
            _stop_tags_the_latest_run(instance), _workspace(instance, in_process=True) as workspace:
        marked = mark_interrupted_runs(instance)
        if marked:
            echo(f"marked {len(marked)} run(s) cut off by a kill or reboot as failed; resuming where they stopped")
        # Read once: every job of this pipeline loads this snapshot by its tag (defs/resources.py), so an
        # edit of project.yaml while it runs affects only the next run.
        settings = load_settings(paths.root)
        settings_history.remember(paths.root, settings)
        observe_settings(instance, settings, paths)  # the UI's stale marks follow project.yaml as of now
        # A typo in a prompt file path should fail in seconds, not after a teacher download.
        from gguf_assets.lib.corpus.prompt_files import check_prompt_files

        check_prompt_files(paths, settings)
        done: set[Work] = set()
        lost = 0
        while (work := next_work(paths, settings, instance)) is not None:
            if stop.asked:  # a stop that Dagster's handler swallowed while the last job finished
                raise KeyboardInterrupt
            if work in done:
                raise PipelineFailed(f"{work.describe()} ran successfully but is still not current; see "
                                     f"`{trainer('status', paths.root)}`")
            if on_workers:
                if not _run_on_workers(paths, instance, workspace, work, settings, workers, echo,
                                       cancel_on_stop=cancel_on_stop):
                    lost += 1
                    if lost > MAX_LOST_WORKERS:
                        raise PipelineFailed(f"workers were lost {lost} times; check them (`celery inspect ping`, "
                                             f"their logs), then `{trainer('run', paths.root)}` continues.")
                    continue  # planned again: the lost runs' shards go back to the queue
            elif (workers or 1) > 1 and len(work.partitions) > 1:
                _run_workers(paths, instance, work, settings, workers, echo)
            else:
                echo(f"→ {work.describe()}")
                run = _create_run(workspace, work, work.tags(settings))
                stop.run_id = run.run_id
                result = execute_run(recon_job_from_origin(run.job_code_origin), run, instance)
                stop.run_id = None
                if not result.success and (stop.asked or _was_interrupted(instance, result.run_id)):
                    stop.record_cancel(result.run_id)
                    raise KeyboardInterrupt  # stopped on purpose (tagged by _stop_tags_the_latest_run)
                if not result.success:
                    raise PipelineFailed(f"{failure_message(instance, result.run_id)}\nThe full log, stack trace "
                                         f"included: `{trainer('ui', paths.root)}`, run {result.run_id[:8]}.")
            done.add(work)
        status = project_status(paths, settings)
        blocked = [s for s in status if s.state == State.BLOCKED]
        if blocked and all(s.detail.startswith("precompute.mode") for s in blocked):
            echo(f"not running {', '.join(s.stage for s in blocked)}: {blocked[0].detail}")
        _tell_about_edits(paths, settings, instance, echo)
        return status


def _tell_about_edits(paths: ProjectPaths, settings: Settings, instance, echo: Callable[[str], None]) -> None:
    """project.yaml edited while the pipeline ran: say so, and let the UI's stale marks follow the edit."""
    from gguf_assets.defs.settings import observe_settings
    from gguf_assets.lib.project.settings import SettingsError

    try:
        now = load_settings(paths.root)
    except SettingsError as exc:
        echo(f"project.yaml was edited during the run and is not valid now: {exc}")
        return
    edits = settings_history.changed_keys(settings, now, lambda s: s.to_dict())
    if edits:
        echo(f"project.yaml changed during the run ({', '.join(edits)}): this run finished under the settings it "
             f"started with; the edit applies to the next run (`{trainer('run', paths.root)}`)")
        observe_settings(instance, now, paths)


@contextmanager
def _workspace(instance, *, in_process: bool) -> Iterator:
    """The project's code location, under the name the webserver and daemon give it.

    Runs are created from it, so they carry its origin: the UI's Overview timeline, the job
    pages and "Re-execute" find them, whichever entry point started them. ``in_process`` loads
    the definitions already imported here; otherwise a code server is started, which the run
    launcher needs to start runs in their own processes.
    """
    from gguf_assets.defs.private_api import (
        InProcessCodeLocationOrigin,
        InProcessWorkspaceLoadTarget,
        LoadableTargetOrigin,
        ModuleTarget,
        WorkspaceProcessContext,
    )

    if in_process:
        target = InProcessWorkspaceLoadTarget(InProcessCodeLocationOrigin(
            LoadableTargetOrigin(executable_path=sys.executable, module_name=DEFINITIONS_MODULE),
            location_name=CODE_LOCATION))
    else:
        target = ModuleTarget(module_name=DEFINITIONS_MODULE, attribute=None, working_directory=None,
                              location_name=CODE_LOCATION)
    # The code server's own INFO lines (start, "Stopping server…", in colour) are not the user's news.
    with WorkspaceProcessContext(instance, target, code_server_log_level="WARNING") as process_context:
        yield process_context.create_request_context()


def _create_run(workspace, work: Work, tags: dict[str, str]):
    """A run of ``work``'s job for its assets, created from the code location (so it has an origin)."""
    import dagster as dg

    from gguf_assets.defs.jobs import CONSOLE
    from gguf_assets.defs.private_api import JobSubsetSelector

    location = workspace.get_code_location(CODE_LOCATION)
    repo = next(iter(location.get_repositories().values()))
    assets = frozenset(dg.AssetKey(a) for a in work.assets)
    remote_job = location.get_job(JobSubsetSelector(location_name=CODE_LOCATION, repository_name=repo.name,
                                                    job_name=work.job, op_selection=None, asset_selection=assets))
    plan = location.get_execution_plan(remote_job, CONSOLE, step_keys_to_execute=None, known_state=None,
                                       instance=workspace.instance)
    return workspace.instance.create_run(
        job_name=work.job, run_id=None, run_config=CONSOLE, resolved_op_selection=None,
        step_keys_to_execute=plan.execution_plan_snapshot.step_keys_to_execute, op_selection=None,
        status=None, root_run_id=None, parent_run_id=None, tags={**remote_job.tags, **tags},
        job_snapshot=remote_job.job_snapshot, execution_plan_snapshot=plan.execution_plan_snapshot,
        parent_job_snapshot=remote_job.parent_job_snapshot, remote_job_origin=remote_job.get_remote_origin(),
        job_code_origin=remote_job.get_python_origin(), asset_selection=assets, asset_check_selection=None,
        asset_graph=repo.asset_graph)


def _run_workers(paths: ProjectPaths, instance, work: Work, settings: Settings, workers: int,
                 echo: Callable[[str], None]) -> None:
    """Launch one Dagster run per contiguous shard range through the instance's run launcher; wait for all.

    The launcher starts each run in its own process under a code server that this process
    starts, so the runs are this pipeline's descendants and share its lock. Each keeps torch's
    default thread count: CPU matmul results depend on it, and shards must be byte-identical
    whatever the number of workers.
    """
    import dagster as dg

    ranges = split_range(work.partitions, workers)
    with _workspace(instance, in_process=False) as workspace:
        run_ids = []
        try:
            for keys in ranges:
                run = _create_run(workspace, work, {**work.tags(settings, keys), LEADER_TAG: str(os.getpid()),
                                                    WORKER_TAG: f"{len(run_ids) + 1}/{len(ranges)}"})
                instance.launch_run(run.run_id, workspace)
                run_ids.append(run.run_id)
                echo(f"→ {work.job} shards {keys[0]}..{keys[-1]} as run {run.run_id[:8]} "
                     f"(worker {len(run_ids)}/{len(ranges)})")
            _wait_for_runs(instance, run_ids, echo)
        except KeyboardInterrupt:
            for run_id in run_ids:
                if not instance.get_run_by_id(run_id).is_finished:
                    instance.run_launcher.terminate(run_id)
            raise
    failed = [instance.get_run_by_id(r) for r in run_ids]
    failed = [run for run in failed if run.status != dg.DagsterRunStatus.SUCCESS]
    if failed:
        split = "train" if "train" in work.assets[0] else "val"
        lines = [_worker_failure(paths, settings, instance, run, split) for run in failed]
        raise PipelineFailed("\n".join(lines) + f"\nThe shards finished so far are kept (the other workers' too); "
                             f"`{trainer('run', paths.root)}` continues with the rest. Logs: "
                             f"`{trainer('ui', paths.root)}`.")


def _run_on_workers(paths: ProjectPaths, instance, workspace, work: Work, settings: Settings, workers: int | None,
                    echo: Callable[[str], None], *, cancel_on_stop: bool) -> bool:
    """On a cluster: launch ``work`` as runs to the Celery workers' queue, admitted to this pipeline, and
    follow them. True when all succeeded; False when a worker died under one (its shards are planned
    again); a run that failed on its own ends the pipeline with its reason."""
    import dagster as dg

    from gguf_assets.cluster import GPU_QUEUE, QUEUE_TAG
    from gguf_assets.defs.run_tags import ADMITTED_TAG, INTERRUPTED_TAG
    from gguf_assets.lib.core.lock import admit_runs

    location = workspace.get_code_location(CODE_LOCATION)
    queue = next(iter(location.get_repositories().values())).get_full_job(work.job).tags.get(QUEUE_TAG, GPU_QUEUE)
    parts = workers or max(1, len(through_outages(lambda: instance.run_launcher.live_workers(queue), echo)))
    ranges = split_range(work.partitions, parts) if work.partitions else [None]
    runs = []
    for index, keys in enumerate(ranges, 1):
        worker = {WORKER_TAG: f"{index}/{len(ranges)}"} if len(ranges) > 1 else {}
        runs.append(_create_run(workspace, work, {**work.tags(settings, keys), ADMITTED_TAG: "true", **worker}))
    admit_runs(paths.lock_file, [run.run_id for run in runs])  # before any worker can start one
    for run, keys in zip(runs, ranges):
        through_outages(lambda: instance.launch_run(run.run_id, workspace), echo)
        shards = f" shards {keys[0]}..{keys[-1]}" if keys else ""
        echo(f"→ {work.job}{shards} as run {run.run_id[:8]} on the workers' `{queue}` queue")
    run_ids = [run.run_id for run in runs]
    try:
        _wait_for_runs(instance, run_ids, echo, cluster=True)
    except KeyboardInterrupt:
        going = [r for r in run_ids if not instance.get_run_by_id(r).is_finished]
        if cancel_on_stop:
            for run_id in going:
                instance.run_launcher.terminate(run_id)
            echo(f"cancelled {len(going)} run(s) on the workers")
        elif going:
            echo(f"stopped following; {len(going)} run(s) go on on the workers ({', '.join(r[:8] for r in going)}): "
                 f"`{trainer('status', paths.root)}` shows what they finished, Terminate in the Dagster UI stops them")
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
    lines = [_worker_failure(paths, settings, instance, run, split) if split else
             f"run {run.run_id[:8]} of {work.job}: {failure_message(instance, run.run_id)}" for run in failed]
    raise PipelineFailed("\n".join(lines) + f"\nWhat finished is kept; `{trainer('run', paths.root)}` continues. "
                         f"Logs: `{trainer('ui', paths.root)}`.")


def _worker_failure(paths: ProjectPaths, settings: Settings, instance, run, split: str) -> str:
    """One line for a failed worker run: which worker, its shards, the shard it stopped at, and why."""
    from gguf_assets.defs import run_tags
    from gguf_assets.lib.materials.materials import load_manifest
    from gguf_assets.lib.precompute.shards import plan_shards, shard_status

    start, end = run_tags.get(run.tags, run_tags.RANGE_START_TAG), run_tags.get(run.tags, run_tags.RANGE_END_TAG)
    plans = [p for p in plan_shards(paths, settings, load_manifest(paths), split) if start <= p.key <= end]
    at = next((p.key for p in plans if set(shard_status(paths, settings, p).values()) != {HalfState.CURRENT}), None)
    why = ("its process was killed" if run_tags.INTERRUPTED_TAG in run.tags
           else failure_message(instance, run.run_id))
    where = f", at shard {split}/{at}" if at else ""
    return (f"worker {run_tags.get(run.tags, WORKER_TAG) or '?'} (run {run.run_id[:8]}, {split} shards "
            f"{start}..{end}) stopped{where}: {why}")


def _wait_for_runs(instance, run_ids: list[str], echo: Callable[[str], None], *, cluster: bool = False) -> None:
    """Until every run has ended. On a ``cluster`` a Postgres or Redis restart is ridden out (through_outages);
    the embedded SQLite's errors (a full disk, a damaged file) are the CLI's to report at once."""
    from gguf_assets.defs.resume import mark_interrupted_runs

    def poll():
        mark_interrupted_runs(instance)  # a worker killed -9 never ends its run: it is marked, so the wait ends
        return [instance.get_run_by_id(r) for r in run_ids]

    last_report = time.monotonic()
    while True:
        runs = through_outages(poll, echo) if cluster else poll()
        if all(r.is_finished for r in runs):
            return
        if time.monotonic() - last_report >= REPORT_EVERY_S:
            echo("waiting for " + ", ".join(f"run {r.run_id[:8]} ({r.status.value.lower()})"
                                            for r in runs if not r.is_finished))
            last_report = time.monotonic()
        time.sleep(POLL_S)


def through_outages(call: Callable, echo: Callable[[str], None]):
    """``call()``, again every 2 s while the cluster's broker is away, for up to OUTAGE_S; then one clear line.

    A restart of Redis or Postgres lasts seconds: following the runs should outlive it, and the runs on the workers go
    on meanwhile. Postgres calls ride out a restart inside the storage itself (defs/cluster_workers.py, in every
    process: this one, the workers' runs, the UI), so a lost Postgres connection that reaches here has lasted
    OUTAGE_S already: one line, at once."""
    from gguf_assets.defs.cluster_workers import broker_errors, connection_lost, reason

    errors = broker_errors()
    began = None
    while True:
        try:
            answer = call()
        except errors as exc:
            first = _first_line(exc)
            if began is None:
                began = time.monotonic()
                echo(f"lost the connection to the cluster's broker ({first}); trying again for up to "
                     f"{OUTAGE_S:.0f} s")
            elif time.monotonic() - began > OUTAGE_S:
                raise PipelineFailed(f"the cluster's broker has not answered for {OUTAGE_S:.0f} s ({first}). The "
                                     "runs on the workers go on; when Redis is back, `gguf-trainer run` "
                                     "continues.") from None
            time.sleep(2.0)
            continue
        except Exception as exc:
            if connection_lost(exc):
                raise PipelineFailed(f"the cluster's Postgres has not answered for {OUTAGE_S:.0f} s ({reason(exc)}). "
                                     "What the workers finished is kept; when Postgres is back, `gguf-trainer run` "
                                     "continues.") from None
            raise
        if began is not None:
            echo(f"connected again after {time.monotonic() - began:.0f} s")
        return answer


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
