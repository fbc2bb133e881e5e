"""What the Dagster definitions (defs/) and the drivers (orchestration/, the CLI, the studio) share, below both: the
names (jobs, pool, queues, groups), the partitions, the project's environment, the settings observation, the run
tags, the plan of what to run next, resume, the in-run bookkeeping and the one module that uses Dagster's private
API. Nothing here imports defs/ or anything above it (gguf_assets_tests/defs/test_definitions.py)."""
