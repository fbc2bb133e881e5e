"""The first thing gguf-trainer does, with the standard library only: a Ctrl-C while the commands' modules load ends
it quietly (cli/__init__.py sets it, cli/commands.py takes it back once they are loaded)."""

import os
import sys


def quiet_exit_while_loading(_signum, _frame) -> None:
    """Exit at once with the shell's code for a Ctrl-C. Not sys.exit: a handler's exception is raised in whatever
    Python code runs when the signal comes, and while modules load that is often one of importlib's weakref
    callbacks, where an exception is printed as "Exception ignored" and dropped. The command then went on: a
    `gguf-trainer ui` stopped that way started all its servers (a loaded suite run, 2026-12-03). Nothing has been
    started or written yet while modules load, so there is nothing to clean up but the output buffers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, RuntimeError):  # closed, or the signal came in the middle of a write
            pass
    os._exit(130)
