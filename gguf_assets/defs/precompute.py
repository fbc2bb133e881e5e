"""Precompute: teacher targets + student states per shard, partitioned by shard index.

One run covers a range of shards (single-run backfill policy) so thousands of shards do not
mean thousands of runs; each shard is recorded as materialized the moment it is finished,
so a killed run keeps the shards it completed.
"""


import dagster as dg

from gguf_assets.defs.corpus import corpus
from gguf_assets.defs.partitions import TRAIN_SHARDS, VAL_SHARDS
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.defs.settings import settings_key
from gguf_assets.lib.materials import load_manifest
from gguf_assets.lib.shards import plan_shards, precompute_split, shard_status
from gguf_assets.lib.teacher import summarize_placement

GPU_POOL = "gpu"


def _numbers(report: dict) -> dict:
    return {k: v for k, v in report.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}


def materialize_shards(context: dg.AssetExecutionContext, project: ProjectResource, split: str) -> dg.MaterializeResult:
    paths, settings = project.paths(), project.settings()

    def record(report: dict) -> None:
        context.log_event(dg.AssetMaterialization(asset_key=context.asset_key, partition=report["key"],
                                                  metadata=_numbers(report)))

    run = precompute_split(paths, settings, load_manifest(paths), split, list(context.partition_keys),
                           on_shard_done=record)
    metadata = _numbers(run.summary)
    metadata["prompts_per_s"] = (round(run.summary["prompts"] / run.summary["seconds"], 2)
                                 if run.summary["seconds"] else 0.0)
    placement = next((r.get("placement") for r in reversed(run.reports) if r.get("placement")), None)
    if placement:
        metadata["teacher_device_map"] = dg.MetadataValue.md(
            "| device | layers | GiB |\n|---|---|---|\n"
            + "\n".join(f"| {d} | {v['layers']} | {v['gib']:.2f} |" for d, v in placement.items()))
        context.log.info("teacher placement: %s", summarize_placement(placement))
    metadata["folder"] = dg.MetadataValue.path(str(paths.root / "shards" / split))
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(group_name="precompute", partitions_def=TRAIN_SHARDS, deps=[corpus, settings_key("train_shards")],
          pool=GPU_POOL,
          backfill_policy=dg.BackfillPolicy.single_run(),
          description="Train shards: teacher targets (Q x D per prompt) and student hidden states, safetensors "
                      "with fingerprints and sha256; each half is recomputed only when what it depends on changed.")
def train_shards(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    return materialize_shards(context, project, "train")


@dg.asset(group_name="precompute", partitions_def=VAL_SHARDS, deps=[corpus, settings_key("val_shards")], pool=GPU_POOL,
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
               if set((states := shard_status(paths, settings, plan)).values()) != {"current"}}
        rows = ["| shard | halves |", "|---|---|"] + [
            f"| {key} | {', '.join(f'{half} {state}' for half, state in states.items())} |"
            for key, states in list(bad.items())[:50]]
        return dg.AssetCheckResult(passed=not bad, metadata={
            "shards": len(plans), "current": len(plans) - len(bad),
            **({"not_current": dg.MetadataValue.md("\n".join(rows))} if bad else {})})

    return check


SHARD_CHECKS = [_shards_verified("train", train_shards), _shards_verified("val", val_shards)]
