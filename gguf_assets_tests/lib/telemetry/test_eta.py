"""The measured pace and ETA that `status`, the studio and the console show (lib/telemetry/eta.py): pure arithmetic."""

import math

from gguf_assets.lib.telemetry.eta import BusySpan, busy_seconds, pace, rates_by_kind, work_pace


def test_pace_is_the_work_left_at_the_measured_rate():
    assert pace("training", "steps", 100, 400, 2.0).seconds_left == 150.0
    assert pace("training", "steps", 400, 400, 0.0).seconds_left == 0.0  # done: nothing left, even unmeasured
    assert math.isinf(pace("training", "steps", 0, 400, 0.0).seconds_left)  # nothing measured yet
    assert pace("training", "steps", 100, 400, 2.0).text() == ("training: 100/400 steps, 2.00 steps/s measured, "
                                                                "ETA 2m30s")
    assert pace("training", "steps", 400, 400, 2.0).text().endswith("ETA done")
    assert pace("training", "steps", 0, 400, 0.0).text().endswith("ETA ?")


def test_busy_time_counts_overlaps_once_and_gaps_not_at_all():
    spans = [BusySpan("teacher", 10, 0, 10), BusySpan("teacher", 10, 5, 15), BusySpan("teacher", 10, 100, 110)]
    assert busy_seconds(spans) == 25.0


def test_workers_side_by_side_add_their_speed():
    one = [BusySpan("teacher", 10, 0, 10), BusySpan("teacher", 10, 10, 20)]
    two = [BusySpan("teacher", 10, 0, 10), BusySpan("teacher", 10, 0, 10)]  # two workers at once
    assert rates_by_kind(one) == {"teacher": 1.0}
    assert rates_by_kind(two) == {"teacher": 2.0}


def test_the_precompute_eta_after_one_shard_adds_each_half_left_at_its_own_rate():
    """One shard of 10 prompts done: its teacher half took 10 s, its student half 2 s. 40 prompts are left for each
    half: 40 s of teacher and 8 s of student; a whole prompt (both halves) takes 1.2 s."""
    spans = [BusySpan("teacher", 10, 0, 10), BusySpan("student", 10, 10, 12)]
    measured = work_pace("precompute", "prompts", spans, {"teacher": 40, "student": 40}, done=10, total=50)
    assert measured.seconds_left == 48.0
    assert round(measured.rate, 4) == round(1 / 1.2, 4)
    assert measured.text() == "precompute: 10/50 prompts, 0.83 prompts/s measured, ETA 48s"
    # Only the student half left (the layer changed): the teacher's rate does not enter the ETA.
    assert work_pace("precompute", "prompts", spans, {"teacher": 0, "student": 50}, done=0, total=50).seconds_left == 10
    # A half left that was never measured: the ETA is unknown, not short.
    assert math.isinf(work_pace("precompute", "prompts", spans[:1], {"student": 50}, done=0, total=50).seconds_left)
    assert work_pace("precompute", "prompts", [], {"teacher": 50}, done=0, total=50) is None  # before the first shard
