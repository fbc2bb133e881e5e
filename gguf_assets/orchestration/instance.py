"""The project's Dagster instance and code location: its config in <project>/.dagster, the storage made once, the
gpu pool sized to the machine, and runs created from the code location (so the UI finds them)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import dagster as dg

from gguf_assets import DEFINITIONS_MODULE
from gguf_assets.lib.core import atomic
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.telemetry.hardware import gpu_snapshot
from gguf_assets.orchestration.cluster import instance_config, load_cluster
from gguf_assets.pipeline.environment import PROJECT_ENV
from gguf_assets.pipeline.names import CONSOLE, GPU_POOL
from gguf_assets.pipeline.plan import Work
from gguf_assets.pipeline.private_api import (
    InProcessCodeLocationOrigin,
    InProcessWorkspaceLoadTarget,
    JobSubsetSelector,
    LoadableTargetOrigin,
    ModuleTarget,
    WorkspaceProcessContext,
    reuse_sqlite_engines,
)

DAGSTER_YAML = "dagster.yaml"
CODE_LOCATION = DEFINITIONS_MODULE  # the name dagster-webserver and dagster-daemon give `-m` (the module's)


def prepare_instance(paths: ProjectPaths) -> Path:
    """Put the instance config into <project>/.dagster and point this process at it.

    The config holds no path (every folder is `env: DAGSTER_HOME`), so a copied or moved project
    folder is its own instance as soon as DAGSTER_HOME points into it.
    """
    home = paths.dagster_home
    home.mkdir(parents=True, exist_ok=True)

    template = resources.files("gguf_assets").joinpath(DAGSTER_YAML).read_text(encoding="utf-8")
    cluster = load_cluster(paths.root)
    template = instance_config(template, cluster)  # Postgres when cluster.yaml says so
    target = home / DAGSTER_YAML
    if not target.is_file() or target.read_text(encoding="utf-8") != template:
        atomic.write_text(target, template)
    os.environ.update(instance_env(paths))
    if cluster is None:  # Postgres makes its tables in transactions of its own; SQLite's first open races
        reuse_sqlite_engines()
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

        dg.DagsterInstance.get().dispose()
        atomic.write_text(home / STORAGE_CREATED, "")


def size_gpu_pool(instance) -> int:
    """One `gpu` pool slot per GPU (1 on a CPU machine), so queued GPU runs never share a card."""
    slots = max(1, len(gpu_snapshot()))
    instance.event_log_storage.set_concurrency_slots(GPU_POOL, slots)
    return slots


def instance_env(paths: ProjectPaths) -> dict[str, str]:
    """What the Dagster CLI, webserver and daemon need to work on this project."""
    return {"DAGSTER_HOME": str(paths.dagster_home), PROJECT_ENV: str(paths.root)}


@contextmanager
def open_workspace(instance, *, in_process: bool) -> Iterator:
    """The project's code location, under the name the webserver and daemon give it.

    Runs are created from it, so they carry its origin: the UI's Overview timeline, the job
    pages and "Re-execute" find them, whichever entry point started them. ``in_process`` loads
    the definitions already imported here; otherwise a code server is started, which the run
    launcher needs to start runs in their own processes.
    """
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


def create_run(workspace, work: Work, tags: dict[str, str]):
    """A run of ``work``'s job for its assets, created from the code location (so it has an origin)."""
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
