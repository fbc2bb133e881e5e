"""Output: the GGUF format and export, the vision encoder, the numpy evaluation, the report; each stage's
fingerprint and "is it current" check without torch (export_run.py, report_run.py)."""
