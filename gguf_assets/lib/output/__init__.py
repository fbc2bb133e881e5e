"""Output: the GGUF format and export, the vision encoder, the numpy evaluation, the report and verdict."""
