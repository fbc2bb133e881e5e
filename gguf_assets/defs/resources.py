"""The per-project config resource (points every asset at its project folder) and the hub credentials."""

import os
from pathlib import Path

import dagster as dg
from pydantic import Field, PrivateAttr

from gguf_assets.lib import settings_history
from gguf_assets.lib.errors import UserError
from gguf_assets.lib.layout import ProjectPaths
from gguf_assets.lib.liveness import boot_id, process_started
from gguf_assets.lib.lock import ProjectLock
from gguf_assets.lib.settings import PROJECT_FILE, Settings, load_settings

PROJECT_ENV = "GGUF_ASSETS_PROJECT"
HF_TOKEN_ENV = "HF_TOKEN"
# Tags that identify the process executing a run, so a run cut off by a kill -9 or a reboot is
# recognised (defs/resume.py). Every job runs in-process, so this process is the run's for its life.
PID_TAG = "gguf_assets/pid"
PID_STARTED_TAG = "gguf_assets/pid_started"
BOOT_TAG = "gguf_assets/boot_id"
# On the worker runs of `gguf-trainer run --workers N`: the pid of the run that launched them,
# whose project lock they share (lib/lock.py).
LEADER_TAG = "gguf_assets/leader_pid"
# The hash of the settings a run started under (defs/plan.py settings_hash).
SETTINGS_TAG = "gguf_assets/settings"


class EnvironmentMismatch(UserError, RuntimeError):
    """DAGSTER_HOME is not the instance of the project that GGUF_ASSETS_PROJECT names."""


def project_dir_from_env() -> str | None:
    """The project folder: GGUF_ASSETS_PROJECT, else the folder that holds DAGSTER_HOME (<project>/.dagster).

    So `DAGSTER_HOME=<project>/.dagster dagster asset materialize ...` is all the Dagster CLI needs,
    and a copied project's instance always points at the copy. When both are set they must belong
    together: otherwise a run would write one project's files and record itself in another's
    instance, where no status, resume or stale mark could find it.
    """
    home = os.environ.get("DAGSTER_HOME")
    if os.environ.get(PROJECT_ENV):
        project = Path(os.environ[PROJECT_ENV])
        own_home = ProjectPaths.of(project).dagster_home
        if home and (project / PROJECT_FILE).is_file() and Path(home).resolve() != own_home:
            raise EnvironmentMismatch(
                f"DAGSTER_HOME={home} is not the instance of the project {PROJECT_ENV}={project} (that is "
                f"{own_home}). Set both for one project: "
                f"`eval \"$(gguf-trainer env {project})\"`, or unset {PROJECT_ENV} to use the project that holds "
                "DAGSTER_HOME.")
        return str(project)
    if home and (Path(home).parent / PROJECT_FILE).is_file():
        return str(Path(home).resolve().parent)
    return None


class HubResource(dg.ConfigurableResource):
    """Hugging Face hub access. The token comes from the HF_TOKEN environment variable only (set it
    in the shell that starts gguf-trainer or the daemon); it is never shown, logged or stored."""

    # Developer note: the token is read when a step needs it (read_token), in the run's own
    # process, so neither the definitions nor run storage ever hold it, and a process that runs
    # several pipelines (tests, a notebook) sees HF_TOKEN as it is at each run. (A field bound to
    # dg.EnvVar when the definitions loaded failed every later run once the variable was unset.)

    def read_token(self) -> str | None:
        return os.environ.get(HF_TOKEN_ENV) or None


class ProjectResource(dg.ConfigurableResource):
    """The project folder: materials, corpus, shards, checkpoints and outputs all live there, and its
    project.yaml holds every setting (each asset's page shows the ones it depends on). To change a
    setting, edit project.yaml and run again: only what depends on it is redone. One pipeline at a
    time writes a folder; a second one is refused and told which run holds it."""

    # Developer note: project_dir is normally empty and comes from the environment
    # (project_dir_from_env: GGUF_ASSETS_PROJECT or the folder holding DAGSTER_HOME), so run
    # storage holds no absolute path and a copied project is independent.

    project_dir: str | None = Field(default=None, description="project folder (default: from the environment)")
    hub: HubResource
    _lock: ProjectLock | None = PrivateAttr(default=None)
    _settings: Settings | None = PrivateAttr(default=None)

    def __init__(self, **data) -> None:
        data.setdefault("hub", HubResource())
        super().__init__(**data)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        run = context.dagster_run
        if context.instance is not None and run is not None:
            from gguf_assets.defs.resume import mark_interrupted_runs

            # Every entry point cleans up after a kill -9 before it starts, not only the daemon.
            mark_interrupted_runs(context.instance)
            from gguf_assets.defs.settings import observe_settings

            # One snapshot for the whole run: an edit of project.yaml while it runs is for the next run.
            settings = self._settings = self._settings_of(run)
            # The materializations record the settings they were made under (data provenance).
            observe_settings(context.instance, settings, self.paths())
            context.instance.add_run_tags(run.run_id, {PID_TAG: str(os.getpid()),
                                                       PID_STARTED_TAG: process_started(os.getpid()),
                                                       BOOT_TAG: boot_id(),
                                                       SETTINGS_TAG: settings_history.settings_hash(settings)})
        describe = f"Dagster run {run.run_id[:8]} of {run.job_name}" if run is not None else ""
        leader = run.tags.get(LEADER_TAG) if run is not None else None
        self._lock = ProjectLock(self.paths().lock_file, describe=describe,
                                 leader_pid=int(leader) if leader else None).__enter__()

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def paths(self) -> ProjectPaths:
        folder = self.project_dir or project_dir_from_env()
        if not folder:
            raise dg.DagsterInvariantViolationError(
                f"No project folder: set {PROJECT_ENV}, or DAGSTER_HOME=<project>/.dagster (`gguf-trainer env DIR` "
                "prints both).")
        return ProjectPaths.of(folder)

    def settings(self) -> Settings:
        """The run's settings snapshot (read once, when the run started); project.yaml outside a run."""
        return self._settings if self._settings is not None else load_settings(self.paths().root)

    def _settings_of(self, run: dg.DagsterRun) -> Settings:
        """A run of a pipeline (`gguf-trainer run`, the resume sensor) uses the snapshot the pipeline
        started with, named by its tag; any other run reads project.yaml now, once."""
        from gguf_assets.defs.plan import PIPELINE_TAG

        snapshot = settings_history.recall(self.paths().root, run.tags.get(PIPELINE_TAG))
        return snapshot if snapshot is not None else load_settings(self.paths().root)

    def stage_metadata(self, stage: str, settings: Settings | None = None) -> dict:
        """The settings table, project folder and how-to-change note for a stage asset's page."""
        from gguf_assets.defs.settings import settings_metadata

        return settings_metadata(settings or self.settings(), stage, str(self.paths().root))
