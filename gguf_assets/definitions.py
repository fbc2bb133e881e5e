"""The one Definitions object (what workspace.yaml and `dagster -m` load).

The project folder comes from the GGUF_ASSETS_PROJECT environment variable, which
gguf-trainer sets; the per-project resource hands it to every asset.
"""

import warnings

import dagster as dg

# backfill_policy is marked beta; single-run backfills are what keep thousands of shards in one run.
warnings.filterwarnings("ignore", category=dg.BetaWarning)

from gguf_assets.defs import corpus, materials, output, precompute, training  # noqa: E402
from gguf_assets.defs.resume import interrupted_runs_sensor  # noqa: E402
from gguf_assets.defs.resources import PROJECT_ENV, ProjectResource  # noqa: E402

defs = dg.Definitions(
    assets=dg.load_assets_from_modules([materials, corpus, precompute, training, output]),
    sensors=[interrupted_runs_sensor],
    resources={"project": ProjectResource(project_dir=dg.EnvVar(PROJECT_ENV))},
)
