"""The memory estimate counts what loads: checked against the safetensors library's own reader and the
adapter's real state dict."""

import subprocess

import pytest
from conftest import CLI, cli_env
from safetensors import safe_open

from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.lib.status.estimate import GIB, adapter_params, estimate, peak_gib
from gguf_assets.lib.training.adapter import Adapter, AdapterShape


@pytest.mark.parametrize("shape", [AdapterShape(48, 256, 64, 64, 1, 4), AdapterShape(96, 8, 32, 128, 3, 8),
                                   AdapterShape(48, 8, 32, 64, 1, 4, student_layers=3, layer_fusion="concat")])
def test_adapter_params_match_the_adapters_state_dict(shape):
    # Several layers concatenated: the estimate counts them as one student k times as wide.
    width = shape.student_dim * shape.student_layers
    assert adapter_params(width, shape.query_rows, shape.target_dim, shape.width, shape.depth) == sum(
        tensor.numel() for tensor in Adapter(shape).state_dict().values())


def _numel(folder, skip=""):
    total = 0
    for file in folder.glob("*.safetensors"):
        if file.name != skip:
            with safe_open(str(file), "pt") as fh:
                for key in fh.keys():
                    count = 1
                    for dim in fh.get_slice(key).get_shape():
                        count *= dim
                    total += count
    return total


def test_the_estimate_counts_the_demo_pairs_weights_and_the_training_state(make_project):
    paths = make_project()
    settings = replace(load_settings(paths.root), precompute={"mock_teacher": False}, training={"ema_decay": 0.99})
    write_project_file(paths.root, settings)
    demo = paths.root / "materials" / "demo"
    lines = {line.part: line for line in estimate(paths, settings)}
    assert lines["teacher"].gib == pytest.approx(_numel(demo / "teacher", "query_rows.safetensors") * 2 / GIB)
    assert lines["student"].gib == pytest.approx(_numel(demo / "student") * 2 / GIB)  # bf16
    training = lines["adapter training"]
    assert training.gib > 0 and "weight average" in training.how and "20 bytes" in training.how
    assert peak_gib(list(lines.values())) == max(lines["teacher"].gib + lines["student"].gib, training.gib)

    done = subprocess.run([*CLI, "estimate", str(paths.root)], capture_output=True, text=True, env=cli_env(),
                          timeout=120)
    assert done.returncode == 0 and "peak on one GPU" in done.stdout and "Traceback" not in done.stderr, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()[1:4]] == ["teacher", "student", "adapter"]
    # `status` shows the same peak before the shards are computed ("will it fit?", before anything loads).
    status = subprocess.run([*CLI, "status", str(paths.root)], capture_output=True, text=True, env=cli_env(),
                            timeout=120)
    (memory,) = [line for line in status.stdout.splitlines() if line.strip().startswith("memory:")]
    peak = next(line for line in done.stdout.splitlines() if "peak on one GPU" in line).split()[4:6]
    assert f"peak on one GPU {' '.join(peak)} (teacher " in memory and "estimate" in memory, status.stdout


def test_a_hub_model_not_downloaded_yet_is_unknown_not_zero(make_project):
    paths = make_project(materials={"teacher": "org/big-teacher"}, precompute={"mock_teacher": False})
    lines = {line.part: line for line in estimate(paths, load_settings(paths.root))}
    assert lines["teacher"].gib is None and "org/big-teacher" in lines["teacher"].how
    assert lines["adapter training"].gib is None and peak_gib(list(lines.values())) is None


def _large_pair_script():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parents[3] / "benchmarks" / "estimate_large.py"
    spec = importlib.util.spec_from_file_location("estimate_large", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_30b_class_moe_teacher_and_a_0_6b_student_from_config_json_alone_match_the_placement_planner(tmp_path):
    """Config-only folders (no weights downloaded): the estimate builds them on the meta device, and the
    precompute's own planner puts exactly that many GiB on the devices."""
    import torch

    from gguf_assets.lib.precompute.teacher import plan_placement
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.lib.status.estimate import teacher_placements

    large = _large_pair_script()
    project = large.build_pair(tmp_path)
    paths, settings = ProjectPaths.of(project), load_settings(project)
    lines = {line.part: line for line in estimate(paths, settings)}
    materials = settings.materials
    teacher_dir, student_dir = paths.resolve_local(materials.teacher), paths.resolve_local(materials.student)
    assert [f.name for f in teacher_dir.glob("*.safetensors")] == ["query_rows.safetensors"]  # no weights
    assert "meta device" in lines["teacher"].how and "meta device" in lines["student"].how
    assert 29e9 < lines["teacher"].gib * GIB / 2 < 31e9  # 30B-class, in bf16
    assert 0.55e9 < lines["student"].gib * GIB / 2 < 0.65e9  # 0.6B-class, in bf16

    two_gpus = {0: 80 * GIB, 1: 80 * GIB}
    planned = plan_placement(teacher_dir, settings, torch.device("cuda:0"), dtype=torch.bfloat16,
                             free_gpu_bytes=two_gpus, available_cpu_bytes=128 * GIB)
    assert sum(v["gib"] for v in planned.summary.values()) == pytest.approx(lines["teacher"].gib, rel=1e-4)
    student_planned = plan_placement(student_dir, settings, torch.device("cpu"), dtype=torch.bfloat16)
    assert student_planned.summary["cpu"]["gib"] == pytest.approx(lines["student"].gib, rel=1e-4)
    assert lines["adapter training"].gib > 0 and peak_gib(list(lines.values())) == pytest.approx(
        lines["teacher"].gib + lines["student"].gib)

    placements = teacher_placements(teacher_dir, settings, free_gpu_bytes=two_gpus, available_cpu_bytes=128 * GIB)
    assert placements["sequential"] == planned.summary  # the precompute's planner: all of it on the first GPU
    assert set(planned.summary) == {"cuda:0"} and planned.summary["cuda:0"]["layers"] == large.QWEN3_MOE_30B_A3B[
        "num_hidden_layers"]
    balanced = placements["balanced"]
    assert set(balanced) >= {"cuda:0", "cuda:1"} and balanced["cuda:0"]["gib"] < 0.6 * lines["teacher"].gib
    assert sum(v["gib"] for v in balanced.values()) == pytest.approx(lines["teacher"].gib, rel=1e-4)


def test_the_estimate_says_where_the_teacher_would_go_on_the_gpus_there_are(tmp_path):
    from gguf_assets.lib.project.layout import ProjectPaths
    from gguf_assets.lib.status.estimate import estimate_lines

    project = _large_pair_script().build_pair(tmp_path)
    paths, settings = ProjectPaths.of(project), load_settings(project)
    gpus = [{"index": 0, "mem_total_gib": 80.0, "mem_used_gib": 0.5}, {"index": 1, "mem_total_gib": 80.0,
                                                                         "mem_used_gib": 0.5}]
    lines = estimate_lines(paths, settings, gpus=gpus)
    assert "this machine: GPU 0 80 GiB, GPU 1 80 GiB" in lines[3]
    sequential, balanced = lines[4:]
    assert sequential.startswith("  teacher placement sequential (precompute.teacher_placement): cuda:0 48 layers ")
    assert balanced.startswith("  teacher placement balanced: cuda:0 ") and "cuda:1" in balanced
    assert estimate_lines(paths, settings, gpus=[])[4:] == []  # no GPU: nothing to place on
    on_cpu = replace(settings, precompute={"device": "cpu"})
    assert estimate_lines(paths, on_cpu, gpus=gpus)[4:] == []  # the precompute keeps it all on the CPU
