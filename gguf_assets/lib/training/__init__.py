"""Training: the adapter, data order, checkpoints, the loop, the verdict on its score; the run's fingerprint and
"is it current" check without torch (training_run.py)."""
