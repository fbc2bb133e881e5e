"""A stop on purpose: Ctrl-C, SIGTERM or Terminate in the Dagster UI ends the current run CANCELED, tags the
project's latest run as stopped, and leaves everything finished for the next run."""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from gguf_assets.pipeline.run_tags import STOPPED_TAG


class StopRequest:
    """A stop on purpose: Ctrl-C, SIGTERM (systemd stop, kill), or Terminate in the Dagster UI.

    Each ends the current run CANCELED, as Dagster does for a run it terminates itself: Dagster
    records an interrupted run as canceled when the run is CANCELING at that moment, so a signal
    marks the run CANCELING, and Terminate in the UI (which marks it CANCELING but cannot reach an
    in-process run) is seen here by polling the run's status, and turned into an interrupt.

    Dagster's own handler raises inside whatever code runs when the signal lands; in a
    garbage-collector callback that exception is swallowed and the stop is lost. So the signal is
    also seen through the wakeup fd by a watcher thread, which delivers SIGINT again every 2 s
    until the pipeline has stopped.
    """
    RESEND_S = 2.0
    POLL_S = 1.0

    def __init__(self, instance=None) -> None:
        self.asked = False
        self.by = ""  # what asked: "Ctrl-C", "SIGTERM" or "Terminate in the Dagster UI"
        self.instance = instance
        self.run_id: str | None = None  # the run this process executes now
        self._over = threading.Event()

    def _interrupt(self, signum, _frame):
        self.asked = True
        self.by = self.by or SIGNAL_NAMES.get(signum, "a signal")
        raise KeyboardInterrupt

    def _run_status(self):
        if self.instance is None or self.run_id is None:
            return None
        try:
            run = self.instance.get_run_by_id(self.run_id)
        except Exception:  # noqa: BLE001  storage unreadable for now (a full disk): the run itself reports that
            return None
        return run.status if run is not None else None

    def _mark_canceling(self) -> None:
        run = self.instance.get_run_by_id(self.run_id) if self.instance and self.run_id else None
        if run is not None and run.status in (dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING):
            self.instance.report_run_canceling(run, message=f"Stopped on purpose ({self.by}).")

    def _watch(self, read_fd: int) -> None:
        while not self._over.is_set():
            ready, _, _ = select.select([read_fd], [], [], self.POLL_S)
            if self._over.is_set():
                return
            if ready:
                data = os.read(read_fd, 64)
                if not data:
                    return
                signals = [b for b in data if b in (signal.SIGINT, signal.SIGTERM)]
                if not signals:
                    continue
                self.asked = True
                self.by = self.by or SIGNAL_NAMES[signals[0]]
                self._mark_canceling()
            elif self._run_status() == dg.DagsterRunStatus.CANCELING:
                self.asked, self.by = True, self.by or "Terminate in the Dagster UI"
                os.kill(os.getpid(), signal.SIGINT)
            else:
                continue
            while not self._over.wait(self.RESEND_S):
                os.kill(os.getpid(), signal.SIGINT)
            return

    def record_cancel(self, run_id: str) -> None:
        """The run this stop cut short is CANCELED, never a failure (a signal may have beaten the mark)."""
        run = self.instance.get_run_by_id(run_id)
        if run is not None and run.status != dg.DagsterRunStatus.CANCELED:
            self.instance.report_run_canceled(run, message=f"Stopped on purpose ({self.by or 'a stop'}); "
                                              "`gguf-trainer run` continues from the last finished shard and "
                                              "checkpoint.")

    @contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        if threading.current_thread() is not threading.main_thread():  # e.g. inside a test runner thread
            yield self
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        previous = {sig: signal.signal(sig, self._interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
        watcher = threading.Thread(target=self._watch, args=(read_fd,), name="stop-watcher", daemon=True)
        watcher.start()
        try:
            yield self
        finally:
            self._over.set()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_fd)
            os.write(write_fd, b"\0")  # wakes the watcher so it can end
            watcher.join(timeout=5)
            os.close(write_fd)
            os.close(read_fd)


SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@contextmanager
def stop_tags_the_latest_run(instance) -> Iterator[None]:
    """A stop on purpose (Ctrl-C, SIGTERM) tags the project's latest run as stopped, wherever it
    landed: inside a run, or between two (a run had just succeeded). The daemon's resume sensor
    then leaves the pipeline for the user to continue (pipeline/resume.py). The lock is still held."""
    try:
        yield
    except KeyboardInterrupt:
        latest = next(iter(instance.get_run_records(limit=1)), None)
        if latest is not None and STOPPED_TAG not in latest.dagster_run.tags:
            instance.add_run_tags(latest.dagster_run.run_id, {STOPPED_TAG: "true"})
        raise
