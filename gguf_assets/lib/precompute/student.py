"""The student: its final-norm hidden states at every position of the prompt as ggk renders it (variable length).

The input is ggk's, token for token (lib/core/ggk_contract.py): the LLaDA-Image template, BPE-tokenized in ggk's
pieces with no special tokens, the text after ggk's emphasis parser. States are stored flat, [all tokens, Ds]
with offsets [n+1], so variable lengths cost no padding on disk or in memory: each batch's real rows are
copied straight into their slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from gguf_assets.lib.core.ggk_contract import llada_image_pieces
from gguf_assets.lib.core.quiet import quiet_libraries
from gguf_assets.lib.materials.ggk_tokenizer import GgkTokenizer
from gguf_assets.lib.precompute.batching import pack_batches, right_padded
from gguf_assets.lib.precompute.teacher import OnBatch, pad_token_id
from gguf_assets.lib.project.settings import Settings

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def load_tokenizer(folder: Path, settings: Settings):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=settings.materials.trust_remote_code)


def ggk_token_ids(tokenizer: GgkTokenizer, text: str) -> list[int]:
    """The token ids ggk feeds the student for the prompt ``text``: each of ggk's pieces encoded on its own by
    ggk's tokenizer (conditioner.hpp, tokenize). Emphasis weights are dropped: ggk aborts on a weighted prompt
    with a resampler (ggk_contract.emphasis_problem), and the text it would read is what is kept."""
    ids: list[int] = []
    for piece in llada_image_pieces(text):
        ids += tokenizer.encode(piece.text)
    return ids


@dataclass
class StudentStates:
    hidden: torch.Tensor      # [tokens, Ds] in the student dtype: the final-norm states
    offsets: torch.Tensor     # [n + 1] int64: prompt i is hidden[offsets[i]:offsets[i + 1]]
    token_ids: torch.Tensor   # [tokens] int32
    truncated: int

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
        self.tokenizer = load_tokenizer(folder, settings)  # its pad id; the ids themselves are ggk's
        self.ggk_tokenizer = GgkTokenizer.of_folder(folder)
        # f16 matmuls are slow or missing on CPU; compute in f32 there and store in the dtype.
        compute = torch.float32 if device.type == "cpu" else self.dtype
        quiet_libraries()
        self.model = AutoModel.from_pretrained(folder, dtype=compute, use_safetensors=True,
                                               trust_remote_code=settings.materials.trust_remote_code).to(device)
        self.model.eval()
        self.dim = int(self.model.config.hidden_size)
        self.max_tokens = int(getattr(self.model.config, "max_position_embeddings", 32768))

    def tokenize(self, prompts: list[str]) -> tuple[list[list[int]], int]:
        """ggk's token ids per prompt, cut to the student's positions; also how many were cut."""
        ids = [ggk_token_ids(self.ggk_tokenizer, p) for p in prompts]
        truncated = sum(1 for row in ids if len(row) > self.max_tokens)
        return [row[:self.max_tokens] for row in ids], truncated

    @torch.inference_mode()
    def encode(self, prompts: list[str], *, on_batch: OnBatch | None = None) -> StudentStates:
        p = self.settings.precompute
        tokens, truncated = self.tokenize(prompts)
        if truncated:
            log.warning("%d of %d prompts are longer than the student's %d positions; they were truncated",
                        truncated, len(prompts), self.max_tokens)
        lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
        offsets = torch.zeros(len(prompts) + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        hidden = torch.empty(int(offsets[-1]), self.dim, dtype=self.dtype)
        nonempty = [i for i, t in enumerate(tokens) if t]
        for sub in pack_batches([len(tokens[i]) for i in nonempty], max_batch=p.student_batch,
                                token_budget=p.token_budget):
            batch = [nonempty[j] for j in sub]
            rows = [tokens[i] for i in batch]
            ids, mask = right_padded(rows, pad_id=pad_token_id(self.tokenizer))
            # last_hidden_state is after the final norm: what ggk gives the adapter.
            states = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                use_cache=False).last_hidden_state
            # Real positions in row-major order are the prompts' tokens back to back; copy them to their slots.
            slots = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in batch])
            hidden[slots] = states[mask.to(states.device).bool()].to("cpu", self.dtype)
            if on_batch:
                on_batch(len(batch), len(slots))
        if on_batch and len(nonempty) < len(prompts):
            on_batch(len(prompts) - len(nonempty), 0)
        token_ids = torch.tensor([t for row in tokens for t in row], dtype=torch.int32)
        return StudentStates(hidden, offsets, token_ids, truncated)
