"""The one Definitions object (what workspace.yaml and `dagster -m` load).

The project folder comes from the environment (GGUF_ASSETS_PROJECT, or the folder holding
DAGSTER_HOME), which gguf-trainer sets; the per-project resource hands it to every asset.
The settings are observable source assets (defs/settings.py), so an edit of project.yaml shows
as stale in the UI at the next observation, without reloading these definitions.
"""

import os

import dagster as dg

from gguf_assets.defs import corpus, materials, output, precompute, training
from gguf_assets.defs.console import short_console
from gguf_assets.defs.jobs import JOBS
from gguf_assets.defs.output import exported_files_unchanged, reported_files_unchanged
from gguf_assets.defs.precompute import SHARD_CHECKS
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.defs.sensors import interrupted_runs_sensor, resume_sensor
from gguf_assets.defs.settings import SETTINGS_ASSETS
from gguf_assets.lib.core import faults
from gguf_assets.lib.project.settings import PROJECT_FILE, SettingsError, load_settings
from gguf_assets.pipeline.environment import EnvironmentMismatch, let_step_lines_reach_the_console, project_dir_from_env
from gguf_assets.pipeline.private_api import reuse_sqlite_engines


def build_definitions(project_dir: str | None) -> dg.Definitions:
    assets = [*dg.load_assets_from_modules([materials, corpus, precompute, training, output]), *SETTINGS_ASSETS]
    auto_resume = True
    if project_dir and os.path.isfile(os.path.join(project_dir, PROJECT_FILE)):
        try:
            auto_resume = load_settings(project_dir).output.auto_resume
        except SettingsError:
            # No setting may turn the code location into an error (every asset page would show "–"):
            # the message (file:line, the fix) shows where the settings are read, in the resume
            # sensor's skip reason and each settings/<stage> observation, and fails any run at once.
            pass
    return dg.Definitions(
        assets=assets,
        asset_checks=[*SHARD_CHECKS, exported_files_unchanged, reported_files_unchanged],
        jobs=JOBS,
        sensors=[interrupted_runs_sensor(running=auto_resume), resume_sensor(running=auto_resume)],
        # The folder comes from the environment at run time, so run storage holds no path.
        resources={"project": ProjectResource()},
        loggers={"console": short_console},
        # In-process: a run is one process from start to end (its pid identifies it to the
        # interrupted-runs sensor), and GPU work never runs in a child that outlives a killed worker.
        executor=dg.in_process_executor,
    )


def _project_dir() -> str | None:
    try:
        return project_dir_from_env()
    except EnvironmentMismatch as exc:
        # Refuse to start, before any run writes one project's files into another's records: one
        # line, not the import's stack trace (SystemExit passes through Dagster's loaders).
        raise SystemExit(f"error: {exc}") from None


faults.point("definitions-import")  # still importing: a stop now lands in a code server's load (tests)
reuse_sqlite_engines()  # the code servers, Dagster's run processes and the Dagster CLI load this module first
let_step_lines_reach_the_console()
defs = build_definitions(_project_dir())
