"""Launch what is missing or stale in a project, through Dagster, on the project's own instance.

The shard partitions exist only once the corpus does, so a full pipeline is a few runs:
materials+corpus, one run per split covering all its shards (single-run backfill), then
adapter → gguf → eval_report. Each run is skipped when its stages are current.
"""

import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from gguf_assets.lib import atomic
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
        atomic.write_text(target, template)
    from gguf_assets.defs.resources import PROJECT_ENV

    os.environ["DAGSTER_HOME"] = str(home)
    os.environ[PROJECT_ENV] = str(paths.root)
    return home


GPU_POOL = "gpu"


def size_gpu_pool(instance, *, at_least: int = 1) -> int:
    """One `gpu` pool slot per GPU (1 on a CPU machine), so GPU steps never share a card.

    ``at_least`` raises it for parallel shard workers whose precompute runs on the CPU.
    """
    from gguf_assets.lib.hardware import gpu_snapshot

    slots = max(at_least, len(gpu_snapshot()))
    instance.event_log_storage.set_concurrency_slots(GPU_POOL, slots)
    return slots


def _failure_message(result) -> str:
    for event in result.all_events:
        if event.is_step_failure:
            error = event.event_specific_data.error
            cause = error.cause.message if error.cause else ""
            return f"step {event.step_key} failed: {(cause or error.message).strip()}"
    return "the run failed"


def split_range(keys: list[str], parts: int) -> list[tuple[str, str]]:
    """Contiguous (first, last) key ranges, as even as possible, at most ``parts`` of them."""
    parts = max(1, min(parts, len(keys)))
    bounds = [round(i * len(keys) / parts) for i in range(parts + 1)]
    return [(keys[a], keys[b - 1]) for a, b in zip(bounds, bounds[1:]) if b > a]


def _launch_shard_workers(paths: ProjectPaths, split: str, ranges: list[tuple[str, str]], token: str,
                          echo: Callable[[str], None]) -> None:
    """One Dagster run per range, each in its own process, all at once; they join our lock."""
    # Each worker keeps torch's default thread count: CPU matmul results depend on it, and
    # shards must be byte-identical whatever the number of workers.
    env = dict(os.environ)
    procs = []
    for first, last in ranges:
        echo(f"→ worker: {split}_shards {first}..{last}")
        procs.append(subprocess.Popen([sys.executable, "-m", "gguf_assets.runner", "shard-worker", str(paths.root),
                                       split, first, last, token], env=env))
    failed = [(r, p.wait()) for r, p in zip(ranges, procs)]
    failed = [(r, code) for r, code in failed if code != 0]
    if failed:
        raise PipelineFailed(f"{split} shard workers failed: {failed} (see `gguf-trainer ui {paths.root}`)")


def run_pipeline(paths: ProjectPaths, *, echo: Callable[[str], None] = print, workers: int = 1) -> list[StageState]:
    """Materialize everything missing or stale; returns the final status.

    ``workers`` > 1 runs each split's shards as that many Dagster runs in parallel processes
    (contiguous partition ranges), all under this pipeline's project lock.
    """
    prepare_instance(paths)
    import dagster as dg

    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    from gguf_assets.defs.corpus import expected_shard_keys, partitions_match
    from gguf_assets.defs.partitions import BY_SPLIT
    from gguf_assets.defs.resources import ProjectResource
    from gguf_assets.definitions import build_definitions

    # Built for this project's current settings: the code versions are hashes of them.
    defs = build_definitions(str(paths.root))
    instance = dg.DagsterInstance.get()
    size_gpu_pool(instance, at_least=workers if load_settings(paths.root).precompute.device == "cpu" else 1)
    assets = list(defs.assets)
    resource = ProjectResource(project_dir=str(paths.root))

    def launch(selection: list[str], tags: dict | None = None) -> None:
        echo(f"→ materializing {', '.join(selection)}" + (f" (shards {tags[RANGE_START_TAG]}..{tags[RANGE_END_TAG]})"
                                                          if tags else ""))
        result = dg.materialize(assets, instance=instance, resources={"project": resource}, selection=selection,
                                tags=tags, raise_on_error=False)
        if not result.success:
            raise PipelineFailed(f"{_failure_message(result)}\n(run {result.run_id}; see `gguf-trainer ui {paths.root}`)")

    with ProjectLock(paths.lock_file) as lock:
        settings = load_settings(paths.root)
        # A typo in a prompt file path should fail in seconds, not after a teacher download.
        from gguf_assets.lib.corpus import check_prompt_files

        check_prompt_files(paths, settings)
        status = {s.stage: s for s in project_status(paths, settings)}
        # New materials come with the corpus: it reads them, and when it finds itself current it
        # only records that (same data version), so Dagster does not show it stale.
        if status["materials"].state != "current":
            launch(["materials", "corpus"])
            status = {s.stage: s for s in project_status(paths, settings)}
        elif status["corpus"].state != "current" or not partitions_match(
                instance, expected_shard_keys(atomic.read_json(paths.corpus_manifest), settings)):
            launch(["corpus"])
            status = {s.stage: s for s in project_status(paths, settings)}
        for split in SPLITS:
            if status[f"{split}_shards"].state != "current":
                keys = list(instance.get_dynamic_partitions(BY_SPLIT[split].name))
                if workers > 1 and len(keys) > 1:
                    _launch_shard_workers(paths, split, split_range(keys, workers), lock.token, echo)
                else:
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



def _shard_worker(project: str, split: str, first: str, last: str, token: str) -> int:
    """Entry of one parallel shard worker: materialize a partition range as its own Dagster run."""
    paths = ProjectPaths.of(project)
    prepare_instance(paths)
    import dagster as dg

    warnings.filterwarnings("ignore", category=dg.BetaWarning)
    from gguf_assets.defs.resources import LOCK_TOKEN_TAG, ProjectResource
    from gguf_assets.definitions import build_definitions

    defs = build_definitions(str(paths.root))
    result = dg.materialize(list(defs.assets), instance=dg.DagsterInstance.get(), selection=[f"{split}_shards"],
                            resources={"project": ProjectResource(project_dir=str(paths.root))},
                            tags={RANGE_START_TAG: first, RANGE_END_TAG: last, LOCK_TOKEN_TAG: token},
                            raise_on_error=False)
    if not result.success:
        print(_failure_message(result), file=sys.stderr)
    return 0 if result.success else 1


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "shard-worker":
        sys.exit(_shard_worker(*sys.argv[2:]))
    sys.exit("usage: python -m gguf_assets.runner shard-worker PROJECT SPLIT FIRST LAST TOKEN")
