"""Precompute: teacher targets + student states per shard, partitioned by shard index.

One run covers a range of shards (single-run backfill policy) so thousands of shards do not
mean thousands of runs; each shard is recorded as materialized the moment it is finished,
so a killed run keeps the shards it completed.
"""


import time

import dagster as dg

from gguf_assets.defs.corpus import corpus
from gguf_assets.defs.partitions import TRAIN_SHARDS, VAL_SHARDS
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.lib.hardware import gpu_snapshot, host_snapshot
from gguf_assets.lib.materials import load_manifest
from gguf_assets.lib.shards import build_shards

GPU_POOL = "gpu"


def materialize_shards(context: dg.AssetExecutionContext, project: ProjectResource, split: str) -> dg.MaterializeResult:
    paths, settings = project.paths(), project.settings()
    keys = list(context.partition_keys)
    start = time.perf_counter()

    def record(report: dict) -> None:
        numbers = {k: v for k, v in report.items() if isinstance(v, (int, float, str))}
        gpus = gpu_snapshot()
        host = host_snapshot()
        numbers.update({f"host_{k}": round(v, 3) for k, v in host.items()})
        for g in gpus:
            numbers[f"gpu{g['index']}_util_pct"] = g["util_pct"]
            numbers[f"gpu{g['index']}_mem_used_gib"] = round(g["mem_used_gib"], 3)
        context.log_event(dg.AssetMaterialization(asset_key=context.asset_key, partition=report["key"],
                                                  metadata=numbers))

    reports = build_shards(paths, settings, load_manifest(paths), split, keys, on_shard_done=record)
    seconds = time.perf_counter() - start
    prompts = sum(r["prompts"] for r in reports)
    computed = {half: sum(1 for r in reports if r.get(f"{half}_status") not in (None, "current"))
                for half in ("teacher", "student")}
    return dg.MaterializeResult(metadata={
        "shards": len(keys), "prompts": prompts, "seconds": round(seconds, 2),
        "prompts_per_s": round(prompts / seconds, 2) if seconds else 0.0,
        "teacher_halves_computed": computed["teacher"], "student_halves_computed": computed["student"],
        "folder": dg.MetadataValue.path(str(paths.root / "shards" / split)),
    })


@dg.asset(group_name="precompute", partitions_def=TRAIN_SHARDS, deps=[corpus], pool=GPU_POOL,
          backfill_policy=dg.BackfillPolicy.single_run(),
          description="Train shards: teacher targets (Q x D per prompt) and student hidden states, safetensors "
                      "with fingerprints and sha256; each half is recomputed only when what it depends on changed.")
def train_shards(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    return materialize_shards(context, project, "train")


@dg.asset(group_name="precompute", partitions_def=VAL_SHARDS, deps=[corpus], pool=GPU_POOL,
          backfill_policy=dg.BackfillPolicy.single_run(),
          description="Val shards: like the train shards, for the val prompts.")
def val_shards(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    return materialize_shards(context, project, "val")
