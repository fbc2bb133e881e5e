"""The teacher: prompt tokens followed by the checkpoint's Q query rows → Q x D targets.

Batches are right-padded: [prompt tokens, query rows, padding]. With causal attention no
real position ever attends to padding, and positions stay 0..n-1 per row, so a prompt's
targets do not depend on what it was batched with (up to float rounding). Prompts are
sorted by length and packed under the token budget (batching.pack_batches); results are
written back by prompt index, which restores the original order.

Placement on CUDA goes through accelerate/transformers device maps with an explicit
`max_memory`: `sequential` fills the chosen device, then the other GPUs, then CPU RAM;
`balanced` is transformers' even split. On a CUDA out-of-memory error under `sequential`
the caller retries with the GPU budget lowered (`lower_budget_on_oom`).

A teacher read at a middle layer (materials.teacher_layer) is built with only the blocks below
that layer (`blocks_read`): the blocks above it are neither loaded (from_pretrained skips their
weights) nor placed nor run, and the read layer's output is taken by a forward hook on the last
kept block, so no layer's output but that one is kept.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psutil
import torch
from safetensors import safe_open

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.ggk_contract import LLADA_IMAGE, rendered_prompt
from gguf_assets.lib.core.quiet import quiet_libraries
from gguf_assets.lib.precompute.batching import pack_batches, right_padded
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.teacher_choice import MOCK_DIM, MOCK_QUERY_ROWS, TeacherLayerError, blocks_for_layer

log = logging.getLogger(__name__)

MOCK_SEED = 20260101
GIB = 2**30
# Share of free memory used when a budget is 0 (auto); transformers' own default is the same.
AUTO_MEMORY_FRACTION = 0.9
OOM_STEP_GIB = 2.0
OOM_MAX_RETRIES = 3
# Module names that are one transformer block (never split across devices by accelerate), and of their list.
_LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.\d+$")
_LAYER_LIST_NAME = re.compile(r"(?:^|\.)(?:layers|h|blocks)$")

T = TypeVar("T")
OnBatch = Callable[[int, int], None]  # (prompts, text tokens) finished


class TeacherError(UserError, RuntimeError):
    """A teacher that cannot be used as configured; the message names the setting to change."""


class PrecomputeOutOfMemory(RuntimeError):
    """Out of memory while precomputing; the message says which settings to lower."""


def apply_template(template: str, prompt: str) -> str:
    """The teacher's text for ``prompt``: ``template`` with {prompt} replaced, or, for the template named
    ``llada-image``, the prompt rendered as ggk renders it for LLaDA-Image (the literal text: no emphasis parsing)."""
    if template == LLADA_IMAGE:
        return rendered_prompt(prompt)
    return template.replace("{prompt}", prompt)


def tokenize_prompts(tokenizer, prompts: list[str], *, template: str, max_tokens: int) -> tuple[list[list[int]], int]:
    """Token ids per templated prompt, cut to ``max_tokens``; also how many were cut."""
    ids = tokenizer([apply_template(template, p) for p in prompts], add_special_tokens=True)["input_ids"]
    truncated = sum(1 for row in ids if len(row) > max_tokens)
    return [list(row[:max_tokens]) for row in ids], truncated


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


@dataclass
class TeacherTargets:
    targets: torch.Tensor      # [n, Q, D] in the requested dtype, in prompt order
    text_tokens: int           # real prompt tokens computed (query rows not included)
    truncated: int             # prompts cut to the model's maximum length
    peak_abs: float            # max |target| before the dtype cast; inf if any was non-finite


def load_query_rows(folder: Path, settings: Settings, hidden_size: int,
                    rows: tuple[Path, str, str] | None = None) -> torch.Tensor:
    """The Q x D query rows, checked against the teacher's hidden size before the backbone loads. ``rows``:
    (file, tensor, setting) when they are a material of their own (materials.query_rows), else the
    teacher folder's query_rows_file."""
    m = settings.materials
    file, tensor, setting = rows or (Path(folder) / m.query_rows_file, m.query_rows_tensor,
                                     "materials.query_rows_file")
    named = f"{setting} = {m.query_rows_file!r}" if rows is None else setting
    if not file.is_file():
        raise TeacherError(f"{named}: {file} does not exist; the teacher needs its Q x {hidden_size} query rows.")
    with safe_open(str(file), "pt") as fh:
        if tensor not in fh.keys():
            raise TeacherError(f"materials.query_rows_tensor = {tensor!r} is not in {file} "
                               f"(it holds {sorted(fh.keys())}).")
        rows_t = fh.get_tensor(tensor)
    if rows_t.ndim != 2 or rows_t.shape[1] != hidden_size or rows_t.shape[0] == 0:
        raise TeacherError(f"query rows {file}:{tensor} have shape {tuple(rows_t.shape)}, but the "
                           f"teacher's hidden size is {hidden_size}: they must be Q x {hidden_size}. Check "
                           + ("materials.query_rows_file / materials.query_rows_tensor" if rows is None else setting)
                           + " against materials.teacher.")
    return rows_t


# -- placement ----------------------------------------------------------------------------

def device_name(device: int | str | torch.device) -> str:
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def memory_budgets(settings: Settings, device: torch.device, *, free_gpu_bytes: dict[int, int],
                   available_cpu_bytes: int, gpu_budget_gib: float | None = None) -> dict[int | str, int]:
    """accelerate's ``max_memory`` in fill order: the chosen GPU, the other GPUs, then CPU RAM.

    ``gpu_budget_gib`` overrides precompute.teacher_gpu_memory_gib (the out-of-memory retry lowers it);
    a budget of 0 means AUTO_MEMORY_FRACTION of what is free.
    """
    p = settings.precompute
    chosen = device.index or 0
    if chosen not in free_gpu_bytes:
        raise TeacherError(f"precompute.device = {p.device!r}: there is no GPU {chosen} here "
                           f"(GPUs: {sorted(free_gpu_bytes) or 'none'}).")
    budget = gpu_budget_gib if gpu_budget_gib is not None else p.teacher_gpu_memory_gib
    max_memory: dict[int | str, int] = {
        chosen: int(budget * GIB) if budget else int(free_gpu_bytes[chosen] * AUTO_MEMORY_FRACTION)}
    for index in sorted(free_gpu_bytes):
        if index != chosen:
            max_memory[index] = int(free_gpu_bytes[index] * AUTO_MEMORY_FRACTION)
    max_memory["cpu"] = (int(p.teacher_cpu_memory_gib * GIB) if p.teacher_cpu_memory_gib
                         else int(available_cpu_bytes * AUTO_MEMORY_FRACTION))
    return max_memory


def blocks_read(config, layer: int) -> int | None:
    """How many of the teacher's blocks ``materials.teacher_layer = layer`` needs (teacher_choice.blocks_for_layer,
    which says what each value reads), or None when it reads the last state: every block runs, and the state is
    taken after the final norm. A config without num_hidden_layers gives None (the forward then runs every block;
    see HFTeacher.forward_batch)."""
    try:
        return blocks_for_layer(getattr(config, "num_hidden_layers", None), layer)
    except TeacherLayerError as exc:
        raise TeacherError(str(exc)) from None


def keep_blocks(config, blocks: int | None) -> None:
    """Cut ``config`` to its first ``blocks`` blocks (None: all), so that a model built from it has only those:
    from_pretrained then leaves the others' weights unread, and placement plans only what is kept."""
    n = getattr(config, "num_hidden_layers", None)
    if blocks is None or not isinstance(n, int) or blocks >= n:
        return
    config.num_hidden_layers = blocks
    types = getattr(config, "layer_types", None)  # per-block attention kinds (Qwen3: full or sliding)
    if isinstance(types, list) and len(types) == n:
        config.layer_types = types[:blocks]


def empty_model(folder: Path, settings: Settings, dtype: torch.dtype, *, blocks: int | None = None):
    """The teacher's module tree on the meta device: sizes and names without loading weights. ``blocks``: build
    only the first that many (``keep_blocks``); None: all."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel

    remote = settings.materials.trust_remote_code
    config = AutoConfig.from_pretrained(folder, trust_remote_code=remote)
    keep_blocks(config, blocks)
    with init_empty_weights():
        return AutoModel.from_config(config, dtype=dtype, trust_remote_code=remote)


def sequential_device_map(model, max_memory: dict[int | str, int]) -> dict[str, int | str]:
    """Fill devices in the order of ``max_memory``'s keys (accelerate itself always starts at GPU 0).

    The GPUs are renumbered into fill order for accelerate's planner, and the plan is mapped back.
    """
    from transformers.integrations.accelerate import infer_auto_device_map

    gpus = [k for k in max_memory if isinstance(k, int)]
    by_slot = dict(enumerate(gpus))
    slots = {slot: max_memory[gpu] for slot, gpu in by_slot.items()}
    slots.update({k: v for k, v in max_memory.items() if not isinstance(k, int)})
    planned = infer_auto_device_map(model, max_memory=slots, no_split_module_classes=model._no_split_modules,
                                    no_placement_params=getattr(model, "_no_placement_params", None))
    return {name: by_slot[d] if isinstance(d, int) else d for name, d in planned.items()}


def device_map_summary(model, device_map: dict[str, int | str]) -> dict[str, dict[str, float]]:
    """Layers and GiB per device ("cuda:N", "cpu", "disk"), in the order devices are filled."""

    def where(name: str) -> str:
        best = max((p for p in device_map if p == "" or name == p or name.startswith(p + ".")), key=len, default=None)
        return device_name(device_map[best]) if best is not None else "unplaced"

    out: dict[str, dict[str, float]] = {}
    for d in dict.fromkeys(device_name(v) for v in device_map.values()):
        out[d] = {"layers": 0, "gib": 0.0}
    for name, module in model.named_modules():
        if _LAYER_NAME.search(name):
            out.setdefault(where(name), {"layers": 0, "gib": 0.0})["layers"] += 1
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen:  # tied weights count once
            continue
        seen.add(id(tensor))
        out.setdefault(where(name), {"layers": 0, "gib": 0.0})["gib"] += tensor.numel() * tensor.element_size() / GIB
    return {d: {"layers": v["layers"], "gib": round(v["gib"], 4)} for d, v in out.items()}


@dataclass
class Placement:
    """Where the teacher's weights go; ``device_map`` None means all of it on one device."""

    strategy: str                               # sequential | balanced | single
    device_map: dict[str, int | str] | str | None
    max_memory: dict[int | str, int] = field(default_factory=dict)
    gpu_budget_gib: float | None = None
    summary: dict[str, dict[str, float]] = field(default_factory=dict)

    def metadata(self) -> dict[str, float | str]:
        """Flat numbers for Dagster metadata: teacher_<device>_layers / _gib."""
        out: dict[str, float | str] = {"teacher_placement": self.strategy}
        if self.gpu_budget_gib is not None:
            out["teacher_gpu_budget_gib"] = round(self.gpu_budget_gib, 2)
        for d, v in self.summary.items():
            key = d.replace(":", "")
            out[f"teacher_{key}_layers"] = v["layers"]
            out[f"teacher_{key}_gib"] = v["gib"]
        return out


def cuda_free_bytes() -> dict[int, int]:
    return {i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())}


def auto_gpu_budget_gib(settings: Settings, device: torch.device) -> float:
    """The chosen device's GPU budget in GiB: the setting, or AUTO_MEMORY_FRACTION of its free memory."""
    p = settings.precompute
    if p.teacher_gpu_memory_gib:
        return p.teacher_gpu_memory_gib
    return cuda_free_bytes()[device.index or 0] * AUTO_MEMORY_FRACTION / GIB


def plan_placement(folder: Path, settings: Settings, device: torch.device, *, dtype: torch.dtype,
                   free_gpu_bytes: dict[int, int] | None = None, available_cpu_bytes: int | None = None,
                   gpu_budget_gib: float | None = None, blocks: int | None = None) -> Placement:
    """The device map for loading the teacher. On CPU the whole model stays on the CPU.

    Free memory is measured unless given (tests give it, to plan for GPUs this machine lacks). ``blocks``: plan
    only the first that many blocks, those a middle-layer teacher keeps (``blocks_read``); None: all.
    """
    if device.type != "cuda" and free_gpu_bytes is None:
        model = empty_model(folder, settings, dtype, blocks=blocks)
        return Placement("single", None, summary=device_map_summary(model, {"": device_name(device)}))
    p = settings.precompute
    free = cuda_free_bytes() if free_gpu_bytes is None else free_gpu_bytes
    cpu = psutil.virtual_memory().available if available_cpu_bytes is None else available_cpu_bytes
    max_memory = memory_budgets(settings, device, free_gpu_bytes=free, available_cpu_bytes=cpu,
                                gpu_budget_gib=gpu_budget_gib)
    budget = max_memory[device.index or 0] / GIB
    model = empty_model(folder, settings, dtype, blocks=blocks)
    if p.teacher_placement == "balanced":
        # transformers' even split; the map is known once loaded, natural GPU order as transformers expects.
        ordered = {k: max_memory[k] for k in sorted(k for k in max_memory if isinstance(k, int))}
        ordered["cpu"] = max_memory["cpu"]
        return Placement("balanced", "balanced", ordered, budget)
    device_map = sequential_device_map(model, max_memory)
    summary = device_map_summary(model, device_map)
    if "disk" in summary:
        total = sum(v["gib"] for v in summary.values())
        raise TeacherError(
            f"the teacher ({total:.1f} GiB) does not fit in GPU memory plus CPU RAM: {summary['disk']['gib']:.1f} GiB "
            f"would go to disk. Raise precompute.teacher_cpu_memory_gib (now {p.teacher_cpu_memory_gib or 'auto'}) or "
            f"precompute.teacher_gpu_memory_gib (now {budget:.1f} GiB), or free memory on this machine.")
    return Placement("sequential", device_map, max_memory, budget, summary)


# -- out of memory --------------------------------------------------------------------------

def is_cuda_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError)
                                                       and "CUDA out of memory" in str(exc))


def is_out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return (isinstance(exc, MemoryError) or is_cuda_out_of_memory(exc)
            or (isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)))


def oom_advice(settings: Settings, *, half: str = "teacher", gpu_budget_gib: float | None = None) -> str:
    """What to lower after running out of memory while computing ``half``."""
    p = settings.precompute
    batch = (f"precompute.teacher_batch (now {p.teacher_batch})" if half == "teacher"
             else f"precompute.student_batch (now {p.student_batch})")
    parts = [f"lower precompute.token_budget (now {p.token_budget}) or {batch}"]
    if gpu_budget_gib is not None:
        parts.append(f"lower precompute.teacher_gpu_memory_gib (now {gpu_budget_gib:.1f} GiB) so more layers "
                     "stay in CPU RAM")
    parts.append(f"lower precompute.shard_size (now {p.shard_size}) if CPU RAM is what ran out")
    return "; ".join(parts) + "."


def lower_budget_on_oom(attempt: Callable[[float], T], *, budget_gib: float, placement: str,
                        advice: Callable[[float], str], step_gib: float = OOM_STEP_GIB,
                        max_retries: int = OOM_MAX_RETRIES,
                        is_oom: Callable[[BaseException], bool] = is_cuda_out_of_memory) -> tuple[T, float]:
    """Run ``attempt(budget)``; on a CUDA OOM under `sequential`, retry with ``step_gib`` less GPU budget.

    More layers then live in CPU RAM, which leaves room on the GPU for activations. Returns the
    result and the budget that worked. Other placements, other errors and the last retry fail
    with the advice of what to lower.
    """
    retries = 0
    while True:
        try:
            return attempt(budget_gib), budget_gib
        except Exception as exc:
            if not is_oom(exc):
                raise
            lower = budget_gib - step_gib
            if placement != "sequential" or retries >= max_retries or lower <= 0:
                why = ("" if placement == "sequential" else
                       f" (automatic retries only happen under sequential placement; this is {placement})")
                raise PrecomputeOutOfMemory(
                    f"the teacher ran out of GPU memory with a GPU budget of {budget_gib:.1f} GiB after {retries} "
                    f"automatic retries{why}: {advice(budget_gib)}") from exc
            log.warning("CUDA out of memory with the teacher's GPU budget at %.1f GiB; retrying with %.1f GiB "
                        "(retry %d of %d). Set precompute.teacher_gpu_memory_gib to %.1f to start there next time.",
                        budget_gib, lower, retries + 1, max_retries, lower)
        budget_gib, retries = lower, retries + 1


# -- teachers -------------------------------------------------------------------------------

def block_list(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's transformer blocks, in order (a ModuleList named layers, h or blocks), or None."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and _LAYER_LIST_NAME.search(name):
            return module
    return None


def _execution_device(module: torch.nn.Module, fallback: torch.device) -> torch.device:
    """Where a module computes: accelerate's hook knows for offloaded modules (their weights are on meta)."""
    hook_device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(device_name(hook_device))
    weight = next(module.parameters(), None)
    return fallback if weight is None or weight.device.type == "meta" else weight.device


class HFTeacher:
    """A transformers backbone (safetensors only) with query rows appended to each prompt."""

    def __init__(self, folder: Path, settings: Settings, device: torch.device, *,
                 gpu_budget_gib: float | None = None, rows: tuple[Path, str, str] | None = None) -> None:
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        m = settings.materials
        self.settings, self.device = settings, device
        config = AutoConfig.from_pretrained(folder, trust_remote_code=m.trust_remote_code)
        self.dim = int(config.hidden_size)
        # Checked before the (possibly huge) backbone loads.
        self.query_rows = load_query_rows(folder, settings, self.dim, rows)
        self.n_query = int(self.query_rows.shape[0])
        max_positions = int(getattr(config, "max_position_embeddings", 32768))
        self.max_prompt_tokens = max_positions - self.n_query
        if self.max_prompt_tokens < 1:
            raise TeacherError(f"the teacher takes at most {max_positions} positions but has {self.n_query} query rows "
                               "(materials.query_rows_file); no room is left for the prompt.")
        self.tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=m.trust_remote_code)
        # bf16 on GPUs as the checkpoints ship; CPU bf16 matmuls are slow, so f32 there.
        self.dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        # A middle layer: only the blocks below it are built, placed, loaded and run (blocks_read).
        self.blocks = blocks_read(config, m.teacher_layer)
        if self.blocks is None:  # the last state, or any layer of a config that does not say how many it has
            unknown = not isinstance(getattr(config, "num_hidden_layers", None), int)
            self.read = "all" if unknown and m.teacher_layer != -1 else "last"
        else:
            self.read = "embeddings" if self.blocks == 0 else "block"
        keep_blocks(config, self.blocks)
        self.placement = plan_placement(folder, settings, device, dtype=self.dtype, gpu_budget_gib=gpu_budget_gib,
                                        blocks=self.blocks)
        kwargs = {} if self.placement.device_map is None else {"device_map": self.placement.device_map,
                                                                "max_memory": self.placement.max_memory or None}
        quiet_libraries()  # also keeps the load report, which lists the skipped blocks as UNEXPECTED, quiet
        self.model = AutoModel.from_pretrained(folder, config=config, dtype=self.dtype, use_safetensors=True,
                                               trust_remote_code=m.trust_remote_code, **kwargs)
        if self.placement.device_map is None:
            self.model.to(device)
        elif self.placement.strategy == "balanced":
            self.placement.summary = device_map_summary(self.model, self.model.hf_device_map)
        self.model.eval()
        self._held: torch.Tensor | None = None
        if self.read == "block":
            blocks = block_list(self.model)
            if blocks is None or len(blocks) != self.blocks:
                raise TeacherError(
                    f"materials.teacher_layer = {m.teacher_layer}: the teacher ({type(self.model).__name__}) has no "
                    f"list of {self.blocks} blocks named layers, h or blocks to read that layer from; use -1 (the "
                    "last).")
            # accelerate's hooks (placement, offloading) wrap the block's forward; this one sees its output after them.
            blocks[-1].register_forward_hook(self._hold)
        self.query_rows = self.query_rows.to(self.dtype)
        log.info("teacher placed (%s): %s", self.placement.strategy, summarize_placement(self.placement.summary))

    def tokenize(self, prompts: list[str]) -> tuple[list[list[int]], int]:
        return tokenize_prompts(self.tokenizer, prompts, template=self.settings.precompute.prompt_template,
                                max_tokens=self.max_prompt_tokens)

    def _hold(self, module: torch.nn.Module, args, output) -> None:
        """Forward hook on the last kept block: its output is the read layer's state (before the final norm)."""
        self._held = output[0] if isinstance(output, tuple) else output

    def forward_batch(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The configured layer's hidden states [batch, positions, D] for assembled inputs: what transformers gives
        as ``hidden_states[materials.teacher_layer]`` of the whole model, computed by the blocks below it only."""
        if self.read == "embeddings":
            return embeds
        if self.read == "all":  # the layer count is unknown: every block runs, every state is kept
            result = self.model(inputs_embeds=embeds, attention_mask=mask, use_cache=False, output_hidden_states=True)
            return result.hidden_states[self.settings.materials.teacher_layer]
        self._held = None
        result = self.model(inputs_embeds=embeds, attention_mask=mask, use_cache=False)
        if self.read == "last":
            return result.last_hidden_state
        hidden, self._held = self._held, None
        return hidden

    def assemble(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs_embeds, mask, query positions [batch, Q]) for prompts of token ids ``rows``."""
        embed = self.model.get_input_embeddings()
        where = _execution_device(embed, self.device)
        ids, mask = right_padded(rows, pad_id=pad_token_id(self.tokenizer), extra_tokens=self.n_query)
        embeds = embed(ids.to(where))
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        positions = lengths[:, None] + torch.arange(self.n_query)[None, :]
        is_query = torch.zeros(mask.shape, dtype=torch.bool).scatter_(1, positions, True)
        # Row-major boolean assignment fills each prompt's Q query positions in order.
        embeds[is_query.to(embeds.device)] = self.query_rows.to(embeds.device, embeds.dtype).repeat(len(rows), 1)
        return embeds, mask.to(embeds.device), positions

    @torch.inference_mode()
    def encode(self, prompts: list[str], *, dtype: torch.dtype = torch.float32,
               on_batch: OnBatch | None = None) -> TeacherTargets:
        """[n, Q, D] targets in the order of ``prompts``."""
        tokens, truncated = self.tokenize(prompts)
        if truncated:
            log.warning("%d of %d prompts are longer than the teacher's %d prompt positions (%d minus %d query rows); "
                        "they were truncated", truncated, len(prompts), self.max_prompt_tokens,
                        self.max_prompt_tokens + self.n_query, self.n_query)

        def targets_of(rows: list[list[int]]) -> torch.Tensor:
            embeds, mask, positions = self.assemble(rows)
            hidden = self.forward_batch(embeds, mask)
            return hidden.gather(1, positions.to(hidden.device)[..., None].expand(-1, -1, self.dim))

        return targets_in_batches(tokens, truncated, targets_of, shape=(self.n_query, self.dim), settings=self.settings,
                                  dtype=dtype, on_batch=on_batch)


def targets_in_batches(tokens: list[list[int]], truncated: int, targets_of: Callable[[list[list[int]]], torch.Tensor],
                       *, shape: tuple[int, int], settings: Settings, dtype: torch.dtype,
                       on_batch: OnBatch | None) -> TeacherTargets:
    """[n, Q, D] targets of prompts of token ids ``tokens``, in their order: packed by length under the token budget
    (batching.pack_batches), each batch's [B, Q, D] from ``targets_of(rows)``, with the peak |target| (inf when one is
    not finite). Every teacher kind batches this way."""
    p = settings.precompute
    out = torch.empty(len(tokens), *shape, dtype=dtype)
    peak = 0.0
    for batch in pack_batches([len(t) for t in tokens], max_batch=p.teacher_batch, token_budget=p.token_budget,
                              extra_tokens=shape[0]):
        rows = [tokens[i] for i in batch]
        picked = targets_of(rows).float().cpu()
        peak = max(peak, float(picked.abs().max()) if torch.isfinite(picked).all() else float("inf"))
        out[batch] = picked.to(dtype)
        if on_batch:
            on_batch(len(batch), sum(len(r) for r in rows))
    return TeacherTargets(out, sum(len(t) for t in tokens), truncated, peak)


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
        width = self.width = student.dim
        self.a = torch.randn(width, 32, generator=g) / width**0.5 * 3
        self.b = torch.randn(32, dim, generator=g) / 32**0.5
        self.gain = 0.5 + torch.rand(n_query, 1, generator=g)
        self.base = torch.randn(n_query, dim, generator=g) * 0.5
        self.placement = Placement("mock", None)

    @torch.inference_mode()
    def encode(self, prompts: list[str], *, dtype: torch.dtype = torch.float32,
               on_batch: OnBatch | None = None) -> TeacherTargets:
        states = self.student.encode(prompts)
        out = torch.empty(len(prompts), self.n_query, self.dim, dtype=dtype)
        for i in range(len(prompts)):
            s = states.of(i).float()
            f = s.mean(0) / s.std().clamp_min(1e-6) if s.shape[0] > 1 else torch.zeros(self.width)
            out[i] = (self.gain * (torch.tanh(f @ self.a) @ self.b) + self.base).to(dtype)
        if on_batch:
            on_batch(len(prompts), states.tokens)
        peak = float(out.float().abs().max()) if out.numel() else 0.0
        return TeacherTargets(out, states.tokens, states.truncated, peak)


def summarize_placement(summary: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{d}: {v['layers']} layers, {v['gib']:.2f} GiB" for d, v in summary.items())
