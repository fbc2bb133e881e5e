"""What the CLI and the studio drive: the instance, launching runs, stopping them, workers and the cluster, outages,
resuming. Dagster definitions stay in defs/; pure code in lib/."""
