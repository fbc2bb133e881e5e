"""Training: the adapter, data order, checkpoints, the loop."""
