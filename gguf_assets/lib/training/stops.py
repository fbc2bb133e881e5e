"""Stops that wait for a whole step: Ctrl-C, SIGTERM and Dagster's Terminate reach a run as a signal whose
handler raises at whatever line runs then (KeyboardInterrupt, or Dagster's DagsterExecutionInterruptedError).
Inside a ``StopHold`` block the signal is only noted, and delivered, to the handler that was there, when the
block ends: the training state is then whole, and a checkpoint of it resumes byte-identically.

A block that does not end soon (a hung device, a stalled read) must not make Stop useless: a stop held for
``max_hold_s``, or a second stop, is delivered at once, mid-block, and ``forced`` says so (that state is not
whole: the caller keeps its last checkpoint instead). No dagster import: its interrupt is recognised by name.
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
MAX_HOLD_S = 5.0
_DAGSTER_INTERRUPT = "DagsterExecutionInterruptedError"


def is_stop(exc: BaseException) -> bool:
    """Whether ``exc`` is a stop asked for (Ctrl-C, SIGTERM, Terminate), not a failure."""
    return isinstance(exc, KeyboardInterrupt) or any(cls.__name__ == _DAGSTER_INTERRUPT for cls in type(exc).__mro__)


class StopHold:
    """``with hold:`` around each step; reusable. Only the main thread can set handlers: elsewhere (where no
    signal handler runs anyway) a block runs as it is."""

    def __init__(self, max_hold_s: float = MAX_HOLD_S) -> None:
        self.max_hold_s = max_hold_s
        self.forced = False  # a stop was delivered mid-block: the state may be half a step
        self._came: list[int] = []
        self._previous: dict[int, object] = {}
        self._active = False

    def __enter__(self) -> "StopHold":
        self._active = threading.current_thread() is threading.main_thread()
        if self._active:
            self._came = []
            self._previous = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGALRM)}
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._note)
            signal.signal(signal.SIGALRM, self._force)
        return self

    def _note(self, signum: int, frame) -> None:
        if self._came:  # a second stop: the user will not wait
            self._came.append(signum)
            self._force(signum, frame)
            return
        self._came.append(signum)
        signal.setitimer(signal.ITIMER_REAL, self.max_hold_s)

    def _force(self, _signum: int, _frame) -> None:
        self.forced = True
        self._restore()
        signal.raise_signal(self._came[0])  # its own handler raises here, mid-block

    def _restore(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        self._previous = {}

    def __exit__(self, *exc) -> None:
        if not self._active or not self._previous:  # not the main thread, or already delivered (forced)
            return
        self._restore()
        for sig in dict.fromkeys(self._came):
            signal.raise_signal(sig)  # the handler that was there now acts, between two whole steps
