"""The largest |input| each linear layer of the adapter sees over the val prompts, by the torch name of its weight:
what the export's f16 rule reads (lib/output/export.py, ``activation_rule``: a runtime rounds a f16 product's inputs
to f16, so a matrix whose inputs pass the f16 range is stored f32).

Every validation records them as it runs (``train.evaluate``), and the meta.json of the weights it judged (final/,
best/, a kept step) keeps that record with the identity of the val shards it read. The export reads the record
instead of running the adapter over every val prompt again, which at the seed's shape (width 1024, depth 6) takes
about 1.1 s a prompt on a CPU. Without a record for its val shards (a run from before records, other val shards) the
export measures the peaks itself (``measure_peaks``), batched, on the training device.

ggk runs one prompt, without padding: in a padded batch the padding tokens' rows are left out (the linears that read
the prompt's tokens see them, ``Adapter.token_linears``), so the peaks are the prompts' own whatever the batching.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
from torch import nn

from gguf_assets.lib.training.adapter import Adapter
from gguf_assets.lib.training.train_data import student_batches
from gguf_assets.lib.training.training_run import shards_identity

INPUT_PEAKS = "input_peaks"  # evaluate's record, and its key in a weights folder's meta.json


class PeakRecorder:
    """While open (``with``), records the largest |input| of each linear of ``model`` over its forwards."""

    def __init__(self, model: Adapter) -> None:
        self.model = model
        self._peaks: dict[str, torch.Tensor] = {}  # on the model's device: read once at the end, no sync per batch
        self._mask: torch.Tensor | None = None  # the mask of the forward that runs
        self._handles: list = []

    def __enter__(self) -> PeakRecorder:
        # The linears that read the prompt's tokens (padding masked); a model without the list (the benchmarks'
        # older adapter) has its peaks taken over every row.
        token_linears = getattr(self.model, "token_linears", list)
        tokens = {id(linear) for linear in token_linears()}
        self._handles.append(self.model.register_forward_pre_hook(self._take_mask, with_kwargs=True))
        self._handles += [module.register_forward_hook(self._recorder(f"{name}.weight", id(module) in tokens))
                          for name, module in self.model.named_modules() if isinstance(module, nn.Linear)]
        return self

    def __exit__(self, *_exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _take_mask(self, _model, args, kwargs) -> None:
        self._mask = kwargs["mask"] if "mask" in kwargs else args[1]

    def _recorder(self, name: str, reads_tokens: bool):
        def record(_module, inputs, _output) -> None:
            x = inputs[0].detach()
            # Per row, without an |x| copy of a [B, Q, 4W] input (amax and amin are vectorized, aminmax over a dim is
            # 10x slower on a CPU); a NaN stays NaN, so a non-finite input keeps its matrix f32.
            row_peaks = torch.maximum(x.amax(-1), x.amin(-1).neg())
            if reads_tokens:
                row_peaks = row_peaks.masked_fill(~self._mask, 0.0)  # [B, L]: the padding's rows are no prompt's
            peak = row_peaks.amax()
            self._peaks[name] = peak if name not in self._peaks else torch.maximum(self._peaks[name], peak)
        return record

    def peaks(self) -> dict[str, float]:
        """The peaks so far, by the torch name of each linear's weight (a linear no forward reached is absent)."""
        return {name: float(peak) for name, peak in self._peaks.items()}


def peaks_record(peaks: dict[str, float], folders: list[Path]) -> dict:
    """What a weights folder's meta.json keeps under INPUT_PEAKS: the peaks over ``folders`` (the val shards), and
    those shards' identity. A non-finite peak is stored as None (JSON has no inf)."""
    return {"val_shards": shards_identity(list(folders)),
            "peaks": {name: peak if math.isfinite(peak) else None for name, peak in peaks.items()}}


def recorded_peaks(meta: dict, folders: list[Path]) -> dict[str, float] | None:
    """The peaks a validation of these weights recorded in their ``meta`` over these val shards, or None (no record,
    or one of other shards)."""
    record = meta.get(INPUT_PEAKS)
    if not isinstance(record, dict) or not isinstance(record.get("peaks"), dict) \
            or record.get("val_shards") != shards_identity(list(folders)):
        return None
    return {name: math.inf if peak is None else float(peak) for name, peak in record["peaks"].items()}


def measure_peaks(model: Adapter, folders: list[Path], *, device: torch.device,
                  batch_size: int = 64) -> dict[str, float]:
    """The peaks over the prompts of ``folders`` (the val shards' student halves), measured now on ``device`` (a copy
    of the model goes there when it lives elsewhere), ``batch_size`` prompts at a time."""
    on_device = model if next(model.parameters()).device == device else copy.deepcopy(model).to(device)
    with PeakRecorder(on_device) as recorder, torch.inference_mode():
        for folder in folders:
            for states, mask in student_batches(folder, device=device, batch_size=batch_size):
                on_device(states, mask)
    return recorder.peaks()
