"""`estimate`'s time prediction: what this machine measured where it has measured; before that, the seed's GPU
measurement, named and scaled to the project, and on a CPU the demo's CPU measurement for training."""

import shutil

import pytest

from gguf_assets.lib.core import atomic
from gguf_assets.lib.planning.time_estimate import time_lines
from gguf_assets.lib.project.seed_reference import SEED_PRECOMPUTE, SEED_TRAINING
from gguf_assets.lib.project.settings import load_settings, replace

A_GPU = [{"index": 0, "mem_total_gib": 24.0, "mem_used_gib": 0.0}]


def test_before_any_work_the_seeds_measurement_is_scaled_and_named(make_project):
    paths = make_project()
    settings = replace(load_settings(paths.root), precompute={"mock_teacher": False, "device": "auto"},
                       corpus={"train_prompts": 59_000, "val_prompts": 1_000},
                       training={"width": 1024, "depth": 6, "batch_size": 32, "steps": 20_000, "device": "auto"})
    precompute, training = time_lines(paths, settings, gpus=A_GPU)
    assert precompute.startswith("precompute: about 3h42m00s of teacher time for 60,000 prompts, scaled from the "
                                 "seed's measurement (60,000 prompts in 3.7 h on an RTX 5090"), precompute
    assert SEED_PRECOMPUTE.text().endswith(", 4.5 prompts/s") and SEED_PRECOMPUTE.text() in precompute
    assert training.startswith("training: about 55m00s on a GPU like the seed's for 20,000 steps, scaled from the "
                               f"seed's measurement ({SEED_TRAINING.text()} at width 1024"), training
    # Twice the width is four times the work per step.
    wider = replace(settings, training={"width": 2048})
    assert time_lines(paths, wider, gpus=A_GPU)[1].startswith(
        "training: about 3h40m00s on a GPU like the seed's for 20,000 steps")
    # No teacher model to run: the seed's teacher figure is not scaled to it.
    mock = time_lines(paths, replace(settings, precompute={"mock_teacher": True}), gpus=A_GPU)[0]
    assert "no teacher model to run" in mock and "about" not in mock
    tiny = time_lines(paths, replace(settings, training={"width": 64, "depth": 1, "steps": 40}), gpus=A_GPU)[1]
    assert tiny.startswith("training: under 1s on a GPU like the seed's for 40 steps"), tiny


def test_without_a_gpu_training_gets_a_cpu_figure_and_the_precompute_says_why_it_has_none(make_project):
    """The issue's demo: "under 1s on a GPU like the seed's" where it took 2 minutes on the CPU. With no GPU here (or
    the stage's device set to cpu) the CPU figure comes first, the seed's GPU figure after it, each named."""
    paths = make_project()
    settings = replace(load_settings(paths.root), precompute={"mock_teacher": False, "device": "auto"},
                       training={"width": 128, "depth": 1, "batch_size": 16, "steps": 2_400, "device": "auto"})
    precompute, training = time_lines(paths, settings, gpus=[])
    assert training.startswith("training on this machine's CPU (no NVIDIA GPU here): about 2m05s for 2,400 steps, "
                               "scaled from the demo's measurement on 2 CPU cores (1,200 steps in 1m02s"), training
    assert "On a GPU like the seed's: under 1s, scaled from the seed's measurement" in training
    assert precompute.startswith("precompute on this machine's CPU (no NVIDIA GPU here): not known before its first "
                                 "shard, since a CPU's pace hangs on the teacher's size"), precompute
    assert "On a GPU like the seed's: about" in precompute and "scaled from the seed's measurement" in precompute
    on_cpu = replace(settings, precompute={"device": "cpu"}, training={"device": "cpu"})
    assert [line.split(":")[0] for line in time_lines(paths, on_cpu, gpus=A_GPU)] == [
        "precompute on this machine's CPU (precompute.device is cpu)",
        "training on this machine's CPU (training.device is cpu)"]


@pytest.mark.slow  # the suite's finished project (one pipeline run, shared), copied
def test_what_this_machine_measured_is_the_estimate_once_it_ran(finished_project, tmp_path):
    """After a run, the figures are this machine's own: the shard halves' recorded prompts and busy seconds, the
    training run's steps and seconds, scaled to a wider adapter; not the seed's (with a GPU here or not)."""
    from conftest import copy_project

    paths = copy_project(finished_project[0], tmp_path / "project")
    settings = load_settings(paths.root)
    meta = atomic.read_json(paths.checkpoints_dir(atomic.read_json(paths.root / "checkpoints" / "final.json")[
        "fingerprint"]) / "final" / "meta.json")
    for gpus in ([], A_GPU):
        precompute, training = time_lines(paths, settings, gpus=gpus)
        assert precompute.startswith("precompute: ") and ", measured on this machine (" in precompute, precompute
        assert "shard halves it computed in this project); loading the models comes on top" in precompute
        rate = meta["step"] / meta["train_seconds"]
        assert training.startswith("training: ") and f"for {settings.training.steps:,} steps, measured on this " \
            f"machine ({rate:.1f} steps/s: run " in training, training
        assert "seed" not in precompute + training
    wider = time_lines(paths, replace(settings, training={"width": 2 * settings.training.width}), gpus=[])[1]
    assert wider.endswith(", scaled to these settings by batch x depth x width squared)"), wider
    # Shards of other settings measured this machine too: their sidecars' busy seconds still count.
    more = replace(settings, corpus={"train_prompts": 2 * settings.corpus.train_prompts})
    assert ", measured on this machine (" in time_lines(paths, more, gpus=[])[0]
    shutil.rmtree(paths.root / "shards")
    assert "no teacher model to run" in time_lines(paths, settings, gpus=[])[0]  # unmeasured, and the mock teacher
