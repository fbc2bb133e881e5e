"""The per-project config resource: points every asset at its project folder."""

import os

import dagster as dg
from pydantic import PrivateAttr

from gguf_assets.lib.layout import ProjectPaths
from gguf_assets.lib.liveness import boot_id
from gguf_assets.lib.lock import ProjectLock
from gguf_assets.lib.settings import Settings, load_settings

PROJECT_ENV = "GGUF_ASSETS_PROJECT"


class ProjectResource(dg.ConfigurableResource):
    """The project folder; settings are read from its project.yaml at each step.

    While a run uses it, the run holds the project's lock, so a second pipeline writing
    the same folder (another CLI, a UI launch) is refused with the holder's pid.
    """

    project_dir: str
    _lock: ProjectLock | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._lock = ProjectLock(self.paths().lock_file).__enter__()
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
