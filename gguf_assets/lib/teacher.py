"""The teacher: prompt tokens followed by the checkpoint's Q query rows → Q x D targets.

Batches are right-padded: [prompt tokens, query rows, padding]. With causal attention no
real position ever attends to padding, and positions stay 0..n-1 per row, so a prompt's
targets do not depend on what it was batched with (up to float rounding).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from gguf_assets.lib.batching import pack_batches
from gguf_assets.lib.settings import Settings

log = logging.getLogger(__name__)

MOCK_QUERY_ROWS = 256
MOCK_DIM = 64
MOCK_SEED = 20260101


def apply_template(template: str, prompt: str) -> str:
    return template.replace("{prompt}", prompt)


class HFTeacher:
    """A transformers backbone (safetensors only) with query rows appended to each prompt."""

    def __init__(self, folder: Path, settings: Settings, device: torch.device) -> None:
        from transformers import AutoModel, AutoTokenizer

        m, p = settings.materials, settings.precompute
        self.settings = settings
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=m.trust_remote_code)
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.model = AutoModel.from_pretrained(folder, dtype=dtype, use_safetensors=True,
                                               trust_remote_code=m.trust_remote_code,
                                               **placement_kwargs(p, device))
        if device.type == "cpu" or not hasattr(self.model, "hf_device_map"):
            self.model.to(device)
        self.model.eval()
        with safe_open(str(Path(folder) / m.query_rows_file), "pt") as fh:
            self.query_rows = fh.get_tensor(m.query_rows_tensor).to(dtype)
        self.dim = int(self.model.config.hidden_size)
        if self.query_rows.ndim != 2 or self.query_rows.shape[1] != self.dim:
            raise ValueError(f"query rows {m.query_rows_file}:{m.query_rows_tensor} have shape "
                             f"{tuple(self.query_rows.shape)}, but the teacher's hidden size is {self.dim}.")
        self.n_query = int(self.query_rows.shape[0])
        self.max_prompt_tokens = int(getattr(self.model.config, "max_position_embeddings", 32768)) - self.n_query
        self.truncated = 0

    def _tokens(self, prompts: list[str]) -> list[list[int]]:
        template = self.settings.precompute.prompt_template
        ids = self.tokenizer([apply_template(template, p) for p in prompts], add_special_tokens=True)["input_ids"]
        out = []
        for row in ids:
            if len(row) > self.max_prompt_tokens:
                self.truncated += 1
                row = row[: self.max_prompt_tokens]
            out.append(row)
        return out

    @torch.inference_mode()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        """[n, Q, D] float32 targets, in the order of ``prompts``."""
        p, layer = self.settings.precompute, self.settings.materials.teacher_layer
        tokens = self._tokens(prompts)
        out = torch.empty(len(prompts), self.n_query, self.dim, dtype=torch.float32)
        embed = self.model.get_input_embeddings()
        first_device = embed.weight.device
        pad_id = self.tokenizer.pad_token_id or 0
        for batch in pack_batches([len(t) for t in tokens], max_batch=p.teacher_batch,
                                  token_budget=p.token_budget, extra_tokens=self.n_query):
            longest = max(len(tokens[i]) for i in batch)
            total = longest + self.n_query
            ids = torch.full((len(batch), total), pad_id, dtype=torch.long)
            mask = torch.zeros(len(batch), total, dtype=torch.long)
            for row, i in enumerate(batch):
                n = len(tokens[i])
                ids[row, :n] = torch.tensor(tokens[i], dtype=torch.long)
                mask[row, : n + self.n_query] = 1
            embeds = embed(ids.to(first_device))
            for row, i in enumerate(batch):
                n = len(tokens[i])
                embeds[row, n:n + self.n_query] = self.query_rows.to(first_device)
            result = self.model(inputs_embeds=embeds, attention_mask=mask.to(first_device),
                                output_hidden_states=layer != -1)
            hidden = result.last_hidden_state if layer == -1 else result.hidden_states[layer]
            for row, i in enumerate(batch):
                n = len(tokens[i])
                out[i] = hidden[row, n:n + self.n_query].float().cpu()
        return out


def placement_kwargs(p, device: torch.device) -> dict:
    """transformers/accelerate device map arguments for the teacher on a CUDA device."""
    if device.type != "cuda":
        return {}
    max_memory: dict = {}
    gib = 2**30
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        budget = p.teacher_gpu_memory_gib if (p.teacher_gpu_memory_gib and i == (device.index or 0)) else free / gib * 0.9
        max_memory[i] = int(budget * gib)
    if p.teacher_cpu_memory_gib:
        max_memory["cpu"] = int(p.teacher_cpu_memory_gib * gib)
    return {"device_map": p.teacher_placement, "max_memory": max_memory}


class MockTeacher:
    """Dev smoke test: synthetic targets that are a deterministic, learnable function of the text.

    target[q] = gain[q] * tanh(f @ A) @ B + base[q], where f is the mean of the student's hidden
    states over the prompt's tokens (rescaled to unit variance) and A, B, gain, base are fixed
    random values (the gain makes query rows differ, as a real teacher's do).
    The adapter sees exactly those states, so it can learn the mapping and smoke tests can
    assert learning; the targets therefore depend on the student (the fingerprint says so).
    """

    def __init__(self, student, *, n_query: int = MOCK_QUERY_ROWS, dim: int = MOCK_DIM) -> None:
        self.student = student
        self.n_query, self.dim = n_query, dim
        g = torch.Generator().manual_seed(MOCK_SEED)
        width = student.dim
        self.a = torch.randn(width, 32, generator=g) / width**0.5 * 3
        self.b = torch.randn(32, dim, generator=g) / 32**0.5
        self.gain = 0.5 + torch.rand(n_query, 1, generator=g)
        self.base = torch.randn(n_query, dim, generator=g) * 0.5

    @torch.inference_mode()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        states, _ = self.student.encode(prompts)
        out = torch.empty(len(prompts), self.n_query, self.dim)
        for i, s in enumerate(states):
            s = s.float()
            f = s.mean(0) / s.std().clamp_min(1e-6) if s.shape[0] > 1 else torch.zeros(self.student.dim)
            out[i] = self.gain * (torch.tanh(f @ self.a) @ self.b) + self.base
        return out


def teacher_shape(folder: Path, settings: Settings) -> tuple[int, int]:
    """(Q, D) without loading the backbone."""
    m = settings.materials
    hidden = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))["hidden_size"]
    with safe_open(str(Path(folder) / m.query_rows_file), "pt") as fh:
        q = fh.get_slice(m.query_rows_tensor).get_shape()[0]
    return int(q), int(hidden)
