"""The teacher: ``layout.py`` tells its kind (query rows or an LLaDA-Image pipeline) and which of its files are
fetched (no torch), ``preflight.py`` checks a pipeline before a byte of its weights, ``text_stack.py`` holds the
pipeline's small torch modules (its QueryFormer and text projection)."""
