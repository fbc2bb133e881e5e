"""The studio's live panels read the observations the assets record, each poll only what is new: checked on a
real (ephemeral) Dagster instance with observations shaped as the shard assets and the adapter record them."""

import shutil
from collections import Counter

import dagster as dg
import pytest

from gguf_assets.lib.telemetry.live import precompute_progress
from gguf_assets.studio.app import ObservationFeed


def _observe(instance, asset: str, figures: dict, partition: str | None = None) -> None:
    instance.report_runless_asset_event(dg.AssetObservation(asset_key=asset, partition=partition, metadata=figures))


def test_the_feed_reads_each_assets_observations_once_in_order_per_run():
    instance = dg.DagsterInstance.ephemeral()
    feed = ObservationFeed(instance)
    assert feed.entries("train_shards", "") == []
    _observe(instance, "train_shards", {"half": "teacher", "done": 400, "total": 1600, "prompts_per_s": 4.0,
                                        "eta_s": 300.0}, "00000")
    _observe(instance, "adapter", {"step": 10.0, "loss": 1.5, "steps_per_s": 3.0, "eta_s": 10.0})
    _observe(instance, "train_shards", {"half": "teacher", "done": 800, "total": 1600, "prompts_per_s": 4.0,
                                        "eta_s": 200.0}, "00001")
    shards = feed.entries("train_shards", "")  # runless events belong to the run id ""
    assert [f["done"] for f in shards] == [400, 800]
    assert precompute_progress([("train", f) for f in shards])[0]["text"] == \
        "train teacher: 800/1600 prompts, 4.00 prompts/s, ETA 3m20s"
    assert feed.entries("adapter", "") == [{"step": 10.0, "loss": 1.5, "steps_per_s": 3.0, "eta_s": 10.0}]
    _observe(instance, "adapter", {"step": 20.0, "loss": 1.2, "steps_per_s": 3.0, "eta_s": 6.7})
    assert [f["step"] for f in feed.entries("adapter", "")] == [10.0, 20.0]  # the new one added, none twice
    assert feed.entries("adapter", "another-run") == []


def test_the_page_names_the_run_the_lock_holder_record_names(make_project):
    """The studio's "busy" and "running" come from the project lock's holder record (lib/core/lock.py): the
    pipeline's words, and the run id and job of the Dagster run inside it; the stage it works on shows running."""
    from gguf_assets.lib.core.lock import ProjectLock, RunningRun
    from gguf_assets.studio.app import project_view

    paths = make_project(steps=5, mock_teacher=True)
    feed = ObservationFeed(dg.DagsterInstance.ephemeral())
    idle = project_view(paths, feed)
    assert idle.busy is None and idle.running is None
    with ProjectLock(paths.lock_file, describe="gguf-trainer run demo"):
        assert project_view(paths, feed).busy == "gguf-trainer run demo"
        running = RunningRun(run_id="1a2b3c4d5e6f", job="all_stages", assets=("materials", "corpus"))
        with ProjectLock(paths.lock_file, describe="Dagster run 1a2b3c4d of all_stages", running=running):
            view = project_view(paths, feed)
    assert view.busy == "gguf-trainer run demo"  # the pipeline's words; the run inside it is "running"
    assert view.running == {"run_id": "1a2b3c4d5e6f", "job": "all_stages"}
    materials = next(s for s in view.stages if s["stage"] == "materials")
    assert materials["state"] == "running" and materials["detail"].startswith("run 1a2b3c4d of all_stages; was ")


def test_the_page_and_api_status_share_one_record_of_fifteen_fields(make_project):
    """studio.app.PageView is the page's contract: /api/status serves its fields under these names (the page's
    script reads them), and a project.yaml that does not load keeps the last good view with the error on it."""
    from dataclasses import fields

    from gguf_assets.studio.app import PageView, Studio

    keys = ["project", "settings_error", "stages", "busy", "running", "run_preview", "last_run", "training",
            "snapshots", "precompute", "pace", "hardware_now", "report", "run_command", "signal"]
    assert [f.name for f in fields(PageView)] == keys
    paths = make_project(steps=5, mock_teacher=True)
    studio = Studio(paths, feed=ObservationFeed(dg.DagsterInstance.ephemeral()))
    good = studio.view()
    assert list(good.to_json()) == keys and good.settings_error is None and good.stages[0]["title"] == "Materials"
    paths.project_file.write_text(paths.project_file.read_text() + "\nnot_a_section: {}\n")
    broken = studio.view()
    assert broken.settings_error and broken.run_preview.startswith("Run is refused until project.yaml loads: ")
    assert (broken.stages, broken.run_command) == (good.stages, good.run_command) and studio.last_good is good
    assert list(broken.to_json()) == keys


def test_every_stage_has_its_title_on_the_page():
    """The titles are lib/status/stages.py's one list, in STAGES' order; the studio keeps none of its own."""
    from gguf_assets.lib.status import stages
    from gguf_assets.studio import views

    assert tuple(stages.STAGE_TITLES) == stages.STAGES
    assert not hasattr(views, "STAGE_TITLES")
    assert views.stage_title is stages.stage_title and stages.stage_title("adapter") == "Adapter (training)"


@pytest.mark.slow  # the suite's finished project (one pipeline run, shared), copied
def test_one_poll_of_the_page_reads_each_corpus_split_once(finished_project, tmp_path, monkeypatch):
    """The page's stages, pace, Run preview and training panel share one status_view (lib/status/states.py):
    the corpus is read once per split per poll, with shards left to make and the adapter part trained."""
    from conftest import copy_project

    from gguf_assets.lib.precompute import shards_run
    from gguf_assets.studio.app import project_view

    paths = copy_project(finished_project[0], tmp_path / "project")
    paths.adapter_manifest.unlink()  # trained to its last checkpoint, not recorded: Run would resume it
    shutil.rmtree(paths.root / "shards/val/00000")
    reads: Counter = Counter()
    read_split = shards_run.read_split
    monkeypatch.setattr(shards_run, "read_split", lambda p, split: reads.update([split]) or read_split(p, split))
    view = project_view(paths, ObservationFeed(dg.DagsterInstance.ephemeral()))
    assert reads == Counter({"train": 1, "val": 1})
    assert view.run_preview.startswith("Run starts at Val shards (missing) and resumes training from step ")
    assert [line.split(":")[0] for line in view.pace] == ["precompute"] and view.training is not None


@pytest.mark.slow  # the suite's finished project (one pipeline run, shared), copied
def test_the_pace_of_a_part_trained_run_is_in_the_training_panel_not_under_precompute(finished_project, tmp_path):
    """#65: the precompute's pace goes under its heading, training's under the Training metrics panel's line (and
    only while nothing trains: a running run's line says its rate and ETA itself)."""
    from conftest import copy_project

    from gguf_assets.lib.core import atomic
    from gguf_assets.studio.app import project_view

    paths = copy_project(finished_project[0], tmp_path / "project")
    run_dir = paths.checkpoints_dir(atomic.read_json(paths.adapter_manifest)["fingerprint"])
    paths.adapter_manifest.unlink()
    for newest in ("final", "step-00000040"):  # stopped at step 35, with its log steps' steps/s
        shutil.rmtree(run_dir / newest)
    view = project_view(paths, ObservationFeed(dg.DagsterInstance.ephemeral()))
    assert view.pace == [], view.pace  # no training line under the Precompute heading
    assert view.training["pace"].startswith("training: 35/40 steps, ") and " steps/s measured, ETA " in \
        view.training["pace"], view.training["pace"]
    shutil.rmtree(paths.root / "shards/val/00000")  # shards left to make: their pace is the Precompute heading's
    assert [line.split(":")[0] for line in project_view(paths, ObservationFeed(dg.DagsterInstance.ephemeral())).pace
            ] == ["precompute"]
