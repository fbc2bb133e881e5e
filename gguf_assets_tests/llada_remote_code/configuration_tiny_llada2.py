"""Configuration of the tiny LLaDA2-like backbone (test fixture: gguf_assets_tests/llada_repo.py copies this file into
the replica's ``text_encoder/``, where transformers loads it as remote code).

Written the way the released LLaDA2-MoE ``configuration_llada2_moe.py`` is: a ``PretrainedConfig`` with its own
``__init__`` that sets ``rope_scaling`` itself before calling the base class.
"""

from transformers.configuration_utils import PretrainedConfig


class TinyLLaDA2Config(PretrainedConfig):
    model_type = "tiny_llada2"

    def __init__(
        self,
        vocab_size=1004,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=None,
        hidden_act="silu",
        use_qk_norm=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.02,
        max_position_embeddings=512,
        rope_theta=600000.0,
        rope_scaling=None,
        partial_rotary_factor=0.5,
        pad_token_id=None,
        num_experts=4,
        num_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        use_cache=False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.use_qk_norm = use_qk_norm
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.partial_rotary_factor = partial_rotary_factor
        self.num_experts = num_experts
        self.num_shared_experts = num_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.use_cache = use_cache
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)
