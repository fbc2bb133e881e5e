"""The teacher and the student on the real demo models: query rows, batching, truncation, a
teacher read at a middle layer, placement plans (for GPUs this machine lacks, through
accelerate's real planner) and the out-of-memory retry."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gguf_assets.lib.demo.demo import TEACHER_LAYERS, demo_settings
from gguf_assets.lib.precompute import teacher as teacher_module
from gguf_assets.lib.precompute.student import Student
from gguf_assets.lib.precompute.teacher import (
    GIB,
    HFTeacher,
    Placement,
    PrecomputeOutOfMemory,
    TeacherError,
    device_map_summary,
    empty_model,
    lower_budget_on_oom,
    memory_budgets,
    oom_advice,
    plan_placement,
)
from gguf_assets.lib.project.settings import replace

CPU = torch.device("cpu")
# Lengths from 0 (the empty CFG prompt) to several dozen tokens, so batches really pad.
PROMPTS = ["", "a cat", "a red fox running through a snowy forest at dawn, oil painting, dramatic light",
           "portrait", "an old lighthouse on a cliff, storm clouds, cinematic, highly detailed, wide angle lens",
           "two dogs", "a bowl of fruit, still life", "city at night, neon, rain, reflections on the street"]


@pytest.fixture(scope="module")
def settings():
    # Small batches and budget force several batches of mixed composition; the literal prompt (the demo's teacher
    # reads LLaDA-Image's rendering: test_the_llada_image_template_renders_as_ggk_does).
    return replace(demo_settings(), precompute={"teacher_batch": 3, "token_budget": 3 * 300, "student_batch": 3,
                                                "prompt_template": "{prompt}"})


@pytest.fixture(scope="module")
def teacher(demo_materials_root, settings):
    return HFTeacher(demo_materials_root / "teacher", settings, CPU)


def _teacher_copy(demo_materials_root: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "teacher"
    shutil.copytree(demo_materials_root / "teacher", folder)
    return folder


def test_batched_targets_equal_alone_and_keep_prompt_order(teacher):
    batched = teacher.encode(PROMPTS)
    assert batched.targets.shape == (len(PROMPTS), 256, 64)
    alone = torch.cat([teacher.encode([p]).targets for p in PROMPTS])
    assert torch.allclose(batched.targets, alone, atol=1e-4, rtol=1e-4)
    # Prompts give distinct targets, so a row in the wrong place would not pass the check above.
    gaps = torch.cdist(alone.flatten(1), alone.flatten(1)) + torch.eye(len(PROMPTS)) * 1e9
    assert float(gaps.min()) > 1e-2
    assert batched.text_tokens == sum(len(t) for t in teacher.tokenize(PROMPTS)[0])
    assert batched.truncated == 0 and 0 < batched.peak_abs < 1e3


def test_target_dtype_and_live_batch_callbacks(teacher, settings):
    seen = []
    out = teacher.encode(PROMPTS, dtype=torch.float16, on_batch=lambda n, tokens: seen.append((n, tokens)))
    assert out.targets.dtype == torch.float16
    assert sum(n for n, _ in seen) == len(PROMPTS) and sum(t for _, t in seen) == out.text_tokens
    assert len(seen) >= 3 and all(n <= settings.precompute.teacher_batch for n, _ in seen)


def test_prompt_template_is_applied(demo_materials_root, teacher, settings):
    templated = HFTeacher(demo_materials_root / "teacher",
                          replace(settings, precompute={"prompt_template": "a photo of {prompt}, 4k"}), CPU)
    got = templated.encode(["a cat"]).targets
    assert torch.allclose(got, teacher.encode(["a photo of a cat, 4k"]).targets, atol=1e-5)
    assert not torch.allclose(got, teacher.encode(["a cat"]).targets, atol=1e-3)


def test_the_llada_image_template_renders_as_ggk_does(demo_materials_root, teacher, settings):
    """precompute.prompt_template: llada-image gives the teacher the text ggk renders (no emphasis parsing)."""
    from gguf_assets.lib.core.ggk_contract import rendered_prompt

    llada = HFTeacher(demo_materials_root / "teacher", replace(settings, precompute={"prompt_template": "llada-image"}),
                      CPU)
    for prompt in ("a (red) cat", ""):
        got = llada.encode([prompt]).targets
        assert torch.allclose(got, teacher.encode([rendered_prompt(prompt)]).targets, atol=1e-5)
    assert rendered_prompt("a (red) cat").count("(red)") == 1  # the literal text


def test_query_rows_of_the_wrong_width_are_refused(demo_materials_root, tmp_path, settings):
    folder = _teacher_copy(demo_materials_root, tmp_path)
    save_file({"query_rows": torch.zeros(256, 63)}, str(folder / "query_rows.safetensors"))
    with pytest.raises(TeacherError, match=r"shape \(256, 63\).*hidden size is 64.*materials.query_rows_file"):
        HFTeacher(folder, settings, CPU)
    with pytest.raises(TeacherError, match="materials.query_rows_tensor = 'rows'"):
        HFTeacher(folder, replace(settings, materials={"query_rows_tensor": "rows"}), CPU)


def test_over_long_prompts_are_truncated_and_counted(demo_materials_root, tmp_path, settings, caplog):
    folder = _teacher_copy(demo_materials_root, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 256 + 6  # room for 6 prompt tokens after the 256 query rows
    (folder / "config.json").write_text(json.dumps(config))
    short = HFTeacher(folder, settings, CPU)
    assert short.max_prompt_tokens == 6
    lengths = [len(t) for t in short.tokenizer(PROMPTS)["input_ids"]]
    with caplog.at_level(logging.WARNING, logger="gguf_assets.lib.precompute.teacher"):
        out = short.encode(PROMPTS)
    assert out.truncated == sum(n > 6 for n in lengths) > 0
    assert out.text_tokens == sum(min(n, 6) for n in lengths)
    assert "truncated" in caplog.text
    assert torch.isfinite(out.targets).all()

    config["max_position_embeddings"] = 256
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(TeacherError, match="no room is left for the prompt"):
        HFTeacher(folder, settings, CPU)


def test_student_states_are_flat_without_padding_and_batch_independent(demo_materials_root, settings):
    student = Student(demo_materials_root / "student", replace(settings, precompute={"student_dtype": "f32"}), CPU)
    seen = []
    states = student.encode(PROMPTS, on_batch=lambda n, tokens: seen.append((n, tokens)))
    tokens, _ = student.tokenize(PROMPTS)
    assert states.offsets.tolist() == [sum(len(t) for t in tokens[:i]) for i in range(len(PROMPTS) + 1)]
    assert states.hidden.shape == (states.tokens, student.dim) and states.hidden.dtype == torch.float32
    assert states.token_ids.tolist() == [t for row in tokens for t in row]
    assert sum(n for n, _ in seen) == len(PROMPTS) and sum(t for _, t in seen) == states.tokens
    for i, prompt in enumerate(PROMPTS):
        alone = student.encode([prompt])
        assert torch.allclose(states.of(i), alone.of(0), atol=1e-4), prompt


# -- middle layers ----------------------------------------------------------------------------

def _all_states(folder: Path, embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the teacher read before #58: the whole model's forward, every layer's output kept."""
    from transformers import AutoModel

    full = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return full(inputs_embeds=embeds, attention_mask=mask, use_cache=False, output_hidden_states=True).hidden_states


def _inputs(teacher: HFTeacher) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        return teacher.assemble(teacher.tokenize(PROMPTS[:5])[0])[:2]


def _read(folder: Path, settings, layer: int, embeds: torch.Tensor, mask: torch.Tensor) -> tuple[HFTeacher,
                                                                                                   torch.Tensor]:
    reader = HFTeacher(folder, replace(settings, materials={"teacher_layer": layer}), CPU)
    with torch.inference_mode():
        return reader, reader.forward_batch(embeds, mask)


def test_a_middle_layer_runs_only_the_blocks_below_it_and_reads_what_the_whole_model_did(demo_materials_root,
                                                                                         teacher, settings):
    """hidden_states[layer] of the whole model (0: the embeddings, k: block k - 1's output before the final norm,
    the last: after it), bit for bit, from a teacher built with only the blocks that layer needs."""
    folder = demo_materials_root / "teacher"
    embeds, mask = _inputs(teacher)
    states = _all_states(folder, embeds, mask)
    n = TEACHER_LAYERS
    assert len(states) == n + 1 and not torch.equal(states[n - 1], states[n])  # each layer differs, the norm too
    params = {}
    for layer in (1, 2, -2, -3, 0, -(n + 1), n, -1):
        reader, got = _read(folder, settings, layer, embeds, mask)
        built = layer % (n + 1)  # blocks below the layer; the last state needs them all
        assert len(reader.model.layers) == built and reader.placement.summary["cpu"]["layers"] == built, layer
        assert torch.equal(got, states[layer]), layer
        params[built] = sum(p.numel() for p in reader.model.parameters())
    assert params[0] < params[1] < params[2] < params[n]  # the blocks above are not loaded


def test_a_middle_layer_teacher_batches_as_the_whole_one_does(demo_materials_root, settings):
    """Across several batches the hooked block's output is the batch's own (prompt order, no stale batch)."""
    middle = HFTeacher(demo_materials_root / "teacher", replace(settings, materials={"teacher_layer": 2}), CPU)
    batched = middle.encode(PROMPTS).targets
    alone = torch.cat([middle.encode([p]).targets for p in PROMPTS])
    assert torch.allclose(batched, alone, atol=1e-4, rtol=1e-4)
    assert float(torch.cdist(alone.flatten(1), alone.flatten(1)).fill_diagonal_(1e9).min()) > 1e-2


@pytest.mark.parametrize("layer", [TEACHER_LAYERS + 1, -(TEACHER_LAYERS + 2)])
def test_a_layer_the_teacher_lacks_is_refused_before_it_loads(demo_materials_root, settings, layer):
    with pytest.raises(TeacherError, match=rf"materials.teacher_layer = {layer}, but the teacher has "
                                           rf"{TEACHER_LAYERS} layers"):
        HFTeacher(demo_materials_root / "teacher", replace(settings, materials={"teacher_layer": layer}), CPU)


def test_a_dense_qwen3_teacher_with_sliding_layers_reads_its_middle_layers_alike(demo_materials_root, tmp_path,
                                                                                 teacher, settings):
    """Qwen3 (dense) keeps a per-block attention kind (layer_types: here full, full, sliding, sliding), cut with
    the blocks."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = _teacher_copy(demo_materials_root, tmp_path)
    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=teacher.model.config.vocab_size, hidden_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                         max_position_embeddings=2048, use_sliding_window=True, sliding_window=16,
                         max_window_layers=2, initializer_range=0.03)
    assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    (folder / "model.safetensors").unlink()
    Qwen3ForCausalLM(config).save_pretrained(folder)
    embeds, mask = _inputs(teacher)  # the demo teacher's vocabulary and width: the same token rows
    states = _all_states(folder, embeds, mask)
    for layer in (1, 3, -2):
        reader, got = _read(folder, settings, layer, embeds, mask)
        kept = layer % 5
        assert len(reader.model.layers) == kept and reader.model.config.layer_types == config.layer_types[:kept]
        assert torch.equal(got, states[layer]), layer


def test_a_middle_layer_is_read_under_accelerate_offloading(demo_materials_root, tmp_path, teacher, settings,
                                                            monkeypatch):
    """accelerate's hooks (here: blocks offloaded to disk, their weights on the meta device between calls) wrap the
    kept blocks; the read layer's output comes through them unchanged."""
    import transformers

    folder = demo_materials_root / "teacher"
    embeds, mask = _inputs(teacher)
    expected = _all_states(folder, embeds, mask)[2]
    device_map = {"embed_tokens": "cpu", "layers.0": "disk", "layers.1": "disk", "norm": "cpu", "rotary_emb": "cpu"}
    planned = []

    def plan(*args, blocks=None, **kwargs):
        planned.append(blocks)
        return Placement("sequential", device_map)

    load = transformers.AutoModel.from_pretrained
    monkeypatch.setattr(teacher_module, "plan_placement", plan)
    # The MoE experts are stored fused, so offloading them to disk re-saves them (an offload folder).
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained",
                        lambda *args, **kwargs: load(*args, offload_folder=str(tmp_path / "offload"), **kwargs))
    reader, got = _read(folder, settings, 2, embeds, mask)
    assert planned == [2] and reader.model.hf_device_map == device_map and len(reader.model.layers) == 2
    assert reader.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # offloaded: the hook loads it
    assert torch.equal(got, expected)


# -- placement --------------------------------------------------------------------------------

def test_memory_budgets_fill_the_chosen_gpu_first_then_others_then_ram(settings):
    s = replace(settings, precompute={"device": "cuda:1", "teacher_gpu_memory_gib": 20.0,
                                      "teacher_cpu_memory_gib": 64.0})
    budgets = memory_budgets(s, torch.device("cuda:1"), free_gpu_bytes={0: 10 * GIB, 1: 30 * GIB, 2: 8 * GIB},
                             available_cpu_bytes=100 * GIB)
    assert list(budgets) == [1, 0, 2, "cpu"]
    assert budgets[1] == 20 * GIB and budgets["cpu"] == 64 * GIB
    assert budgets[0] == int(10 * GIB * 0.9) and budgets[2] == int(8 * GIB * 0.9)
    auto = memory_budgets(replace(settings, precompute={"device": "cuda:0"}), torch.device("cuda:0"),
                          free_gpu_bytes={0: 10 * GIB}, available_cpu_bytes=100 * GIB)
    assert auto == {0: int(9 * GIB), "cpu": int(90 * GIB)}
    lowered = memory_budgets(s, torch.device("cuda:1"), free_gpu_bytes={0: GIB, 1: 30 * GIB},
                             available_cpu_bytes=GIB, gpu_budget_gib=18.0)
    assert lowered[1] == 18 * GIB
    with pytest.raises(TeacherError, match="no GPU 3"):
        memory_budgets(s, torch.device("cuda:3"), free_gpu_bytes={0: GIB}, available_cpu_bytes=GIB)


def _layer_bytes(demo_materials_root, settings) -> int:
    model = empty_model(demo_materials_root / "teacher", settings, torch.bfloat16)
    return sum(t.numel() * t.element_size() for t in model.layers[0].parameters())


def test_sequential_plan_spills_from_the_chosen_gpu_to_the_next_then_cpu(demo_materials_root, settings):
    layer = _layer_bytes(demo_materials_root, settings)
    # The teacher is the embeddings (128,000 bytes in bf16), TEACHER_LAYERS (3) layers and a final
    # norm. The chosen GPU's budget fits the embeddings and two layers, but accelerate also keeps a
    # layer's worth free there (for offloaded layers): it holds the embeddings and layer 0. GPU 0
    # holds exactly one layer; the rest goes to CPU RAM.
    chosen_gib = (128_000 + 2 * layer + 100) / GIB
    s = replace(settings, precompute={"device": "cuda:1", "teacher_gpu_memory_gib": chosen_gib})
    plan = plan_placement(demo_materials_root / "teacher", s, torch.device("cuda:1"), dtype=torch.bfloat16,
                          free_gpu_bytes={0: int(layer * 1.0005 / 0.9), 1: 80 * GIB}, available_cpu_bytes=GIB)
    assert plan.strategy == "sequential"
    assert plan.device_map["embed_tokens"] == 1 and plan.device_map["layers.0"] == 1
    assert plan.device_map["layers.1"] == 0 and plan.device_map["norm"] == "cpu"
    assert list(plan.summary) == ["cuda:1", "cuda:0", "cpu"]
    assert plan.summary["cuda:1"]["layers"] == 1 and plan.summary["cuda:0"]["layers"] == 1
    assert plan.max_memory[1] == int(chosen_gib * GIB)
    meta = plan.metadata()
    assert (meta["teacher_cuda1_layers"] == 1 and meta["teacher_cuda0_layers"] == 1
            and meta["teacher_placement"] == "sequential")


def test_sequential_plan_keeps_a_fitting_teacher_on_the_chosen_gpu(demo_materials_root, settings):
    s = replace(settings, precompute={"device": "cuda:1"})
    plan = plan_placement(demo_materials_root / "teacher", s, torch.device("cuda:1"), dtype=torch.bfloat16,
                          free_gpu_bytes={0: 80 * GIB, 1: 80 * GIB}, available_cpu_bytes=GIB)
    assert plan.device_map == {"": 1}
    assert plan.summary["cuda:1"]["layers"] == TEACHER_LAYERS and plan.summary["cuda:1"]["gib"] > 0
    assert plan.gpu_budget_gib == pytest.approx(72.0)


def test_a_middle_layer_teacher_plans_only_the_blocks_it_keeps(demo_materials_root, settings):
    layer = _layer_bytes(demo_materials_root, settings)
    s = replace(settings, precompute={"device": "cuda:0", "teacher_gpu_memory_gib": (128_000 + 2 * layer + 100) / GIB})
    plans = {blocks: plan_placement(demo_materials_root / "teacher", s, torch.device("cuda:0"), dtype=torch.bfloat16,
                                    free_gpu_bytes={0: 80 * GIB}, available_cpu_bytes=GIB, blocks=blocks)
             for blocks in (None, 1)}
    # All three blocks spill one to the CPU; the one block kept fits beside the embeddings.
    assert plans[None].summary["cuda:0"]["layers"] == 1 and plans[None].summary["cpu"]["layers"] == 2
    assert plans[1].device_map == {"": 0} and plans[1].summary["cuda:0"]["layers"] == 1


def test_a_teacher_that_fits_nowhere_names_the_budgets_to_raise(demo_materials_root, settings):
    s = replace(settings, precompute={"device": "cuda:0", "teacher_cpu_memory_gib": 1e-6})
    with pytest.raises(TeacherError, match="teacher_cpu_memory_gib.*teacher_gpu_memory_gib"):
        plan_placement(demo_materials_root / "teacher", s, torch.device("cuda:0"), dtype=torch.bfloat16,
                       free_gpu_bytes={0: 1000}, available_cpu_bytes=GIB)


def test_balanced_is_transformers_even_split_under_explicit_budgets(demo_materials_root, settings):
    s = replace(settings, precompute={"device": "cuda:1", "teacher_placement": "balanced",
                                      "teacher_gpu_memory_gib": 5.0, "teacher_cpu_memory_gib": 32.0})
    plan = plan_placement(demo_materials_root / "teacher", s, torch.device("cuda:1"), dtype=torch.bfloat16,
                          free_gpu_bytes={0: 10 * GIB, 1: 10 * GIB}, available_cpu_bytes=64 * GIB)
    assert plan.device_map == "balanced"
    assert plan.max_memory == {0: int(9 * GIB), 1: 5 * GIB, "cpu": 32 * GIB}


def test_cpu_teacher_is_summarized_as_cpu_only(teacher):
    assert teacher.placement.strategy == "single"
    assert list(teacher.placement.summary) == ["cpu"]
    assert teacher.placement.summary["cpu"]["layers"] == TEACHER_LAYERS
    total = sum(p.numel() * p.element_size() for p in teacher.model.parameters()) / GIB
    assert teacher.placement.summary["cpu"]["gib"] == pytest.approx(total, rel=1e-3, abs=1e-4)


def test_device_map_summary_resolves_modules_by_longest_prefix(teacher):
    summary = device_map_summary(teacher.model, {"embed_tokens": 0, "layers": 0, "layers.1": "cpu", "norm": "cpu",
                                                 "rotary_emb": "cpu"})
    assert summary["cuda:0"]["layers"] == TEACHER_LAYERS - 1 and summary["cpu"]["layers"] == 1
    embed = teacher.model.embed_tokens.weight
    assert summary["cuda:0"]["gib"] > embed.numel() * embed.element_size() / GIB


# -- out of memory ----------------------------------------------------------------------------

def _oom_until(fits_at: float, calls: list):
    def attempt(budget: float) -> str:
        calls.append(budget)
        if budget > fits_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return f"ok at {budget}"
    return attempt


def test_sequential_oom_retries_with_a_lower_gpu_budget_and_says_so(settings, caplog):
    calls: list = []
    with caplog.at_level(logging.WARNING, logger="gguf_assets.lib.precompute.teacher"):
        result, budget = lower_budget_on_oom(_oom_until(20.0, calls), budget_gib=24.0, placement="sequential",
                                             advice=lambda b: oom_advice(settings, gpu_budget_gib=b))
    assert (result, budget, calls) == ("ok at 20.0", 20.0, [24.0, 22.0, 20.0])
    assert ("retrying with 22.0 GiB (retry 1 of 3)" in caplog.text
            and "retrying with 20.0 GiB (retry 2 of 3)" in caplog.text)


def test_oom_retries_are_bounded_and_end_with_what_to_lower(settings):
    calls: list = []
    with pytest.raises(PrecomputeOutOfMemory) as err:
        lower_budget_on_oom(_oom_until(0.0, calls), budget_gib=24.0, placement="sequential",
                            advice=lambda b: oom_advice(settings, gpu_budget_gib=b))
    assert calls == [24.0, 22.0, 20.0, 18.0]
    message = str(err.value)
    assert "18.0 GiB after 3 automatic retries" in message
    for setting in ("precompute.token_budget (now 900)", "precompute.teacher_batch (now 3)",
                    "precompute.teacher_gpu_memory_gib (now 18.0 GiB)"):
        assert setting in message
    # The budget never goes to zero or below.
    calls.clear()
    with pytest.raises(PrecomputeOutOfMemory):
        lower_budget_on_oom(_oom_until(0.0, calls), budget_gib=3.0, placement="sequential", advice=str)
    assert calls == [3.0, 1.0]


def test_no_retry_under_balanced_and_other_errors_pass_through(settings):
    calls: list = []
    with pytest.raises(PrecomputeOutOfMemory, match="only happen under sequential placement"):
        lower_budget_on_oom(_oom_until(0.0, calls), budget_gib=24.0, placement="balanced", advice=str)
    assert calls == [24.0]

    def broken(budget: float):
        raise ValueError("not memory")
    with pytest.raises(ValueError, match="not memory"):
        lower_budget_on_oom(broken, budget_gib=24.0, placement="sequential", advice=str)
