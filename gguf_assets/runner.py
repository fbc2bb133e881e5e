"""Launch what is missing or stale in a project, through Dagster, on the project's own instance.

The shard partitions exist only once the corpus does, so a full pipeline is a few runs:
materials+corpus, one run per split covering all its shards (single-run backfill), then
adapter → gguf → eval_report. Each run is skipped when its stages are current.
"""

import json
import logging
import os
import warnings
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from gguf_assets.lib.layout import SPLITS, ProjectPaths
from gguf_assets.lib.lock import ProjectLock
from gguf_assets.lib.pipeline import StageState, project_status
from gguf_assets.lib.settings import load_settings

log = logging.getLogger(__name__)

DAGSTER_YAML = "dagster.yaml"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"


class PipelineFailed(RuntimeError):
    pass


def prepare_instance(paths: ProjectPaths) -> Path:
    """Put the instance config into <project>/.dagster and point this process at it.

    The storage folders are written as absolute paths (re-written whenever the project
    folder moved), so any tool that opens this instance finds the same storage.
    """
    home = paths.dagster_home
    home.mkdir(parents=True, exist_ok=True)
    template = resources.files("gguf_assets").joinpath(DAGSTER_YAML).read_text(encoding="utf-8")
    placeholder = "\n      env: DAGSTER_HOME"
    if placeholder not in template:
        raise RuntimeError(f"{DAGSTER_YAML} template no longer uses `env: DAGSTER_HOME` for its base_dir entries")
    template = template.replace(placeholder, f" {json.dumps(str(home))}")
    target = home / DAGSTER_YAML
    if not target.is_file() or target.read_text(encoding="utf-8") != template:
        from gguf_assets.lib import atomic

        atomic.write_text(target, template)
    from gguf_assets.defs.resources import PROJECT_ENV

    os.environ["DAGSTER_HOME"] = str(home)
    os.environ[PROJECT_ENV] = str(paths.root)
    return home


GPU_POOL = "gpu"


def size_gpu_pool(instance) -> int:
    """One `gpu` pool slot per GPU (1 on a CPU machine), so GPU steps never share a card."""
    from gguf_assets.lib.hardware import gpu_snapshot

    slots = max(1, len(gpu_snapshot()))
    instance.event_log_storage.set_concurrency_slots(GPU_POOL, slots)
    return slots


def _failure_message(result) -> str:
    for event in result.all_events:
        if event.is_step_failure:
            error = event.event_specific_data.error
            cause = error.cause.message if error.cause else ""
            return f"step {event.step_key} failed: {(cause or error.message).strip()}"
    return "the run failed"


def run_pipeline(paths: ProjectPaths, *, echo: Callable[[str], None] = print) -> list[StageState]:
    """Materialize everything missing or stale; returns the final status."""
    prepare_instance(paths)
    import dagster as dg

    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    from gguf_assets.defs.partitions import BY_SPLIT
    from gguf_assets.defs.resources import ProjectResource
    from gguf_assets.definitions import defs

    instance = dg.DagsterInstance.get()
    size_gpu_pool(instance)
    assets = list(defs.assets)
    resource = ProjectResource(project_dir=str(paths.root))

    def launch(selection: list[str], tags: dict | None = None) -> None:
        echo(f"→ materializing {', '.join(selection)}" + (f" (shards {tags[RANGE_START_TAG]}..{tags[RANGE_END_TAG]})"
                                                          if tags else ""))
        result = dg.materialize(assets, instance=instance, resources={"project": resource}, selection=selection,
                                tags=tags, raise_on_error=False)
        if not result.success:
            raise PipelineFailed(f"{_failure_message(result)}\n(run {result.run_id}; see `gguf-trainer ui {paths.root}`)")

    with ProjectLock(paths.lock_file):
        settings = load_settings(paths.root)
        status = {s.stage: s for s in project_status(paths, settings)}
        partitions_ok = all(instance.get_dynamic_partitions(BY_SPLIT[s].name) for s in SPLITS)
        if status["materials"].state != "current" or status["corpus"].state != "current" or not partitions_ok:
            launch(["materials", "corpus"])
            status = {s.stage: s for s in project_status(paths, settings)}
        for split in SPLITS:
            if status[f"{split}_shards"].state != "current":
                keys = instance.get_dynamic_partitions(BY_SPLIT[split].name)
                launch([f"{split}_shards"], {RANGE_START_TAG: keys[0], RANGE_END_TAG: keys[-1]})
        status = {s.stage: s for s in project_status(paths, settings)}
        rest = [s for s in ("adapter", "gguf", "eval_report") if status[s].state in ("missing", "stale")]
        blocked = [s for s in ("adapter", "gguf", "eval_report") if status[s].state == "blocked"]
        if blocked and not rest:
            echo(f"not running {', '.join(blocked)}: {status[blocked[0]].detail}")
        if rest:
            # Once one stage is redone, everything after it is redone too.
            order = ["adapter", "gguf", "eval_report"]
            launch(order[order.index(rest[0]):])
        return project_status(paths, settings)

