"""The memory estimate counts what loads: checked against the safetensors library's own reader and the
adapter's real state dict."""

import subprocess

import pytest
from conftest import CLI, cli_env
from safetensors import safe_open

from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.lib.telemetry.estimate import GIB, adapter_params, estimate, peak_gib
from gguf_assets.lib.training.adapter import Adapter, AdapterShape


@pytest.mark.parametrize("shape", [AdapterShape(48, 256, 64, 64, 1, 4), AdapterShape(96, 8, 32, 128, 3, 8)])
def test_adapter_params_match_the_adapters_state_dict(shape):
    assert adapter_params(shape.student_dim, shape.query_rows, shape.target_dim, shape.width, shape.depth) == sum(
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


def test_a_hub_model_not_downloaded_yet_is_unknown_not_zero(make_project):
    paths = make_project(materials={"teacher": "org/big-teacher"}, precompute={"mock_teacher": False})
    lines = {line.part: line for line in estimate(paths, load_settings(paths.root))}
    assert lines["teacher"].gib is None and "org/big-teacher" in lines["teacher"].how
    assert lines["adapter training"].gib is None and peak_gib(list(lines.values())) is None
