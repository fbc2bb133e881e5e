"""LLaDA-Image-Turbo's text stack as a teacher: QueryFormer, LLaDA2-MoE backbone, text projection → [n, 256, 2560].

The facts (DESIGN.md §10, the pipeline's ``_encode_text``), per prompt:
1. The prompt is stripped and rendered with the pipeline's template (the same strings ggk renders for the student,
   lib/core/ggk_contract.py), then tokenized by the teacher's tokenizer with its special tokens, right-padded.
2. The QueryFormer's learned queries cross-attend to the prompt's raw token embeddings (padding masked): 256
   per-prompt query embeddings. Its LayerNorms have no weights; each residual is added to the normalised queries.
3. The backbone runs over [prompt embeddings; query embeddings] with a 4-D additive mask: padding is hidden from
   every position and the text cannot see the queries; nothing else is masked (LLaDA attends both ways). Positions
   count only real tokens. The state used is the last one (after the final norm).
4. The text projection (weightless RMSNorms, q/k normed per head, tanh-GELU MLPs, then a wider projector) maps the
   backbone's states; the targets are its rows at the query positions.

Two things the peer app gets wrong, and this module does not:
- The projection's self-attention has no mask in the original, which is run one prompt at a time. In a padded batch
  the padding would leak into every prompt's rows, so the batch masks the projection's keys to each prompt's own
  rows: the batched targets equal the one-prompt ones (gguf_assets_tests/lib/precompute/test_llada_teacher.py).
- The backbone is the repo's own code (remote code, only with materials.trust_remote_code). Under transformers 5 it
  needs the 4.x "default" rope function registered, and its non-persistent rotary tables (``inv_freq``) may come
  out of the meta-device load uninitialised: every table is recomputed from the module's own rope function and
  checked, and a teacher whose table cannot be made right is refused, never used (scrambled positions still give
  plausible rows: the peer measured 0.887 against 0.998 centred cosine).

The QueryFormer and the projection are this module's own torch code, loaded strictly from their configs and
safetensors: a missing, unexpected or misshapen tensor is an error that names it and its file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from gguf_assets.lib.core.ggk_contract import rendered_prompt
from gguf_assets.lib.core.quiet import quiet_libraries
from gguf_assets.lib.materials.teacher.layout import (
    PROJECTION_DIR,
    QUERYFORMER_DIR,
    TEXT_ENCODER_DIR,
    TOKENIZER_DIR,
)
from gguf_assets.lib.materials.teacher.text_stack import (  # noqa: F401  (the tests read them here too)
    ProjectionBlock,
    QueryFormer,
    QueryFormerBlock,
    TextProjection,
    default_rope_parameters,
    default_rope_registered,
    rms_norm,
    written_for_transformers_4,
)
from gguf_assets.lib.precompute.teacher import (
    OnBatch,
    TeacherError,
    TeacherTargets,
    _execution_device,
    device_map_summary,
    empty_model,
    pad_token_id,
    plan_placement,
    summarize_placement,
    targets_in_batches,
)
from gguf_assets.lib.project.settings import Settings

log = logging.getLogger(__name__)

PARTS_WEIGHTS = "diffusion_pytorch_model.safetensors"


def teacher_text(prompt: str) -> str:
    """The pipeline's text for ``prompt``: stripped, then LLaDA-Image's template (the empty prompt has its own)."""
    return rendered_prompt(prompt.strip())


# -- the pipeline's own small modules -------------------------------------------------------------------------

def load_part(module_class, folder: Path, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``module_class`` built from ``folder``/config.json, its weights loaded strictly from the folder's safetensors."""
    config_file, weights_file = folder / "config.json", folder / PARTS_WEIGHTS
    for file in (config_file, weights_file):
        if not file.is_file():
            raise TeacherError(f"{file} is missing: the teacher's {folder.name}/ needs config.json and "
                               f"{PARTS_WEIGHTS}. Run `gguf-trainer run` again to fetch it, or restore the folder.")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        module = module_class(config)
    except (ValueError, KeyError, TypeError) as exc:
        raise TeacherError(f"{config_file}: cannot build the {folder.name} from it ({type(exc).__name__}: {exc}).") \
            from None
    state = load_file(str(weights_file))
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = sorted(f"{k} {tuple(state[k].shape)} (config says {tuple(expected[k].shape)})"
                       for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or misshapen:
        found = "; ".join(part for part in (
            f"missing tensors: {', '.join(missing[:6])}" if missing else "",
            f"unexpected tensors: {', '.join(unexpected[:6])}" if unexpected else "",
            f"misshapen tensors: {', '.join(misshapen[:4])}" if misshapen else "") if part)
        raise TeacherError(f"{weights_file} does not match {config_file}: {found}. The folder is not the "
                           f"{folder.name} of an LLaDA-Image pipeline this product reads.")
    module.load_state_dict(state, strict=True)
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


# -- the backbone's rotary tables under transformers 5 --------------------------------------------------------

def rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if "inv_freq" in getattr(m, "_buffers", {})]


def table_is_plain(table: torch.Tensor | None) -> bool:
    """A plain rotary table: finite, starting at 1, strictly decreasing, positive (uninitialised memory is not)."""
    if table is None or table.numel() == 0 or table.device.type == "meta":
        return False
    f = table.detach().float().cpu()
    return bool(torch.isfinite(f).all() and abs(float(f[0]) - 1.0) < 1e-4 and (f > 0).all()
                and (f[1:] < f[:-1]).all())


def repair_rotary_tables(model: nn.Module) -> list[str]:
    """Recompute every rotary table from its module's own rope function; refuse one that stays wrong.

    Returns the modules whose table was wrong and is now repaired."""
    repaired, refused = [], []
    for name, module in rotary_modules(model):
        current = module.inv_freq
        init = getattr(module, "rope_init_fn", None)
        if init is None:  # nothing to recompute it from: accept a plain table only
            if not table_is_plain(current):
                refused.append(name)
            continue
        device = None if current.device.type == "meta" else current.device
        expected, scaling = init(module.config, device)
        if current.device.type != "meta" and current.shape == expected.shape \
                and torch.equal(current.float(), expected.float().to(current.device)):
            continue
        with torch.no_grad():
            module.inv_freq = expected.to(device=device, dtype=torch.float32)
        module.original_inv_freq = module.inv_freq
        module.attention_scaling = scaling
        repaired.append(name)
        if not table_is_plain(module.inv_freq):
            refused.append(name)
    if refused:
        raise TeacherError(f"the teacher's rotary position tables ({', '.join(refused)}.inv_freq) are not a plain "
                           "decreasing table after loading and could not be recomputed: its targets would have "
                           "scrambled positions, so it is not used. Check the text_encoder's config "
                           "(rope_theta, head_dim) and its modeling code.")
    return repaired


# -- the teacher -------------------------------------------------------------------------------------------------

class LLaDAImageTeacher:
    """The teacher for materials.teacher = an LLaDA-Image pipeline repo or folder (lib/materials/teacher/layout.py)."""

    def __init__(self, folder: Path, settings: Settings, device: torch.device, *,
                 gpu_budget_gib: float | None = None, load_backbone=None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        if not settings.materials.trust_remote_code:  # the materials step refuses first; this is the last guard
            raise TeacherError(f"{folder / TEXT_ENCODER_DIR} runs the repo's own code: set "
                               "materials.trust_remote_code: true to allow it.")
        self.settings, self.device = settings, device
        # bf16 on GPUs as the checkpoint ships; CPU bf16 matmuls are slow, so f32 there.
        self.dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        quiet_libraries()
        encoder = folder / TEXT_ENCODER_DIR
        allowed = settings.materials.trust_remote_code  # True here: checked above, and by the materials step
        with written_for_transformers_4():
            config = AutoConfig.from_pretrained(encoder, trust_remote_code=allowed)
        self.queryformer = load_part(QueryFormer, folder / QUERYFORMER_DIR, device=device, dtype=self.dtype)
        self.projection = load_part(TextProjection, folder / PROJECTION_DIR, device=device, dtype=self.dtype)
        self.n_query = int(self.queryformer.meta_queries.shape[0])
        self.dim = int(self.projection.projector.out_features)
        hidden = int(config.hidden_size)
        for part, width in ((QUERYFORMER_DIR, self.queryformer.meta_queries.shape[1]),
                            (PROJECTION_DIR, self.projection.projector.in_features)):
            if width != hidden:
                raise TeacherError(f"{folder / part}/config.json: hidden_size {width} does not match the text "
                                   f"encoder's {hidden} ({encoder}/config.json); the parts are from different models.")
        self.max_prompt_tokens = int(getattr(config, "max_position_embeddings", 32768)) - self.n_query
        self.tokenizer = AutoTokenizer.from_pretrained(folder / TOKENIZER_DIR)
        with written_for_transformers_4():
            self.placement = plan_placement(encoder, settings, device, dtype=self.dtype,
                                            gpu_budget_gib=gpu_budget_gib)
            kwargs = {} if self.placement.device_map is None else {"device_map": self.placement.device_map,
                                                                    "max_memory": self.placement.max_memory or None}
            self.model = (load_backbone or _load_backbone)(encoder, dtype=self.dtype, trust_remote_code=allowed,
                                                           **kwargs)
        if self.placement.device_map is None:
            self.model.to(device)
        elif self.placement.strategy == "balanced":
            self.placement.summary = device_map_summary(self.model, self.model.hf_device_map)
        self.model.eval()
        self.repaired = repair_rotary_tables(self.model)
        if self.repaired:
            log.info("teacher: recomputed the rotary tables of %d module(s) that the load left uninitialised",
                     len(self.repaired))
        self.backbone = self.model.base_model
        log.info("teacher placed (%s): %s", self.placement.strategy, summarize_placement(self.placement.summary))

    def tokenize(self, prompts: list[str]) -> tuple[list[list[int]], int]:
        ids = self.tokenizer([teacher_text(p) for p in prompts], add_special_tokens=True)["input_ids"]
        truncated = sum(1 for row in ids if len(row) > self.max_prompt_tokens)
        return [list(row[:self.max_prompt_tokens]) for row in ids], truncated

    def forward_batch(self, rows: list[list[int]]) -> torch.Tensor:
        """[B, Q, P] targets for prompts of token ids ``rows`` (any lengths: right-padded here)."""
        embed = self.model.get_input_embeddings()
        where = _execution_device(embed, self.device)
        batch, longest = len(rows), max(len(r) for r in rows)
        ids = torch.full((batch, longest), pad_token_id(self.tokenizer), dtype=torch.long)
        keep_text = torch.zeros(batch, longest, dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            keep_text[i, :len(row)] = True
        embeddings = embed(ids.to(where)).to(self.device, self.dtype)
        queries = self.queryformer(embeddings, keep_text.to(self.device))
        keep = torch.cat([keep_text, torch.ones(batch, self.n_query, dtype=torch.bool)], 1)
        positions = (keep.long().cumsum(1) - 1).clamp_min(0)
        hidden = self.backbone(inputs_embeds=torch.cat([embeddings, queries], 1).to(where),
                               attention_mask=backbone_mask(keep, longest, self.dtype).to(where),
                               position_ids=positions.to(where), use_cache=False, return_dict=True).last_hidden_state
        projected = self.projection(hidden.to(self.device, self.dtype), keep.to(self.device))
        return projected[:, longest:, :]

    @torch.inference_mode()
    def encode(self, prompts: list[str], *, dtype: torch.dtype = torch.float32,
               on_batch: OnBatch | None = None) -> TeacherTargets:
        """[n, Q, P] targets in the order of ``prompts``."""
        tokens, truncated = self.tokenize(prompts)
        if truncated:
            log.warning("%d of %d prompts are longer than the teacher's %d prompt positions; they were truncated",
                        truncated, len(prompts), self.max_prompt_tokens)
        return targets_in_batches(tokens, truncated, self.forward_batch, shape=(self.n_query, self.dim),
                                  settings=self.settings, dtype=dtype, on_batch=on_batch)


def backbone_mask(keep: torch.Tensor, text_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """The backbone's 4-D additive mask [B, 1, L, L] for ``keep`` [B, L] (text padded to ``text_positions``, then
    the query rows): padding is hidden from every position, the text cannot see the queries, nothing else is masked.

    A 2-D mask would not do: LLaDA2-MoE's code turns it causal."""
    blocked = ~keep[:, None, None, :].expand(-1, 1, keep.shape[1], -1).clone()
    blocked[:, :, :text_positions, text_positions:] = True
    return torch.zeros(blocked.shape, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)


def empty_backbone(folder: Path, settings: Settings, dtype: torch.dtype):
    """A pipeline's text encoder on the meta device, by its own code (for the estimate's sizes and placements)."""
    with written_for_transformers_4():
        return empty_model(folder / TEXT_ENCODER_DIR, settings, dtype)


def _load_backbone(encoder: Path, *, dtype: torch.dtype, trust_remote_code: bool, **placement):
    """The repo's own LLaDA2-MoE code (``trust_remote_code``: materials.trust_remote_code, which the caller
    checked), sdpa attention."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(encoder, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code,
                                     attn_implementation="sdpa", **placement)
