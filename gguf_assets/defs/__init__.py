"""Thin Dagster wiring: one module per asset group, each asset calls one lib function."""

import warnings

import dagster as dg

# backfill_policy is marked beta; single-run backfills are what keep thousands of shards in one run.
# Filtered here, the one place every import of the wiring goes through, before any decorator runs.
warnings.filterwarnings("ignore", category=dg.BetaWarning)
