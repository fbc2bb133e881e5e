"""Telemetry: hardware sampling, progress and ETA, TensorBoard curves, SVG pictures, the studio's live figures."""
