"""The torch checkpoint's own outputs on the val shards, for the evaluation to compare the exported GGUF's with
(gguf_eval.evaluate_gguf's ``checkpoint``, the report's ``gguf_vs_checkpoint``).

The checkpoint is the finished run's final weights (checkpoints.load_final, checked against their sha256), run
as training validates them: each shard's prompts in order, padded in batches with the padding masked, and mapped
back through the standardization to the raw target space the GGUF gives directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from gguf_assets.lib.training.checkpoints import load_final
from gguf_assets.lib.training.train_data import shard_batches

# Prompts run at once: each holds [Q, D] floats until the evaluator has compared them (Q=256, D=2560: 2.6 MB each).
BATCH = 16


def checkpoint_outputs(run_dir: Path, *, batch_size: int = BATCH):
    """``outputs(shard_folder)``: the finished run's outputs for that shard's prompts, one [Q, D] float32 array per
    prompt in the shard's order."""
    model, _ = load_final(Path(run_dir))

    def outputs(folder: Path) -> Iterator[np.ndarray]:
        for _, _, states, mask, _ in shard_batches(Path(folder), device=torch.device("cpu"), batch_size=batch_size):
            with torch.inference_mode():
                raw = model.to_target_space(model(states, mask).float())
            yield from raw.numpy()

    return outputs
