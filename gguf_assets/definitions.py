"""The one Definitions object (what workspace.yaml and `dagster -m` load).

The project folder comes from the GGUF_ASSETS_PROJECT environment variable, which
gguf-trainer sets; the per-project resource hands it to every asset. Each asset's code
version is a hash of the project settings it depends on, so after editing project.yaml
(and "Reload definitions" in the UI) exactly the affected assets show as stale.
"""

import os
import warnings

import dagster as dg

# backfill_policy is marked beta; single-run backfills are what keep thousands of shards in one run.
warnings.filterwarnings("ignore", category=dg.BetaWarning)

from gguf_assets.defs import corpus, materials, output, precompute, training  # noqa: E402
from gguf_assets.defs.resources import PROJECT_ENV, ProjectResource  # noqa: E402
from gguf_assets.defs.resume import interrupted_runs_sensor  # noqa: E402
from gguf_assets.lib.pipeline import settings_code_versions  # noqa: E402
from gguf_assets.lib.settings import PROJECT_FILE, load_settings  # noqa: E402


def build_definitions(project_dir: str | None) -> dg.Definitions:
    assets = dg.load_assets_from_modules([materials, corpus, precompute, training, output])
    auto_resume = True
    if project_dir and os.path.isfile(os.path.join(project_dir, PROJECT_FILE)):
        settings = load_settings(project_dir)
        auto_resume = settings.output.auto_resume
        versions = settings_code_versions(settings)
        assets = [a.map_asset_specs(lambda spec: spec.replace_attributes(
            code_version=versions[spec.key.to_user_string()])) for a in assets]
    return dg.Definitions(
        assets=assets,
        sensors=[interrupted_runs_sensor(running=auto_resume)],
        resources={"project": ProjectResource(project_dir=dg.EnvVar(PROJECT_ENV))},
    )


defs = build_definitions(os.environ.get(PROJECT_ENV))
