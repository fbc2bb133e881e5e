"""Precompute: teacher targets + student states per shard, partitioned by shard index.

One run covers a range of shards (single-run backfill policy) so thousands of shards do not
mean thousands of runs. Each shard partition gets one materialization per run, carrying that
shard's own figures (prompts, tokens, seconds, prompts/s, truncations, device map, hardware);
while the run goes, progress and live hardware arrive as observations. A killed run loses no
shard it finished: the planner goes by the files (lib/precompute/shards_run.py), and the next run records it.
"""

import math
import time

import dagster as dg

from gguf_assets.defs.corpus import corpus
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.markdown import markdown_table
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.precompute.half_state import HalfState
from gguf_assets.lib.precompute.shards import ShardReport, precompute_split
from gguf_assets.lib.precompute.shards_run import plan_shards, shard_status
from gguf_assets.lib.status.pace import PACE_NOT_YET, precompute_pace
from gguf_assets.lib.status.states import planned_view
from gguf_assets.lib.telemetry.hardware import pin_to_gpu
from gguf_assets.lib.telemetry.progress import PROGRESS_LOG_INTERVAL_S
from gguf_assets.pipeline import groups, run_tags
from gguf_assets.pipeline.names import GPU_POOL
from gguf_assets.pipeline.partitions import TRAIN_SHARDS, VAL_SHARDS
from gguf_assets.pipeline.settings_observation import settings_key


def _numbers(figures: dict) -> dict:
    """The plottable and short values of some figures (no bools, no inf: an ETA not known yet). A str enum goes in
    as its plain value: Dagster's serializer refuses enums it does not know."""
    return {k: str(v) if isinstance(v, str) else v for k, v in figures.items()
            if isinstance(v, (int, float, str)) and not isinstance(v, bool)
            and not (isinstance(v, float) and not math.isfinite(v))}


def _device_map(placement: dict) -> dg.MetadataValue:
    return dg.MetadataValue.md(markdown_table(["device", "layers", "GiB"],
                                              [[d, v["layers"], f"{v['gib']:.2f}"] for d, v in placement.items()]))


def materialize_shards(context: dg.AssetExecutionContext, project: ProjectResource, split: str) -> dg.MaterializeResult:
    gpu = run_tags.get(context.run.tags, run_tags.GPU_TAG)
    if gpu is not None:  # a worker of `run --workers auto`: its own GPU only, before anything touches CUDA
        pin_to_gpu(gpu)
    paths, settings = project.paths(), project.settings()
    told: dict = {"at": -math.inf, "view": None}

    def tell_pace() -> None:
        """The whole precompute's measured speed and ETA on the console: after the first shard, then at most every
        PROGRESS_LOG_INTERVAL_S (it reads every shard's record). Both splits are planned once: the run holds the
        project, so the corpus and settings stay as they are; each time only the half states are read again."""
        if time.monotonic() - told["at"] >= PROGRESS_LOG_INTERVAL_S:
            told["at"] = time.monotonic()
            try:
                before = told["view"]
                view = told["view"] = before.rechecked(paths, settings) if before else planned_view(paths, settings)
            except PACE_NOT_YET:  # no materials or corpus: nothing to measure
                return
            if (now := precompute_pace(paths, settings, view)) is not None:
                context.log.info("%s", now.text())

    def shard_done(report: ShardReport) -> None:
        key = report.key
        figures = _numbers(report.figures())
        seconds = sum(done.seconds for done in report.halves.values())
        figures["seconds"] = round(seconds, 3)
        figures["prompts_per_s"] = round(report.prompts / seconds, 3) if seconds else 0.0
        if report.device_map:  # the console said where the teacher went when it was loaded
            figures["teacher_device_map"] = _device_map(report.device_map)
        figures["folder"] = dg.MetadataValue.path(str(paths.shard_dir(split, key)))
        # This shard's own materialization (one per shard per run) gets this shard's own figures.
        context.add_asset_metadata(figures, partition_key=key)
        # Seen at once in the UI while the run goes on (the materializations come at the step's end).
        context.log_event(dg.AssetObservation(asset_key=context.asset_key, partition=key, metadata=_numbers(figures)))
        tell_pace()

    def live(figures: dict) -> None:  # progress and live hardware, plotted on the asset's page
        # The asset's, not the shard's: done and total count the whole run's prompts, and a partition's page shows
        # that shard's own figures only (filed under the shard in progress, a tick during shard 00001 put the run's
        # 400 prompts on 00001's page; test_ui_browser.py). "shard" says which one was in progress.
        context.log_event(dg.AssetObservation(asset_key=context.asset_key, metadata=_numbers(figures)))

    run = precompute_split(paths, settings, load_manifest(paths), split, list(context.partition_keys),
                           on_shard_done=shard_done, on_progress=live)
    rates = ", ".join(f"{half} {figures.prompts_per_s:.2f} prompts/s" for half, figures in run.halves.items()
                      if figures.computed)
    context.log.info("%s shards done: %d shards, %d prompts in %.1f s%s", split, run.shards, run.prompts,
                     run.seconds, f" ({rates})" if rates else " (all already current)")
    # The data version of the shards this run covers: what they hold now (their fingerprints), so a run
    # that finds them current changes nothing downstream.
    held = {plan.key: plan for plan in plan_shards(paths, settings, load_manifest(paths), split)}
    version = atomic.fingerprint([[key, held[key].fingerprints] for key in context.partition_keys if key in held])
    project.result_written(context)
    # Each shard's materialization carries that shard's own figures (shard_done); the run's totals are in its log.
    return dg.MaterializeResult(data_version=dg.DataVersion(version),
                                metadata=project.stage_metadata(f"{split}_shards", settings))


@dg.asset(group_name=groups.PRECOMPUTE, partitions_def=TRAIN_SHARDS, deps=[corpus, settings_key("train_shards")],
          pool=GPU_POOL,
          backfill_policy=dg.BackfillPolicy.single_run(),
          description="Train shards: teacher targets (Q x D per prompt) and student hidden states, safetensors "
                      "with fingerprints and sha256; each half is recomputed only when what it depends on changed.")
def train_shards(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    return materialize_shards(context, project, "train")


@dg.asset(group_name=groups.PRECOMPUTE, partitions_def=VAL_SHARDS, deps=[corpus, settings_key("val_shards")],
          pool=GPU_POOL,
          backfill_policy=dg.BackfillPolicy.single_run(),
          description="Val shards: like the train shards, for the val prompts.")
def val_shards(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    return materialize_shards(context, project, "val")


def _shards_verified(split: str, shards: dg.AssetsDefinition) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=shards, name="shards_verified", description=f"Every {split} shard half that the mode needs "
                    "exists, was made under the current settings and has its recorded size, mtime and inode "
                    "(its content is hashed only when those are unsure). Training and evaluation check each "
                    "shard's sha256 as they read it.")
    def check(project: ProjectResource) -> dg.AssetCheckResult:
        paths, settings = project.paths(), project.settings()
        plans = plan_shards(paths, settings, load_manifest(paths), split)
        bad = {plan.key: states for plan in plans
               if set((states := shard_status(paths, settings, plan)).values()) != {HalfState.CURRENT}}
        rows = [[key, ", ".join(f"{half} {state}" for half, state in states.items())]
                for key, states in list(bad.items())[:50]]
        table = markdown_table(["shard", "halves"], rows)
        return dg.AssetCheckResult(passed=not bad, metadata={
            "shards": len(plans), "current": len(plans) - len(bad),
            **({"not_current": dg.MetadataValue.md(table)} if bad else {})})

    return check


SHARD_CHECKS = [_shards_verified("train", train_shards), _shards_verified("val", val_shards)]
