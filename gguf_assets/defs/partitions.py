"""Shard partitions, defined once. The corpus asset fills them once the shard count is known."""

import dagster as dg

TRAIN_SHARDS = dg.DynamicPartitionsDefinition(name="train_shards")
VAL_SHARDS = dg.DynamicPartitionsDefinition(name="val_shards")
BY_SPLIT = {"train": TRAIN_SHARDS, "val": VAL_SHARDS}
