"""The student: hidden states of one layer for a prompt's tokens (variable length)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from gguf_assets.lib.batching import pack_batches
from gguf_assets.lib.settings import Settings
from gguf_assets.lib.teacher import apply_template

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def load_tokenizer(folder: Path, settings: Settings):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=settings.materials.trust_remote_code)


class Student:
    def __init__(self, folder: Path, settings: Settings, device: torch.device) -> None:
        from transformers import AutoModel

        self.settings = settings
        self.device = device
        self.dtype = TORCH_DTYPES[settings.precompute.student_dtype]
        self.tokenizer = load_tokenizer(folder, settings)
        # f16 matmuls are slow or missing on CPU; compute in f32 there and store in the dtype.
        compute = torch.float32 if device.type == "cpu" else self.dtype
        self.model = AutoModel.from_pretrained(folder, dtype=compute, use_safetensors=True,
                                               trust_remote_code=settings.materials.trust_remote_code).to(device)
        self.model.eval()
        self.dim = int(self.model.config.hidden_size)
        self.max_tokens = int(getattr(self.model.config, "max_position_embeddings", 32768))
        self.truncated = 0

    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        template = self.settings.precompute.prompt_template
        ids = self.tokenizer([apply_template(template, p) for p in prompts], add_special_tokens=True)["input_ids"]
        out = []
        for row in ids:
            if len(row) > self.max_tokens:
                self.truncated += 1
                row = row[: self.max_tokens]
            out.append(row)
        return out

    @torch.inference_mode()
    def encode(self, prompts: list[str]) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Per prompt: states [L, Ds] in the student dtype, and the token ids."""
        layer = self.settings.materials.student_layer
        tokens = self.tokenize(prompts)
        states: list[torch.Tensor] = [torch.empty(0, self.dim, dtype=self.dtype)] * len(prompts)
        nonempty = [i for i, t in enumerate(tokens) if t]
        pad_id = self.tokenizer.pad_token_id or 0
        for sub in pack_batches([len(tokens[i]) for i in nonempty], max_batch=self.settings.precompute.student_batch):
            batch = [nonempty[j] for j in sub]
            longest = max(len(tokens[i]) for i in batch)
            ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
            mask = torch.zeros(len(batch), longest, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : len(tokens[i])] = torch.tensor(tokens[i])
                mask[row, : len(tokens[i])] = 1
            result = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                output_hidden_states=layer != -1)
            hidden = result.last_hidden_state if layer == -1 else result.hidden_states[layer]
            for row, i in enumerate(batch):
                states[i] = hidden[row, : len(tokens[i])].to("cpu", self.dtype).clone()
        return states, tokens
