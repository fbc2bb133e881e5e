"""The trainer's studio: one web page per project beside the Dagster UI (`gguf-trainer ui` serves it)."""
