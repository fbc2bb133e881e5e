"""Tests for the offline demo-materials builder (gguf_assets.lib.demo.demo)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from gguf_assets.lib.demo.demo import (
    EOS_TOKEN,
    PROMPTS_FILENAME,
    QUERY_ROWS_FILENAME,
    QUERY_ROWS_TENSOR,
    TEACHER_LAYERS,
    DemoMaterials,
    build_demo_materials,
    iter_prompts,
)

# On one worker: the module fixture (three demo builds) is made once, not once per worker (conftest.py).
pytestmark = pytest.mark.xdist_group("demo_materials")

N_PROMPTS = 2000
QUERY_ROWS = 256
# Share of the outputs' mean square that must vary across prompts.
MIN_PROMPT_DEPENDENCE = 0.10


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _prompt_dependence(outputs: torch.Tensor) -> float:
    """Across-prompt variance of ``outputs`` (prompt axis first) over their mean square."""
    centered = outputs - outputs.mean(dim=0, keepdim=True)
    return (centered.square().mean() / outputs.square().mean()).item()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Seed 0 twice (into different roots) and seed 1 once; built once per module."""
    root_a = tmp_path_factory.mktemp("demo_a")
    root_b = tmp_path_factory.mktemp("demo_b")
    root_c = tmp_path_factory.mktemp("demo_c")
    a = build_demo_materials(root_a, seed=0, n_prompts=N_PROMPTS, query_rows=QUERY_ROWS)
    rng_before = torch.random.get_rng_state()
    py_rng_before = random.getstate()
    b = build_demo_materials(root_b, seed=0, n_prompts=N_PROMPTS, query_rows=QUERY_ROWS)
    rng_after = torch.random.get_rng_state()
    py_rng_after = random.getstate()
    c = build_demo_materials(root_c, seed=1, n_prompts=N_PROMPTS, query_rows=QUERY_ROWS)
    return {
        "a": a,
        "b": b,
        "c": c,
        "roots": (root_a, root_b, root_c),
        "torch_rng_kept": torch.equal(rng_before, rng_after),
        "py_rng_kept": py_rng_before == py_rng_after,
    }


def test_layout(built: dict[str, object]) -> None:
    a = built["a"]
    root_a = built["roots"][0]
    assert isinstance(a, DemoMaterials)
    assert a == DemoMaterials(root_a / "teacher", root_a / "student", root_a / "dataset", root_a / "sigvq")
    # Only the four folders remain: the staging dir is gone.
    assert sorted(p.name for p in root_a.iterdir()) == ["dataset", "sigvq", "student", "teacher"]
    for model_dir in (a.teacher_dir, a.student_dir):
        names = {p.name for p in model_dir.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
        assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)  # safetensors only
    assert QUERY_ROWS_FILENAME in {p.name for p in a.teacher_dir.iterdir()}
    assert (a.dataset_dir / "README.md").read_text(encoding="utf-8").strip()
    # The tiny SigVQ encoder: its checkpoint (f32, safetensors) and config, nothing else.
    assert sorted(p.name for p in a.sigvq_dir.iterdir()) == ["config.json", "model.safetensors"]
    sigvq = load_file(a.sigvq_dir / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in sigvq.values())
    config = json.loads((a.sigvq_dir / "config.json").read_text(encoding="utf-8"))
    assert config["hidden_size"] % 16 == 0 and config["semantic_dim"] == 64
    assert sigvq["prior_token_embedding.weight"].shape == (config["codebook_size"], config["semantic_dim"])
    assert sigvq["visual.patch_embed.proj.weight"].shape == (config["hidden_size"], 3, config["patch_size"],
                                                              config["patch_size"])


def test_same_seed_is_byte_identical(built: dict[str, object]) -> None:
    root_a, root_b, _ = built["roots"]
    files_a, files_b = _files(root_a), _files(root_b)
    assert files_a.keys() == files_b.keys()
    assert len(files_a) >= 10
    for name in files_a:
        assert files_a[name] == files_b[name], name


def test_build_leaves_global_rng_alone(built: dict[str, object]) -> None:
    assert built["torch_rng_kept"]
    assert built["py_rng_kept"]


def test_different_seed_differs(built: dict[str, object]) -> None:
    a, c = built["a"], built["c"]
    for model_dir in (a.teacher_dir, a.student_dir):
        other = c.teacher_dir if model_dir == a.teacher_dir else c.student_dir
        w_a = load_file(model_dir / "model.safetensors")
        w_c = load_file(other / "model.safetensors")
        assert w_a.keys() == w_c.keys()
        name = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(w_a[name], w_c[name])
    sigvq_a, sigvq_c = (load_file(m.sigvq_dir / "model.safetensors") for m in (a, c))
    assert sigvq_a.keys() == sigvq_c.keys()
    assert not torch.equal(sigvq_a["vqmodel.quantize.embedding.weight"], sigvq_c["vqmodel.quantize.embedding.weight"])
    q_a = load_file(a.teacher_dir / QUERY_ROWS_FILENAME)[QUERY_ROWS_TENSOR]
    q_c = load_file(c.teacher_dir / QUERY_ROWS_FILENAME)[QUERY_ROWS_TENSOR]
    assert not torch.equal(q_a, q_c)
    prompts_a = (a.dataset_dir / PROMPTS_FILENAME).read_bytes()
    assert prompts_a != (c.dataset_dir / PROMPTS_FILENAME).read_bytes()


def test_loads_with_auto_classes(built: dict[str, object]) -> None:
    a = built["a"]
    teacher, info = AutoModelForCausalLM.from_pretrained(a.teacher_dir, output_loading_info=True)
    assert type(teacher).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    student, info = AutoModelForCausalLM.from_pretrained(a.student_dir, output_loading_info=True)
    assert type(student).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]

    tc, sc = teacher.config, student.config
    assert (tc.hidden_size, tc.num_hidden_layers, tc.num_attention_heads) == (64, TEACHER_LAYERS, 4)
    assert (tc.num_key_value_heads, tc.num_experts, tc.num_experts_per_tok) == (2, 4, 2)
    assert (tc.moe_intermediate_size, tc.intermediate_size) == (64, 128)
    assert tc.max_position_embeddings == 2048
    # ggk fixes the student's head dim, RMSNorm eps and rope theta: the demo's student has ggk's.
    assert (sc.hidden_size, sc.num_hidden_layers, sc.num_attention_heads) == (48, 2, 2)
    assert (sc.num_key_value_heads, sc.head_dim, sc.intermediate_size) == (1, 128, 96)
    assert sc.rms_norm_eps == 1e-6
    rope = getattr(sc, "rope_parameters", None) or {"rope_theta": sc.rope_theta}
    assert rope["rope_theta"] == 1_000_000.0
    # So ggk runs it as transformers does, and numbers its tokens as its tokenizer.json does.
    from gguf_assets.lib.materials.ggk_tokenizer import ggk_tokenizer_problem
    from gguf_assets.lib.materials.student.contract import student_contract_problem

    assert student_contract_problem(a.student_dir) is None and ggk_tokenizer_problem(a.student_dir) is None

    for model_dir, model in ((a.teacher_dir, teacher), (a.student_dir, student)):
        tok = AutoTokenizer.from_pretrained(model_dir)
        assert len(tok) == model.config.vocab_size
        assert 900 <= len(tok) <= 1100
        assert tok.eos_token == tok.pad_token == EOS_TOKEN
        assert model.config.eos_token_id == tok.eos_token_id
        assert model.config.pad_token_id == tok.pad_token_id
        text = "A misty fox glowing softly under a starry sky, oil painting"
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
        assert len(ids) < len(text.split()) * 3  # BPE actually merged the corpus words
        # Weights on disk are what the loaded model holds.
        on_disk = load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"]
        assert torch.equal(model.get_input_embeddings().weight.detach(), on_disk)


def test_query_rows(built: dict[str, object]) -> None:
    a = built["a"]
    tensors = load_file(a.teacher_dir / QUERY_ROWS_FILENAME)
    assert list(tensors) == [QUERY_ROWS_TENSOR]
    rows = tensors[QUERY_ROWS_TENSOR]
    assert rows.dtype == torch.float32
    assert tuple(rows.shape) == (QUERY_ROWS, 64)
    embed = load_file(a.teacher_dir / "model.safetensors")["model.embed_tokens.weight"]
    ratio = rows.std().item() / embed.std().item()
    assert 0.5 < ratio < 2.0  # same scale as token embeddings


def test_outputs_depend_on_prompt(built: dict[str, object]) -> None:
    a = built["a"]
    tok = AutoTokenizer.from_pretrained(a.teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher_dir).eval()
    student = AutoModelForCausalLM.from_pretrained(a.student_dir).eval()
    query = load_file(a.teacher_dir / QUERY_ROWS_FILENAME)[QUERY_ROWS_TENSOR]
    prompts = list(dict.fromkeys(iter_prompts(a.dataset_dir)))[:50]
    assert len(prompts) == 50

    teacher_out, student_last, student_mean = [], [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tok(prompt).input_ids])
            embeds = torch.cat([teacher.get_input_embeddings()(ids), query[None]], dim=1)
            hidden = teacher.model(inputs_embeds=embeds).last_hidden_state
            teacher_out.append(hidden[0, -QUERY_ROWS:])
            s_hidden = student.model(input_ids=ids).last_hidden_state[0]
            student_last.append(s_hidden[-1])
            student_mean.append(s_hidden.mean(dim=0))

    t = torch.stack(teacher_out)
    assert torch.isfinite(t).all()
    assert _prompt_dependence(t) > MIN_PROMPT_DEPENDENCE
    # Even the last query row (furthest from the prompt) must still see it.
    assert _prompt_dependence(t[:, -1:]) > MIN_PROMPT_DEPENDENCE / 2
    assert _prompt_dependence(torch.stack(student_last)) > MIN_PROMPT_DEPENDENCE
    assert _prompt_dependence(torch.stack(student_mean)) > MIN_PROMPT_DEPENDENCE


def test_prompts(built: dict[str, object]) -> None:
    a = built["a"]
    lines = (a.dataset_dir / PROMPTS_FILENAME).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert all(list(row) == ["text"] and isinstance(row["text"], str) for row in rows)
    texts = [row["text"] for row in rows]
    assert len(texts) == N_PROMPTS
    assert texts == list(iter_prompts(a.dataset_dir))
    n_dupes = len(texts) - len(set(texts))
    assert 1 <= n_dupes <= 20  # a handful, on purpose
    word_counts = [len(t.split()) for t in texts]
    assert max(word_counts) <= 60
    assert sum(n > 30 for n in word_counts) >= N_PROMPTS // 20
    assert sum(n < 6 for n in word_counts) >= N_PROMPTS // 10
    assert all(t.strip() == t and t for t in texts)


def test_options_and_rebuild_in_place(tmp_path: Path) -> None:
    first = build_demo_materials(tmp_path, seed=3, n_prompts=200, query_rows=8)
    second = build_demo_materials(tmp_path, seed=3, n_prompts=300, query_rows=16)
    assert first == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset", "sigvq", "student", "teacher"]
    rows = load_file(second.teacher_dir / QUERY_ROWS_FILENAME)[QUERY_ROWS_TENSOR]
    assert tuple(rows.shape) == (16, 64)
    assert sum(1 for _ in iter_prompts(second.dataset_dir)) == 300
    with pytest.raises(ValueError):
        build_demo_materials(tmp_path, n_prompts=0)


def _lift_residual(teacher_dir: Path, student_dir: Path) -> float:
    """How much of the teacher's token table no linear map of the student's explains (0: a pure lift)."""
    teacher = load_file(teacher_dir / "model.safetensors")["model.embed_tokens.weight"].double()
    student = load_file(student_dir / "model.safetensors")["model.embed_tokens.weight"].double()
    fit = torch.linalg.lstsq(student, teacher).solution
    return float((teacher - student @ fit).square().sum() / teacher.square().sum())


def test_the_independent_pair_is_not_shaped_by_the_builder(tmp_path: Path) -> None:
    """bench_quality's family C: the teacher's token table is its own, the student is drawn separately, and
    the prompts come from their own grammar; still deterministic, and its teacher still reads the prompt."""
    lifted = build_demo_materials(tmp_path / "lifted", n_prompts=300, query_rows=8, student_hidden_size=96)
    first = build_demo_materials(tmp_path / "c1", n_prompts=300, query_rows=8, student_hidden_size=96,
                                 student_layers=6, independent=True)
    build_demo_materials(tmp_path / "c2", n_prompts=300, query_rows=8, student_hidden_size=96,
                         student_layers=6, independent=True)
    assert _files(tmp_path / "c1") == _files(tmp_path / "c2")
    assert _lift_residual(lifted.teacher_dir, lifted.student_dir) < 1e-6  # the demo's: a lift, exactly
    # Random 64-wide rows against a 96-wide basis over ~1000 tokens: most of the table is out of reach.
    assert _lift_residual(first.teacher_dir, first.student_dir) > 0.8
    texts = list(iter_prompts(first.dataset_dir))
    demo_words = {w.strip(",.") for t in iter_prompts(lifted.dataset_dir) for w in t.split()}
    scene_words = {w.strip(",.") for t in texts for w in t.split()}
    assert len(texts) == 300 and 1 <= len(texts) - len(set(texts)) <= 5
    assert len(scene_words & demo_words) < 0.3 * len(scene_words), scene_words & demo_words
    student = AutoModelForCausalLM.from_pretrained(first.student_dir)
    assert student.config.num_hidden_layers == 6 and student.config.hidden_size == 96
    from gguf_assets.lib.materials.ggk_tokenizer import ggk_tokenizer_problem
    from gguf_assets.lib.materials.student.contract import student_contract_problem

    assert student_contract_problem(first.student_dir) is None and ggk_tokenizer_problem(first.student_dir) is None
    teacher = AutoModelForCausalLM.from_pretrained(first.teacher_dir).eval()
    tok = AutoTokenizer.from_pretrained(first.teacher_dir)
    query = load_file(first.teacher_dir / QUERY_ROWS_FILENAME)[QUERY_ROWS_TENSOR]
    with torch.no_grad():
        outputs = torch.stack([teacher.model(inputs_embeds=torch.cat(
            [teacher.get_input_embeddings()(torch.tensor([tok(t).input_ids])), query[None]], dim=1)
        ).last_hidden_state[0, -8:] for t in list(dict.fromkeys(texts))[:40]])
    assert _prompt_dependence(outputs) > MIN_PROMPT_DEPENDENCE


def _next_token_loss(model_dir: Path, texts: list[str]) -> float:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        losses = [float(model(input_ids=ids, labels=ids).loss)
                  for ids in (torch.tensor([tok(t).input_ids + [tok.eos_token_id]]) for t in texts)]
    return sum(losses) / len(losses)


def test_pretrained_pair_models_learn_the_prompts_each_on_its_own(tmp_path: Path) -> None:
    """Family D: both models trained as language models; they then predict the prompts' next tokens far
    better than the same models left random, and the two are still different models."""
    options = dict(n_prompts=150, query_rows=4, student_hidden_size=48, student_layers=2, independent=True)
    random_pair = build_demo_materials(tmp_path / "random", **options)
    trained = build_demo_materials(tmp_path / "trained", **options, pretrain_steps=60)
    texts = list(dict.fromkeys(iter_prompts(trained.dataset_dir)))[:12]
    for role in ("teacher_dir", "student_dir"):
        before = _next_token_loss(getattr(random_pair, role), texts)
        after = _next_token_loss(getattr(trained, role), texts)
        assert after < 0.7 * before, (role, before, after)
    assert _lift_residual(trained.teacher_dir, trained.student_dir) > 0.5
