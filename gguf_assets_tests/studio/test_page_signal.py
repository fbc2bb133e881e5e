"""The studio page's title and the state its browser notification follows (studio/page_signal.py, #65), from the
page's own view: while a pipeline holds the project, the training step or the stage at work; then how the last
run ended; "finished" with the result's score only when every stage is current (a daemon's pipeline between two
jobs is not done)."""

from gguf_assets.studio.page_signal import page_signal

CURRENT = [{"stage": s, "title": s, "state": "current"} for s in ("materials", "train_shards", "adapter")]
REPORT = {"score": 0.90694, "verdict": "Good: ..."}
TRAINING = {"running": True, "progress": {"step": 1740, "steps": 2400}}


def _signal(**view) -> dict:
    return page_signal("demo", **{"busy": False, "stages": CURRENT, "training": None, "last_run": None,
                                  "report": None, **view})


def _last(state: str, **more) -> dict:
    return {"run_id": "r1", "state": state, "stage": None, "message": "", **more}


def test_the_title_says_the_step_while_it_trains_and_the_stage_before():
    assert _signal(busy=True, training=TRAINING)["title"] == "⏳ 1740/2400 · demo"
    precompute = [*CURRENT[:1], {"stage": "train_shards", "title": "Precompute train shards", "state": "running"}]
    assert _signal(busy=True, stages=precompute, training={"running": False, "progress": {"step": 0, "steps": 2400}}
                   ) == {"state": "running", "title": "⏳ Precompute train shards · demo", "detail": "", "run_id": None}
    assert _signal(last_run=_last("running"))["state"] == "running"  # a run of the UI's, before it holds the lock


def test_the_title_says_how_the_last_run_ended():
    done = _signal(last_run=_last("finished"), report=REPORT)
    assert done == {"state": "finished", "title": "✓ 0.907 · demo", "detail": "Good: ...", "run_id": "r1"}
    failed = _signal(last_run=_last("failed", stage="adapter", message="out of memory"), report=REPORT)
    assert (failed["state"], failed["title"], failed["detail"]) == ("failed", "✗ failed · demo",
                                                                   "failed at adapter: out of memory")
    stopped = _signal(last_run=_last("stopped", message="stopped at step 1740; Run continues from there"),
                      training={"running": False, "progress": {"step": 1740, "steps": 2400}})
    assert (stopped["state"], stopped["title"]) == ("stopped", "■ stopped at 1740/2400 · demo")


def test_a_finished_run_with_work_left_is_not_the_end():
    stale = [*CURRENT[:2], {"stage": "adapter", "title": "Adapter", "state": "stale"}]
    idle = _signal(stages=stale, last_run=_last("finished"), report=REPORT)
    assert idle == {"state": "idle", "title": "demo · gguf_assets studio", "detail": "", "run_id": "r1"}
