"""The training curves' event files, as TensorBoard reads them."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.summary.writer import event_file_writer

from gguf_assets.lib.telemetry.curves_log import CurvesLog


def test_a_resume_in_the_same_second_still_reads_after_the_stopped_session(tmp_path, monkeypatch):
    """TensorBoard reads a run's event files in name order: a resumed session's file must come after the stopped
    one's even when both start within a second in one process, with the file counter going from 9 to 10 ("10"
    sorts before "9"), as happened in the suite. Otherwise the stopped steps show after the resumed ones."""
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    stopped = CurvesLog(tmp_path)
    for step in (5, 10, 15):  # step 15 is after the checkpoint at 10: the resumed session redoes it
        stopped.scalars(step, {"loss": float(step)}, "train")
    stopped.close()
    resumed = CurvesLog(tmp_path, resumed_at_step=10)
    for step in (15, 20):
        resumed.scalars(step, {"loss": step + 0.5}, "train")
    resumed.close()

    curves = EventAccumulator(str(tmp_path))
    curves.Reload()
    assert [(e.step, e.value) for e in curves.Scalars("train/loss")] == [(5, 5.0), (10, 10.0), (15, 15.5), (20, 20.5)]
