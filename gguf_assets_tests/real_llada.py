"""A tiny LLaDA-Image pipeline repo built from the REAL published files (``../shared/real/``, see its README).

``build_real_llada_repo(root)`` writes what ``inclusionAI/LLaDA-Image-Turbo`` ships for its text stack, with only
the sizes shrunk:

    model_index.json        the published index, byte for byte
    text_encoder/           the three published code files byte for byte (modeling_llada2uni_moe.py imports
                            fused_moe_ops.py relatively); the published config.json with every key kept and the sizes
                            made tiny; bf16 weights named and shaped by the real code (fused 3-D experts), in shards
                            with model.safetensors.index.json
    queryformer/            the published config's keys, tiny sizes; diffusion_pytorch_model.safetensors
    text_projection/        the same
    tokenizer/              a tiny byte-level BPE with the published tokenizer_config.json's keys
                            (tokenizer_class PreTrainedTokenizer, add_bos_token false, pad = <|endoftext|>) and a
                            ByteLevel post-processor
    sigvq/, transformer/, vae/, scheduler/   as llada_repo.py writes them (the last three are never fetched)

The third-party files are read from ``../shared/real/`` and written only into the test's temporary folder: they are
never copied into the project. Without ``../shared/`` the tests that need them skip, saying why.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import llada_repo as standin
import pytest
import torch

REAL = Path(__file__).resolve().parents[2] / "shared" / "real"
REAL_CODE = REAL / "llada-image-text-encoder"
REAL_CONFIGS = REAL / "llada-image-configs"
CODE_FILES = ("configuration_llada2uni_moe.py", "fused_moe_ops.py", "modeling_llada2uni_moe.py")
MODELING, HELPER = "modeling_llada2uni_moe.py", "fused_moe_ops.py"
TOKENIZER_SPECIALS = ("<|startoftext|>", "[CLS]", "[gMASK]", "<|mask|>", "<|role_end|>", "<role>", "</role>",
                      "<IMAGE1>")

# The sizes made tiny; every other key of the published config keeps its value (rope_theta 600000,
# partial_rotary_factor 0.5, mrope_section, image_token_offset, max_position_embeddings 16384, ...).
TINY_ENCODER = {"hidden_size": standin.TINY_LLADA.hidden_size, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 16,
                "num_experts_per_tok": 4, "moe_intermediate_size": 8, "n_group": 8, "topk_group": 4}
# The parts' weights are llada_repo.py's, so their sizes are its.
_S = standin.TINY_LLADA
TINY_QUERYFORMER = {"hidden_size": _S.hidden_size, "intermediate_size": _S.queryformer_intermediate_size,
                    "num_attention_heads": _S.num_attention_heads, "num_hidden_layers": _S.queryformer_layers,
                    "num_queries": _S.num_queries}
TINY_PROJECTION = {"hidden_size": _S.hidden_size, "intermediate_size": _S.text_projection_intermediate_size,
                   "num_attention_heads": _S.num_attention_heads, "num_hidden_layers": _S.text_projection_layers,
                   "projection_dim": _S.projection_dim}
PARTS_WEIGHTS = "diffusion_pytorch_model.safetensors"


def real_files_or_skip() -> Path:
    """``../shared/real/``, or a skip that says why the test cannot run."""
    missing = [p for p in [*(REAL_CODE / f for f in CODE_FILES), REAL_CONFIGS / "text_encoder_config.json"]
               if not p.is_file()]
    if missing:
        pytest.skip(f"the published LLaDA-Image files are not here ({missing[0]} is missing): this test runs only "
                    "where ../shared/real/ lies beside the checkout, as it does for the developers and CI")
    return REAL


def _published(name: str) -> dict:
    return json.loads((REAL_CONFIGS / name).read_text(encoding="utf-8"))


def _shrunk(published: dict, sizes: dict) -> dict:
    unknown = set(sizes) - set(published)
    assert not unknown, f"not keys of the published config: {unknown}"
    return {**published, **sizes}


def _tokenizer(folder: Path, seed: int):
    from tokenizers import processors

    tok = standin._build_tokenizer(folder, seed)
    tok.add_special_tokens({"additional_special_tokens": list(TOKENIZER_SPECIALS)})
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    # The published tokenizer_config.json's own keys and values (its 16k added tokens and chat template aside).
    config.update({"add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                   "cls_token": "[CLS]", "eos_token": standin.EOS_TOKEN, "extra_special_tokens": {},
                   "fast_tokenizer": True, "gmask_token": "[gMASK]", "mask_token": "<|mask|>", "merges_file": None,
                   "model_max_length": 32768, "pad_token": standin.EOS_TOKEN, "padding_side": "right",
                   "tokenizer_class": "PreTrainedTokenizer", "trust_remote_code": True})
    standin._write_json(config_file, config)
    return tok


def _encoder_config(tok) -> dict:
    pad = tok.convert_tokens_to_ids(standin.EOS_TOKEN)
    return _shrunk(_published("text_encoder_config.json"), {**TINY_ENCODER, "vocab_size": len(tok),
                                                             "pad_token_id": pad})


def real_state_shapes(encoder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: shape} of the persistent state the REAL code builds from ``encoder``'s config, on the meta device."""
    from transformers import AutoConfig, AutoModel

    from gguf_assets.lib.materials.teacher.text_stack import written_for_transformers_4

    with written_for_transformers_4():
        config = AutoConfig.from_pretrained(encoder, trust_remote_code=True)
        with torch.device("meta"):
            model = AutoModel.from_config(config, trust_remote_code=True)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _encoder_weights(shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    w = standin._Tensors(seed, "real_text_encoder")
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            w.normal(name, shape, 0.05, offset=1.0)
        elif name.endswith("expert_bias"):
            w.normal(name, shape, 0.01)
        else:  # linears, fused experts [E, out, in], embeddings, gate
            w.normal(name, shape, 0.7 / shape[-1] ** 0.5 if len(shape) > 1 else 0.02)
    return {k: v.to(torch.bfloat16) for k, v in w.t.items()}


def write_text_encoder(folder: Path, tok, seed: int, *, shards: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in CODE_FILES:
        shutil.copyfile(REAL_CODE / name, folder / name)
    standin._write_json(folder / "config.json", _encoder_config(tok))
    with standin.isolated_remote_code(folder.parent.with_name(folder.parent.name + ".hf-modules")):
        shapes = real_state_shapes(folder)
    standin._save_sharded(_encoder_weights(shapes, seed), folder, shards)


def _write_part(folder: Path, published: str, sizes: dict, build, seed: int) -> None:
    """A QueryFormer or text projection: the published config's keys with ``sizes``, weights as llada_repo.py
    writes them for those sizes."""
    config = _shrunk(_published(published), sizes)
    scratch = folder.with_name(folder.name + ".build")
    build(scratch, seed)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.move(scratch / PARTS_WEIGHTS, folder / PARTS_WEIGHTS)
    shutil.rmtree(scratch)
    standin._write_json(folder / "config.json", config)


def build_real_llada_repo(root: Path, *, seed: int = 0, shards: int = 2, with_sigvq: bool = True) -> Path:
    """Write the tiny real-file pipeline into ``root`` and return it (same seed: same bytes)."""
    from gguf_assets.lib.demo.demo import build_demo_sigvq

    real_files_or_skip()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REAL_CONFIGS / "model_index.json", root / "model_index.json")
    tok = _tokenizer(root / "tokenizer", seed)
    write_text_encoder(root / "text_encoder", tok, seed, shards=shards)
    _write_part(root / "queryformer", "queryformer_config.json", TINY_QUERYFORMER, standin._build_queryformer, seed)
    _write_part(root / "text_projection", "text_projection_config.json", TINY_PROJECTION,
                standin._build_text_projection, seed)
    if with_sigvq:
        build_demo_sigvq(root / "sigvq", seed)
    standin._build_transformer(root / "transformer", seed)
    standin._build_vae(root / "vae", seed)
    standin._write_json(root / "scheduler" / "scheduler_config.json", {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0})
    return root


def pipeline_settings(teacher: str, **materials):
    """The settings of a small project whose teacher is ``teacher`` (an LLaDA-Image pipeline), with the demo's
    student and prompts (``pipeline_project`` copies them in), sized for a test."""
    from gguf_assets.lib.demo.demo import demo_settings
    from gguf_assets.lib.project.settings import replace

    return replace(demo_settings(steps=20),
                   materials={"teacher": teacher, "student": "materials/demo/student",
                              "datasets": ["materials/demo/dataset"], "vision_encoder": "", **materials},
                   precompute={"prompt_template": "{prompt}", "shard_size": 200, "val_shard_size": 100},
                   corpus={"train_prompts": 400, "val_prompts": 100},
                   training={"validate_every": 10, "checkpoint_every": 10, "log_every": 10})


def pipeline_project(root: Path, demo_materials_root: Path, settings):
    """A project folder at ``root``: the demo's student and prompts, and ``settings`` as its project.yaml."""
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.lib.project.settings import write_project_file

    shutil.copytree(demo_materials_root / "student", root / "materials" / "demo" / "student")
    shutil.copytree(demo_materials_root / "dataset", root / "materials" / "demo" / "dataset")
    write_project_file(root, settings)
    return ProjectPaths.of(root)
