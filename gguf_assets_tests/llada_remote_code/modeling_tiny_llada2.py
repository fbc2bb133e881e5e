"""A tiny bidirectional LLaDA2-MoE-like backbone (test fixture: gguf_assets_tests/llada_repo.py copies this file into
the replica's ``text_encoder/``, where transformers loads it as remote code).

It behaves like the released LLaDA2-MoE remote code where a teacher reading its hidden states can trip:

* ``TinyLLaDA2ModelLM.model`` is the backbone (``word_embeddings``, ``layers``, ``norm``, ``rotary_emb``); its
  forward returns the final-norm states as ``last_hidden_state``.
* A 2-D ``attention_mask`` (a padding mask) is turned into a CAUSAL 4-D mask; a 4-D mask ([B, 1, Lq, Lk], additive)
  is used as given; no mask means full bidirectional attention.
* The rotary module looks its init function up in ``ROPE_INIT_FUNCTIONS[rope_type]``: under transformers 5, which
  dropped the "default" entry, that raises KeyError unless the caller registers one first. Its ``inv_freq`` is a
  non-persistent buffer (not in the checkpoint).
* Attention: GQA, per-head RMSNorm on q and k (LLaDA2's query_layernorm/key_layernorm), partial rotary on the first
  ``head_dim * partial_rotary_factor`` dims, ``F.scaled_dot_product_attention``, never causal by itself.
* Layers from ``first_k_dense_replace`` on are a small MoE: softmax gate, top-k experts renormalised, plus shared
  experts.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import PreTrainedModel

from .configuration_tiny_llada2 import TinyLLaDA2Config


class TinyLLaDA2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class TinyLLaDA2RotaryEmbedding(nn.Module):
    def __init__(self, config: TinyLLaDA2Config, device=None):
        super().__init__()
        scaling = getattr(config, "rope_scaling", None)
        self.rope_type = scaling.get("rope_type", "default") if isinstance(scaling, dict) else "default"
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings

        self.config = config
        self.rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]

        inv_freq, self.attention_scaling = self.rope_init_fn(self.config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.original_inv_freq = self.inv_freq

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()
        device_type = x.device.type if x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):  # float32
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Rotary on the first ``cos.shape[-1]`` dims of each head (partial rotary); the rest pass through."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


class TinyLLaDA2MLP(nn.Module):
    def __init__(self, config: TinyLLaDA2Config, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyLLaDA2Gate(nn.Module):
    def __init__(self, config: TinyLLaDA2Config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty((config.num_experts, config.hidden_size)))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.float(), self.weight.float())  # [N, E]
        scores = logits.softmax(dim=-1)
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1)
        topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        return topk_idx, topk_weight.to(hidden_states.dtype)


class TinyLLaDA2SparseMoeBlock(nn.Module):
    def __init__(self, config: TinyLLaDA2Config):
        super().__init__()
        self.experts = nn.ModuleList(
            [TinyLLaDA2MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts)])
        self.gate = TinyLLaDA2Gate(config)
        self.shared_experts = (TinyLLaDA2MLP(config, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        flat = hidden_states.reshape(-1, h)
        topk_idx, topk_weight = self.gate(flat)
        y = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            weight = (topk_weight * (topk_idx == e)).sum(dim=-1, keepdim=True)  # 0 where not routed
            rows = weight.squeeze(-1) != 0
            if rows.any():
                y[rows] += weight[rows] * expert(flat[rows])
        y = y.view(bsz, seq_len, h)
        if self.shared_experts is not None:
            y = y + self.shared_experts(hidden_states)
        return y


class TinyLLaDA2Attention(nn.Module):
    def __init__(self, config: TinyLLaDA2Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.query_layernorm = TinyLLaDA2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.key_layernorm = TinyLLaDA2RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim)
        q = self.query_layernorm(q).transpose(1, 2)
        k = self.key_layernorm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.num_heads // self.num_key_value_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False)
        out = out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.head_dim)
        return self.o_proj(out)


class TinyLLaDA2DecoderLayer(nn.Module):
    def __init__(self, config: TinyLLaDA2Config, layer_idx: int):
        super().__init__()
        self.attention = TinyLLaDA2Attention(config, layer_idx)
        self.input_layernorm = TinyLLaDA2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = TinyLLaDA2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = (TinyLLaDA2SparseMoeBlock(config) if config.num_experts and layer_idx >= config.first_k_dense_replace
                    else TinyLLaDA2MLP(config, config.intermediate_size))

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.attention(self.input_layernorm(hidden_states), attention_mask, position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class TinyLLaDA2PreTrainedModel(PreTrainedModel):
    config_class = TinyLLaDA2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["TinyLLaDA2DecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
        elif isinstance(module, TinyLLaDA2RMSNorm):
            module.weight.data.fill_(1.0)
        elif isinstance(module, TinyLLaDA2Gate):
            module.weight.data.normal_(mean=0.0, std=std)


def _causal_mask_from_padding(mask_2d, dtype, q_len):
    """What the released remote code does with a 2-D mask: a causal 4-D additive mask, padding keys masked too."""
    bsz, kv_len = mask_2d.shape
    minimum = torch.finfo(dtype).min
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask_2d.device).tril(diagonal=kv_len - q_len)
    allowed = causal[None, None, :, :] & mask_2d[:, None, None, :].bool()
    mask = torch.zeros(bsz, 1, q_len, kv_len, dtype=dtype, device=mask_2d.device)
    return mask.masked_fill(~allowed, minimum)


class TinyLLaDA2Model(TinyLLaDA2PreTrainedModel):
    def __init__(self, config: TinyLLaDA2Config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([TinyLLaDA2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = TinyLLaDA2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = TinyLLaDA2RotaryEmbedding(config=config)
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None, return_dict=True,
                **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        bsz, seq_len = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=inputs_embeds.device).unsqueeze(0)
        if attention_mask is not None:
            if attention_mask.dim() == 2:
                attention_mask = _causal_mask_from_padding(attention_mask, inputs_embeds.dtype, seq_len)
            elif attention_mask.dim() != 4:
                raise ValueError(f"attention_mask must be 2-D or 4-D, got shape {tuple(attention_mask.shape)}")
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, position_embeddings)
        hidden_states = self.norm(hidden_states)
        if not return_dict:
            return (hidden_states,)
        return BaseModelOutput(last_hidden_state=hidden_states)


class TinyLLaDA2ModelLM(TinyLLaDA2PreTrainedModel):
    def __init__(self, config: TinyLLaDA2Config):
        super().__init__(config)
        self.model = TinyLLaDA2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.word_embeddings

    def set_input_embeddings(self, value):
        self.model.word_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_decoder(self):
        return self.model

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None, return_dict=True,
                **kwargs):
        outputs = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                             position_ids=position_ids, return_dict=True, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state).float()
        if not return_dict:
            return (logits,)
        return CausalLMOutput(logits=logits)
