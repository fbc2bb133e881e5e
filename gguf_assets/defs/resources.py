"""The per-project config resource (points every asset at its project folder) and the hub credentials."""

import os

import dagster as dg
from pydantic import Field, PrivateAttr

from gguf_assets.lib.layout import ProjectPaths
from gguf_assets.lib.liveness import boot_id
from gguf_assets.lib.lock import ProjectLock
from gguf_assets.lib.settings import Settings, load_settings

PROJECT_ENV = "GGUF_ASSETS_PROJECT"
# Runs launched as parallel workers of a pipeline carry its lock token and join its lock.
LOCK_TOKEN_TAG = "gguf_assets/lock_token"
HF_TOKEN_ENV = "HF_TOKEN"


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

    While a run uses it, the run holds the project's lock, so a second pipeline writing
    the same folder (another CLI, a UI launch) is refused with the holder's pid.
    ``hub`` defaults to :meth:`HubResource.from_env`, so every place that builds this resource
    (definitions.py, the runner) reads the token the same way.
    """

    project_dir: str
    hub: HubResource
    _lock: ProjectLock | None = PrivateAttr(default=None)

    def __init__(self, **data) -> None:
        data.setdefault("hub", HubResource.from_env())
        super().__init__(**data)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        token = context.dagster_run.tags.get(LOCK_TOKEN_TAG) if context.dagster_run else None
        self._lock = ProjectLock(self.paths().lock_file, join_token=token).__enter__()
        # Tag the run with this worker's pid and boot id, so a run cut off by a kill -9 or a
        # reboot can be recognised and marked failed later (defs/resume.py).
        if context.instance is not None and context.run_id:
            from gguf_assets.defs.resume import BOOT_TAG, PID_TAG

            context.instance.add_run_tags(context.run_id, {PID_TAG: str(os.getpid()), BOOT_TAG: boot_id()})

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._lock is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def paths(self) -> ProjectPaths:
        return ProjectPaths.of(self.project_dir)

    def settings(self) -> Settings:
        return load_settings(self.paths().root)
