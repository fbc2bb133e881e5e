"""Thin Dagster wiring: one module per asset group, each asset calls one lib function."""
