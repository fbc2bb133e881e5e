"""The per-project config resource (points every asset at its project folder) and the hub credentials."""

import os
from pathlib import Path

import dagster as dg
from pydantic import Field, PrivateAttr

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


def project_dir_from_env() -> str | None:
    """The project folder: GGUF_ASSETS_PROJECT, else the folder that holds DAGSTER_HOME (<project>/.dagster).

    So `DAGSTER_HOME=<project>/.dagster dagster asset materialize ...` is all the Dagster CLI needs,
    and a copied project's instance always points at the copy.
    """
    if os.environ.get(PROJECT_ENV):
        return os.environ[PROJECT_ENV]
    home = os.environ.get("DAGSTER_HOME")
    if home and (Path(home).parent / PROJECT_FILE).is_file():
        return str(Path(home).resolve().parent)
    return None


class HubResource(dg.ConfigurableResource):
    """Credentials for the Hugging Face hub.

    The token is only ever set from ``dg.EnvVar("HF_TOKEN")``, so run storage keeps the variable's
    name, never its value. It is handed to the downloader and nowhere else: not logged, not in
    metadata, not written to the project folder.
    """

    token: str | None = Field(default=None, description="HF read token, from the HF_TOKEN environment variable")

    @classmethod
    def from_env(cls) -> "HubResource":
        # dg.EnvVar on an unset variable fails the run's config, but a missing token is normal
        # (public repos), so the field is bound to the variable only when it is set.
        return cls(token=dg.EnvVar(HF_TOKEN_ENV)) if os.environ.get(HF_TOKEN_ENV) else cls()


class ProjectResource(dg.ConfigurableResource):
    """The project folder; settings are read from its project.yaml at each step.

    ``project_dir`` is normally left empty: it then comes from the environment
    (:func:`project_dir_from_env`), so no absolute path is stored in run storage.
    While a run uses it, the run holds the project's lock, so a second pipeline writing
    the same folder (another CLI, a UI launch) is refused with the holder's pid and run.
    """

    project_dir: str | None = Field(default=None, description="project folder (default: from the environment)")
    hub: HubResource
    _lock: ProjectLock | None = PrivateAttr(default=None)

    def __init__(self, **data) -> None:
        data.setdefault("hub", HubResource.from_env())
        super().__init__(**data)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        run = context.dagster_run
        if context.instance is not None and run is not None:
            from gguf_assets.defs.resume import mark_interrupted_runs

            # Every entry point cleans up after a kill -9 before it starts, not only the daemon.
            mark_interrupted_runs(context.instance)
            from gguf_assets.defs.plan import settings_hash
            from gguf_assets.defs.settings import observe_settings

            settings = self.settings()
            # The materializations record the settings they were made under (data provenance).
            observe_settings(context.instance, settings)
            context.instance.add_run_tags(run.run_id, {PID_TAG: str(os.getpid()),
                                                       PID_STARTED_TAG: process_started(os.getpid()),
                                                       BOOT_TAG: boot_id(),
                                                       SETTINGS_TAG: settings_hash(settings)})
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
        return load_settings(self.paths().root)
