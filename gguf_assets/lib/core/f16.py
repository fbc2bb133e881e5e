"""The float16 range, shared by the stages that must stay inside it: the precompute refuses teacher targets
beyond it (they are stored and exported as f16), and the export keeps a matrix f32 when its values or the
activations it multiplies would pass it (lib/output/export.py, lib/output/gguf_format.py)."""

# Largest finite float16 (float(numpy.finfo(numpy.float16).max)); anything larger rounds to inf.
F16_MAX = 65504.0
