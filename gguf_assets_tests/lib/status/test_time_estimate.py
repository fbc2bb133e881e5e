"""`estimate`'s time prediction before any work: the seed's measurement, named, scaled to the project."""

from gguf_assets.lib.project.seed_reference import SEED_PRECOMPUTE, SEED_TRAINING
from gguf_assets.lib.project.settings import load_settings, replace
from gguf_assets.lib.status.time_estimate import time_lines


def test_before_any_work_the_seeds_measurement_is_scaled_and_named(make_project):
    paths = make_project()
    settings = replace(load_settings(paths.root), precompute={"mock_teacher": False},
                       corpus={"train_prompts": 59_000, "val_prompts": 1_000},
                       training={"width": 1024, "depth": 6, "batch_size": 32, "steps": 20_000})
    precompute, training = time_lines(paths, settings)
    assert precompute.startswith("precompute: about 3h42m00s of teacher time for 60,000 prompts, scaled from the "
                                 "seed's measurement (60,000 prompts in 3.7 h on an RTX 5090"), precompute
    assert SEED_PRECOMPUTE.text().endswith(", 4.5 prompts/s") and SEED_PRECOMPUTE.text() in precompute
    assert training.startswith("training: about 55m00s on a GPU like the seed's for 20,000 steps, scaled from the "
                               f"seed's measurement ({SEED_TRAINING.text()} at width 1024"), training
    # Twice the width is four times the work per step.
    wider = replace(settings, training={"width": 2048})
    assert time_lines(paths, wider)[1].startswith("training: about 3h40m00s on a GPU like the seed's for 20,000 steps")
    # No teacher model to run: the seed's teacher figure is not scaled to it.
    mock = time_lines(paths, replace(settings, precompute={"mock_teacher": True}))[0]
    assert "no teacher model to run" in mock and "about" not in mock
    tiny = time_lines(paths, replace(settings, training={"width": 64, "depth": 1, "steps": 40}))[1]
    assert tiny.startswith("training: under 1s on a GPU like the seed's for 40 steps"), tiny
