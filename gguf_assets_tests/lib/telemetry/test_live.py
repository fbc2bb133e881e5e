"""The studio's live figures: the trainer's progress and ETA, the run's history across a resume, precompute rates."""

from gguf_assets.lib.telemetry.live import merged_history, precompute_progress, training_progress


def test_training_progress_shows_the_trainers_own_eta_and_rate():
    shown = training_progress({"step": 30, "loss": 0.51234, "steps_per_s": 2.5, "eta_s": 75.0}, 60)
    assert (shown["step"], shown["steps"], shown["percent"], shown["eta"]) == (30, 60, 50.0, "1m15s")
    assert shown["text"] == "step 30/60, loss 0.5123, 2.50 steps/s, ETA 1m15s"
    # An older log step without the trainer's ETA: the steps left at its rate.
    assert training_progress({"step": 10, "loss": 1.0, "steps_per_s": 2.0}, 60)["eta"] == "25s"


def test_before_the_first_log_step_the_bar_stands_at_the_checkpoint_it_resumed_from():
    shown = training_progress(None, 60, saved_step=30)
    assert (shown["percent"], shown["eta"], shown["loss"]) == (50.0, "?", None)
    assert shown["text"] == "step 30/60: starting (no log step yet)"


def test_while_nothing_trains_the_bar_says_where_training_stands():
    assert training_progress(None, 60, saved_step=60, running=False)["text"] == "finished: 60/60 steps"
    stopped = training_progress(None, 60, saved_step=10, running=False)
    assert stopped["percent"] == 16.67
    assert stopped["text"] == "stopped at step 10/60 (its checkpoint is kept: Run resumes from it)"
    assert training_progress(None, 60, running=False)["text"] == "not trained yet with these settings (0/60 steps)"


def test_a_resumed_runs_history_repeats_no_step():
    saved = [{"step": 0, "val_centred_cosine": 0.1}, {"step": 10, "loss": 1.0}, {"step": 10, "val_centred_cosine": 0.5}]
    live = [{"step": 10, "loss": 9.0}, {"step": 20, "loss": 0.8}, {"step": 20, "val_centred_cosine": 0.6}]
    assert merged_history(saved, live) == [*saved, live[1], live[2]]
    assert merged_history([], live) == live


def test_precompute_progress_keeps_each_split_and_halfs_newest_figures():
    rows = precompute_progress([
        ("train", {"half": "teacher", "done": 100, "total": 1600, "prompts_per_s": 4.0, "eta_s": 375.0}),
        ("train", {"prompts": 400, "seconds": 3.0}),  # a shard's own figures: no progress meter
        ("train", {"half": "teacher", "done": 800, "total": 1600, "prompts_per_s": 4.5, "eta_s": 177.8}),
        ("val", {"half": "student", "done": 200, "total": 200, "prompts_per_s": 50.0, "eta_s": 0.0}),
    ])
    assert [(r["split"], r["half"], r["done"], r["percent"], r["eta"]) for r in rows] == [
        ("train", "teacher", 800, 50.0, "2m58s"), ("val", "student", 200, 100.0, "done")]
    assert rows[0]["text"] == "train teacher: 800/1600 prompts, 4.50 prompts/s, ETA 2m58s"


def test_the_tensorboard_link_opens_the_time_series_unsmoothed_on_one_run_with_the_loss_pinned():
    import json
    from urllib.parse import parse_qs, urlsplit

    from gguf_assets.lib.telemetry.curves_log import tensorboard_timeseries_url

    for url, run in ((tensorboard_timeseries_url("http://127.0.0.1:6006/"), None),
                     (tensorboard_timeseries_url("http://h:1", run="64x1-40steps-lr0.004-ab12"),
                      "64x1-40steps-lr0.004-ab12")):
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        assert parts.path == "/" and parts.fragment == "timeseries" and query["smoothing"] == ["0"], url
        assert query.get("runFilter") == ([run] if run else None), url
        # The loss first (the hardware cards sort before it): pinned cards come above every group (#65).
        assert json.loads(query["pinnedCards"][0]) == [{"plugin": "scalars", "tag": "train/loss"},
                                                       {"plugin": "scalars", "tag": "val/val_centred_cosine"}]
