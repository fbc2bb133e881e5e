"""Each fact of the real LLaDA-Image text encoder (its published code and config, ../shared/real/) that the product
handles on purpose, one test each (docs/real_teacher.md lists them with what the product does):

- the AutoModel is LLaDA2MoeModelLM, whose ``.model`` is a plain nn.Module over ``model.language_model.*``;
- the routed experts are fused 3-D parameters, checked against the weights' headers before any load;
- every attention implementation maps to the SDPA class, which takes a 4-D mask as given and makes a 2-D one
  causal: the teacher passes its own 4-D mask;
- ``rope_scaling`` carries an ``mrope_section`` that the text-only path never reads: its positions are plain;
- ``ROPE_INIT_FUNCTIONS["default"]`` is looked up by name (KeyError without it), and ``inv_freq`` comes out of the
  load uninitialised: the teacher registers the function and recomputes the table;
- the tokenizer adds no BOS (``add_bos_token: false``): the template's first token is ``<role>``;
- ``fused_moe_forward`` refuses grad: the teacher encodes under inference mode.
"""

from __future__ import annotations

import json

import pytest
import torch
from llada_repo import isolated_remote_code
from real_llada import MODELING, TINY_ENCODER, build_real_llada_repo
from safetensors.torch import load_file, save_file

from gguf_assets.lib.materials.teacher import preflight as teacher_preflight
from gguf_assets.lib.materials.teacher.text_stack import written_for_transformers_4
from gguf_assets.lib.precompute import llada_teacher as lt
from gguf_assets.lib.project.settings import Settings

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build_real_llada_repo(tmp_path_factory.mktemp("real-llada") / "LLaDA-Image-Turbo", with_sigvq=False)


@pytest.fixture(scope="module", autouse=True)
def remote_code_cache(tmp_path_factory):
    with isolated_remote_code(tmp_path_factory.mktemp("hf-modules")):
        yield


@pytest.fixture(scope="module")
def teacher(repo):
    settings = Settings.model_validate({"materials": {"teacher": str(repo), "trust_remote_code": True}})
    return lt.LLaDAImageTeacher(repo, settings, CPU)


def test_the_backbone_is_the_plain_module_under_model_and_the_rotary_table_is_repaired(teacher):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert type(teacher.model).__name__ == "LLaDA2MoeModelLM"
    assert type(teacher.backbone).__name__ == "LLaDA2MoeBackbone" and teacher.backbone is teacher.model.model
    assert not hasattr(type(teacher.backbone), "config_class")  # a plain nn.Module, not a PreTrainedModel
    names = [name for name, _ in teacher.model.named_parameters()]
    assert names[0].startswith("model.language_model.") and "model.lm_head.weight" in names
    # The load leaves inv_freq uninitialised (transformers 5 builds remote code on the meta device): repaired.
    assert teacher.repaired == ["model.language_model.rotary_emb"]
    assert lt.table_is_plain(teacher.model.model.language_model.rotary_emb.inv_freq)
    assert "default" not in ROPE_INIT_FUNCTIONS  # registered only while the backbone is built


def test_without_the_default_rope_function_the_real_code_does_not_build(repo):
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(repo / "text_encoder", trust_remote_code=True)
    with pytest.raises(KeyError, match="default"):
        AutoModel.from_config(config, trust_remote_code=True)
    with written_for_transformers_4():
        AutoModel.from_config(config, trust_remote_code=True)


def test_mrope_section_is_never_read_on_the_text_path_its_positions_are_the_plain_ones(teacher, repo):
    config = json.loads((repo / "text_encoder" / "config.json").read_text())
    assert config["rope_scaling"]["mrope_section"] == [16, 24, 24]  # published, kept
    rotary = teacher.model.model.language_model.rotary_emb
    positions = torch.arange(11)[None]
    cos, sin = rotary(torch.zeros(1, 11, 1), positions)
    # The plain reference: theta 600000 on half of each head (partial_rotary_factor 0.5), positions 0..n-1.
    dim = int(TINY_ENCODER["head_dim"] * config["partial_rotary_factor"])
    inv = 1.0 / config["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions[0, :, None].float() * inv[None]
    assert torch.allclose(cos[0], torch.cat([angles, angles], -1).cos(), atol=1e-6)
    assert torch.allclose(sin[0], torch.cat([angles, angles], -1).sin(), atol=1e-6)


def test_a_2d_mask_is_made_causal_so_the_teacher_passes_its_own_4d_mask(teacher):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, TINY_ENCODER["hidden_size"], generator=gen)
    changed = x.clone()
    changed[:, 4:] += 1.0  # the last two tokens only
    positions = torch.arange(6)[None]
    attention = type(teacher.model.model.language_model.layers[0].attention).__name__
    assert attention == "LLaDA2MoeSdpaAttention"  # whatever attn_implementation says

    def run(inputs, mask):
        with torch.inference_mode():
            return teacher.backbone(inputs_embeds=inputs, attention_mask=mask, position_ids=positions,
                                    use_cache=False).last_hidden_state

    # A 2-D mask with padding is made causal: the first tokens do not see the changed later ones. (transformers 5
    # drops an all-ones 2-D mask, and the code then runs unmasked: the mask's kind would hang on the padding.)
    two_d = torch.tensor([[1, 1, 1, 1, 1, 0]])
    keep = two_d.bool()
    four_d = lt.backbone_mask(keep, 6, torch.float32)
    assert torch.allclose(run(x, two_d)[:, :4], run(changed, two_d)[:, :4], atol=1e-6)
    # Under the teacher's 4-D mask the same tokens see them: bidirectional, padding hidden.
    assert not torch.allclose(run(x, four_d)[:, :4], run(changed, four_d)[:, :4])
    assert torch.allclose(run(x, four_d)[:, :5], run(x, torch.zeros(1, 1, 6, 6).masked_fill(
        ~keep[:, None, None, :], torch.finfo(torch.float32).min))[:, :5])


def test_the_tokenizer_adds_no_bos_and_keeps_the_template_tokens_whole(teacher, repo):
    config = json.loads((repo / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizer" and config["add_bos_token"] is False
    rows, _ = teacher.tokenize(["a cat"])
    tokens = teacher.tokenizer.convert_ids_to_tokens(rows[0])
    assert tokens[0] == "<role>" and tokens[-1] == "<IMAGE1>" and teacher.tokenizer.bos_token is None


def test_the_fused_experts_refuse_grad_so_the_teacher_encodes_in_inference_mode(teacher):
    rows, _ = teacher.tokenize(["a cat", ""])
    with pytest.raises(RuntimeError, match="inference"):
        with torch.enable_grad():
            for p in teacher.model.parameters():
                p.requires_grad_(True)
            try:
                teacher.forward_batch(rows)
            finally:
                teacher.model.requires_grad_(False)
    targets = teacher.encode(["a cat", ""]).targets
    assert targets.shape[0] == 2 and torch.isfinite(targets).all()


def test_a_fused_expert_tensor_of_the_wrong_shape_is_refused_before_the_weights_naming_it(repo, tmp_path):
    import shutil

    broken = tmp_path / "pipeline"
    shutil.copytree(repo, broken)
    index = json.loads((broken / "text_encoder" / "model.safetensors.index.json").read_text())
    name = next(n for n in index["weight_map"] if n.endswith("mlp.experts.gate_proj"))
    shard = broken / "text_encoder" / index["weight_map"][name]
    tensors = load_file(str(shard))
    assert tensors[name].dim() == 3  # [experts, intermediate, hidden], no .weight
    tensors[name] = tensors[name][:, :, :-1].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    settings = Settings.model_validate({"materials": {"teacher": str(broken), "trust_remote_code": True}})
    problem = teacher_preflight.pipeline_problem(broken, settings)
    assert problem and name in problem and "misshapen" in problem and MODELING not in problem
    assert teacher_preflight.pipeline_problem(repo, settings) is None


def test_the_published_config_passes_and_each_key_the_forward_reads_is_named_when_wrong():
    from real_llada import REAL_CONFIGS, real_files_or_skip

    real_files_or_skip()
    published = json.loads((REAL_CONFIGS / "text_encoder_config.json").read_text())
    assert teacher_preflight.config_problems(published) == []
    assert (published["max_position_embeddings"], published["vocab_size"], published["image_token_offset"]) == \
        (16384, 173568, 157184)
    cases = {"rope_theta": (None, "rope_theta is None"),
             "num_key_value_heads": (3, "not a multiple of num_key_value_heads 3"),
             "rope_scaling": ({"rope_type": "yarn", "factor": 4.0}, "rope_type is 'yarn'"),
             "n_group": (7, "does not split into n_group 7 groups"),
             "num_experts_per_tok": (200, "cannot be chosen from topk_group 4"),
             "pad_token_id": (173568, "not a row of the 173568-row embedding table"),
             "partial_rotary_factor": (1.5, "partial_rotary_factor is 1.5")}
    for key, (value, said) in cases.items():
        config = {k: v for k, v in published.items() if k != key or value is not None}
        if value is not None:
            config[key] = value
        problems = "; ".join(teacher_preflight.config_problems(config))
        assert said in problems, (key, problems)
