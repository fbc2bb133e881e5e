"""Shard partitions, defined once. The corpus asset fills them once the shard count is known."""

import dagster as dg

from gguf_assets.lib.project.layout import SPLITS, shard_key
from gguf_assets.lib.project.manifests import CorpusManifest

TRAIN_SHARDS = dg.DynamicPartitionsDefinition(name="train_shards")
VAL_SHARDS = dg.DynamicPartitionsDefinition(name="val_shards")
BY_SPLIT = {"train": TRAIN_SHARDS, "val": VAL_SHARDS}


def expected_shard_keys(corpus_manifest: CorpusManifest, settings) -> dict[str, list[str]]:
    """Per split, the partition keys of shards 0..n-1 for this corpus and these shard sizes."""
    sizes = {"train": settings.precompute.shard_size, "val": settings.precompute.val_shard_size}
    return {split: [shard_key(i) for i in range(-(-corpus_manifest.prompts(split) // sizes[split]))]
            for split in SPLITS}


def partitions_match(instance: dg.DagsterInstance, wanted: dict[str, list[str]]) -> bool:
    return all(list(instance.get_dynamic_partitions(BY_SPLIT[split].name)) == keys for split, keys in wanted.items())


def sync_shard_partitions(instance: dg.DagsterInstance, wanted_by_split: dict[str, list[str]]) -> None:
    """Make each split's dynamic partitions exactly ``wanted`` (insertion order = index order)."""
    for split, wanted in wanted_by_split.items():
        name = BY_SPLIT[split].name
        existing = list(instance.get_dynamic_partitions(name))
        if existing[: len(wanted)] != wanted[: len(existing)]:
            for key in existing:  # order broken (should not happen): rebuild so ranges stay contiguous
                instance.delete_dynamic_partition(name, key)
            existing = []
        for key in existing[len(wanted):]:
            instance.delete_dynamic_partition(name, key)
        missing = wanted[len(existing):]
        if missing:
            instance.add_dynamic_partitions(name, missing)
