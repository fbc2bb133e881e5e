"""`gguf-trainer run` executes the pipeline in a child process of its own process group, which dies with it, and
forwards Ctrl-C and SIGTERM to it; the child's stderr drops Dagster's multi-line noise about storage errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# Set in the process that executes the pipeline (see run_in_own_process_group).
RUN_CHILD_ENV = "GGUF_ASSETS_RUN_CHILD"
_PR_SET_PDEATHSIG = 1


# Dagster writes these straight to stderr, multi-line SQL included, and then raises the error, which is
# reported as one line (a full disk: dagster_storage_problem).
DAGSTER_NOISE = ("Exception while writing logger call to event log",)


class WithoutLines:
    """A text stream that drops the writes starting with one of ``prefixes`` and passes on the rest."""

    def __init__(self, stream, prefixes: tuple[str, ...]) -> None:
        self._stream, self._prefixes = stream, prefixes

    def write(self, text: str) -> int:
        return len(text) if text.startswith(self._prefixes) else self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _die_with_parent() -> None:
    """In the child, before exec: the kernel kills it when the parent dies (a kill -9 of
    `gguf-trainer run` still stops the work at once, as it did when the work ran in that process)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run_in_own_process_group(argv: list[str], *, stop=None) -> int:
    """Execute `gguf-trainer <argv>` (a `run`) in a child process of its own process group, and forward Ctrl-C and
    SIGTERM to it; returns its exit code.

    A Ctrl-C in a terminal reaches the whole foreground process group. Dagster's step helpers (the
    compute-log `tail` and its `watch_orphans.py` watcher) are children of the executing process, so
    each printed a KeyboardInterrupt traceback over the clean "stopped" line; in a group of its own
    only the pipeline hears the stop, once, and ends its helpers itself.

    ``stop``: the caller's services.StopSignals (`auto-resume`, which goes on to start the daemon), which also
    notes each stop forwarded. A child stopped early dies of the signal (its handlers are not set yet), with no
    "stopped" line or code of its own: `auto-resume` once read that as a finished pipeline and started the daemon,
    which was seen running 85 minutes later. A stop the caller noted already, or one that comes before the child exists,
    starts no child: 128 + the signal is returned.

    This module imports nothing of gguf_assets: `gguf-trainer run` starts the child before it loads anything else
    (cli.py), since every module this process would load the child loads again.
    """
    command = [sys.executable, "-m", "gguf_assets.cli", *argv]
    child: subprocess.Popen | None = None
    unsent: list[int] = []  # stops that came while the child was being started

    def forward(signum, _frame):
        if stop is not None:
            stop.note(signum)
        if child is None:
            unsent.append(signum)
        elif child.poll() is None:
            os.kill(child.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        noted = stop.signal if stop is not None else None
        if noted is not None or unsent:
            return 128 + (noted or unsent[0])
        child = subprocess.Popen(command, env={**os.environ, RUN_CHILD_ENV: "1"}, process_group=0,
                                 preexec_fn=_die_with_parent)
        if unsent:  # it came during the start: SIGTERM, which ends a Python still starting without a traceback
            os.kill(child.pid, signal.SIGTERM)
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code < 0 and -code in (signal.SIGINT, signal.SIGTERM):  # stopped while it loaded, before its own handling
        print(f"stopped ({signal.Signals(-code).name}) while the pipeline was loading: nothing had started; the next "
              "run continues from where the project stands", file=sys.stderr, flush=True)
        return 128 - code
    if code < 0:  # killed (a power cut, the OOM killer)
        if -code != signal.SIGKILL:  # SIGKILL cannot be caught, so it needs no reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)  # ends this process the same way, as if the work had run in it
    return code
