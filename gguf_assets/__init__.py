"""gguf_assets: a Dagster-based distillation workbench (see README.md)."""

# The module dagster-webserver, dagster-daemon and the Dagster CLI load (`-m`); Dagster names the code
# location after it, so runs created by `gguf-trainer run` carry the same location name as the UI's.
DEFINITIONS_MODULE = "gguf_assets.definitions"
