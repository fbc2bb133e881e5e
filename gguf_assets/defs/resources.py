"""The per-project config resource (points every asset at its project folder) and the hub credentials."""

import dagster as dg
from pydantic import Field, PrivateAttr

from gguf_assets.lib.materials.hub import token_from_env
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.settings import Settings, load_settings
from gguf_assets.pipeline.environment import PROJECT_ENV, project_dir_from_env


class HubResource(dg.ConfigurableResource):
    """Hugging Face hub access. The token comes from the HF_TOKEN environment variable only (set it
    in the shell that starts gguf-trainer or the daemon); it is never shown, logged or stored."""

    # Developer note: the token is read when a step needs it (read_token), in the run's own
    # process, so neither the definitions nor run storage ever hold it, and a process that runs
    # several pipelines (tests, a notebook) sees HF_TOKEN as it is at each run. (A field bound to
    # dg.EnvVar when the definitions loaded failed every later run once the variable was unset.)

    def read_token(self) -> str | None:
        return token_from_env()


class ProjectResource(dg.ConfigurableResource):
    """The project folder: materials, corpus, shards, checkpoints and outputs all live there, and its
    project.yaml holds every setting (each asset's page shows the ones it depends on). To change a
    setting, edit project.yaml and run again: only what depends on it is redone. One pipeline at a
    time writes a folder; a second one is refused and told which run holds it."""

    # Developer note: project_dir is normally empty and comes from the environment
    # (project_dir_from_env: GGUF_ASSETS_PROJECT or the folder holding DAGSTER_HOME), so run
    # storage holds no absolute path and a copied project is independent. The run's bookkeeping
    # (lock, settings snapshot, tags, dead runs, the run-end notice) is pipeline/run_bookkeeping.py's; this
    # resource only starts and ends it, the hooks Dagster calls in the run's process before any step and
    # after the last.

    project_dir: str | None = Field(default=None, description="project folder (default: from the environment)")
    hub: HubResource
    _run: object = PrivateAttr(default=None)  # run_bookkeeping.RunBookkeeping while a run executes

    def __init__(self, **data) -> None:
        data.setdefault("hub", HubResource())
        super().__init__(**data)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        from gguf_assets.pipeline.run_bookkeeping import RunBookkeeping

        self._run = RunBookkeeping.begin(context.instance, context.dagster_run, self.paths())

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._run is not None:
            self._run.end(context.log)
            self._run = None

    def paths(self) -> ProjectPaths:
        folder = self.project_dir or project_dir_from_env()
        if not folder:
            raise dg.DagsterInvariantViolationError(
                f"No project folder: set {PROJECT_ENV}, or DAGSTER_HOME=<project>/.dagster (`gguf-trainer env DIR` "
                "prints both).")
        return ProjectPaths.of(folder)

    def settings(self) -> Settings:
        """The run's settings snapshot (read once, when the run started); project.yaml outside a run."""
        return self._run.settings if self._run is not None else load_settings(self.paths().root)

    def result_written(self, context: dg.AssetExecutionContext) -> None:
        """After a stage wrote its result, observe the expected fingerprints of the stages after it again
        (defs/settings.py): the next step of this run records its inputs' versions when it starts, and those it
        reads changed now."""
        from gguf_assets.pipeline.settings_observation import observe_settings

        observe_settings(context.instance, self.settings(), self.paths(), after=context.asset_key.to_user_string())

    def stage_metadata(self, stage: str, settings: Settings | None = None) -> dict:
        """The settings table, project folder and how-to-change note for a stage asset's page."""
        from gguf_assets.pipeline.settings_observation import settings_metadata

        return settings_metadata(settings or self.settings(), stage, str(self.paths().root))
