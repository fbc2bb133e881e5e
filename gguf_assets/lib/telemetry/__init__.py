"""Telemetry: hardware sampling, progress and ETA, TensorBoard curves, Markdown and SVG."""
