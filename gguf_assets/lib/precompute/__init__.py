"""The precompute: teacher and student, token-budget batching, the shards."""
