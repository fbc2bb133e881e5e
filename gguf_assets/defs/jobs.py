"""Named jobs, so every run reads well in the UI: the pipeline is these four, in this order.

`gguf-trainer run`, the resume sensor and a user in the UI or on the Dagster CLI all launch the
same jobs; each shard job covers a range of shard partitions in one run (single-run backfill).
"""

import dagster as dg

from gguf_assets.lib.status.stages import INPUT_STAGES, TRAINING_STAGES
from gguf_assets.pipeline.names import (
    CONSOLE,
    CPU_QUEUE,
    GPU_QUEUE,
    MATERIALS_AND_CORPUS,
    QUEUE_TAG,
    SHARDS_JOB,
    TRAIN_AND_EXPORT,
)
from gguf_assets.pipeline.partitions import TRAIN_SHARDS, VAL_SHARDS

# The Celery queue each job's runs go to on a cluster (orchestration/cluster_workers.py); a tag only, elsewhere.
ON_GPU = {QUEUE_TAG: GPU_QUEUE}
ON_CPU = {QUEUE_TAG: CPU_QUEUE}

JOBS = [
    dg.define_asset_job(MATERIALS_AND_CORPUS, selection=list(INPUT_STAGES), config=CONSOLE, tags=ON_CPU,
                        description="Pin and download the materials, then build the prompt corpus."),
    dg.define_asset_job(SHARDS_JOB["train"], selection=["train_shards"], partitions_def=TRAIN_SHARDS,
                        config=CONSOLE, tags=ON_GPU,
                        description="Teacher targets and student states for a range of train shards."),
    dg.define_asset_job(SHARDS_JOB["val"], selection=["val_shards"], partitions_def=VAL_SHARDS,
                        config=CONSOLE, tags=ON_GPU,
                        description="Teacher targets and student states for a range of val shards."),
    dg.define_asset_job(TRAIN_AND_EXPORT, selection=list(TRAINING_STAGES),
                        config=CONSOLE, tags=ON_GPU,
                        description="Train the adapter, export the GGUF and evaluate it (any suffix of the three)."),
]
