"""The student: hidden states of the chosen layers for a prompt's tokens (variable length).

States are stored flat, [all tokens, k*Ds] with offsets [n+1], so variable lengths cost no
padding on disk or in memory: each batch's real rows are copied straight into their slots.
With k layers (materials.student_layer as a list) a row holds them side by side, in the
setting's order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.quiet import quiet_libraries
from gguf_assets.lib.precompute.batching import pack_batches, right_padded
from gguf_assets.lib.precompute.teacher import OnBatch, pad_token_id, tokenize_prompts
from gguf_assets.lib.project.settings import Settings, student_layers

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def load_tokenizer(folder: Path, settings: Settings):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=settings.materials.trust_remote_code)


class StudentLayerError(UserError, ValueError):
    """materials.student_layer names a layer the student does not have."""


def hidden_state_indexes(layers: list[int], depth: int) -> list[int]:
    """The settings' layers as indexes into transformers' ``hidden_states`` (``depth + 1`` entries: the
    embeddings, then each decoder layer's output; the last one is after the final norm, as -1 is)."""
    resolved = []
    for layer in layers:
        if not -(depth + 1) <= layer <= depth:
            raise StudentLayerError(f"materials.student_layer: layer {layer} is out of range; the student has "
                                    f"{depth} layers, so use -{depth + 1} … {depth} (0 = the embeddings, -1 = the "
                                    "last)")
        resolved.append(layer % (depth + 1))
    repeated = [layer for layer, index in zip(layers, resolved) if resolved.count(index) > 1]
    if repeated:
        raise StudentLayerError(f"materials.student_layer: {', '.join(map(str, repeated))} name the same layer of "
                                f"this {depth}-layer student; list each layer once")
    return resolved


@dataclass
class StudentStates:
    hidden: torch.Tensor      # [tokens, k*Ds] in the student dtype: the k layers side by side
    offsets: torch.Tensor     # [n + 1] int64: prompt i is hidden[offsets[i]:offsets[i + 1]]
    token_ids: torch.Tensor   # [tokens] int32
    truncated: int
    layers: list[int]         # materials.student_layer as a list, the order of the side-by-side states

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    def of(self, i: int) -> torch.Tensor:
        return self.hidden[self.offsets[i]:self.offsets[i + 1]]


class Student:
    def __init__(self, folder: Path, settings: Settings, device: torch.device) -> None:
        from transformers import AutoModel

        self.settings = settings
        self.device = device
        self.dtype = TORCH_DTYPES[settings.precompute.student_dtype]
        self.tokenizer = load_tokenizer(folder, settings)
        # f16 matmuls are slow or missing on CPU; compute in f32 there and store in the dtype.
        compute = torch.float32 if device.type == "cpu" else self.dtype
        quiet_libraries()
        self.model = AutoModel.from_pretrained(folder, dtype=compute, use_safetensors=True,
                                               trust_remote_code=settings.materials.trust_remote_code).to(device)
        self.model.eval()
        self.dim = int(self.model.config.hidden_size)
        self.max_tokens = int(getattr(self.model.config, "max_position_embeddings", 32768))
        self.layers = student_layers(settings.materials)
        self.indexes = hidden_state_indexes(self.layers, int(self.model.config.num_hidden_layers))

    def tokenize(self, prompts: list[str]) -> tuple[list[list[int]], int]:
        return tokenize_prompts(self.tokenizer, prompts, template=self.settings.precompute.prompt_template,
                                max_tokens=self.max_tokens)

    @torch.inference_mode()
    def encode(self, prompts: list[str], *, on_batch: OnBatch | None = None) -> StudentStates:
        p = self.settings.precompute
        # The last layer alone needs no hidden_states tuple: last_hidden_state is it (after the final norm).
        last_only = self.layers == [-1]
        tokens, truncated = self.tokenize(prompts)
        if truncated:
            log.warning("%d of %d prompts are longer than the student's %d positions; they were truncated",
                        truncated, len(prompts), self.max_tokens)
        lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
        offsets = torch.zeros(len(prompts) + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        hidden = torch.empty(int(offsets[-1]), self.dim * len(self.indexes), dtype=self.dtype)
        nonempty = [i for i, t in enumerate(tokens) if t]
        for sub in pack_batches([len(tokens[i]) for i in nonempty], max_batch=p.student_batch,
                                token_budget=p.token_budget):
            batch = [nonempty[j] for j in sub]
            rows = [tokens[i] for i in batch]
            ids, mask = right_padded(rows, pad_id=pad_token_id(self.tokenizer))
            result = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False,
                                output_hidden_states=not last_only)
            states = result.last_hidden_state if last_only else \
                torch.cat([result.hidden_states[i] for i in self.indexes], dim=-1)
            # Real positions in row-major order are the prompts' tokens back to back; copy them to their slots.
            slots = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in batch])
            hidden[slots] = states[mask.to(states.device).bool()].to("cpu", self.dtype)
            if on_batch:
                on_batch(len(batch), len(slots))
        if on_batch and len(nonempty) < len(prompts):
            on_batch(len(prompts) - len(nonempty), 0)
        token_ids = torch.tensor([t for row in tokens for t in row], dtype=torch.int32)
        return StudentStates(hidden, offsets, token_ids, truncated, self.layers)
