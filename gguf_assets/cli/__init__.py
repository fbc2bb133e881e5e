"""gguf-trainer, the command line (`gguf-trainer`, `python -m gguf_assets.cli`): commands.py holds the commands,
runs.py `gguf-trainer runs`, processes.py and services.py the processes and servers the commands start and stop.

This module loads nothing but the standard library: run as a program, a Ctrl-C while the commands' modules still
load ends it quietly, and `gguf-trainer run` starts its pipeline process before loading anything (that process
loads and checks it all anyway, so the first training step comes sooner, and Run never looks dead).
"""

import os
import signal
import sys

from gguf_assets.cli.prologue import quiet_exit_while_loading


def main(argv: list[str] | None = None) -> int:
    """The program's entry point (pyproject's `gguf-trainer`, and __main__.py). Called with ``argv`` (a test, a
    warm process), it is a function call: the caller keeps its own Ctrl-C handling."""
    if argv is None:
        signal.signal(signal.SIGINT, quiet_exit_while_loading)
        # `gguf-trainer run` says at once that it started: the pipeline's modules (torch, dagster) take seconds to
        # load, in the child that runs it (GGUF_ASSETS_RUN_CHILD, cli/processes.py), and Run must not look dead.
        if sys.argv[1:2] == ["run"] and not {"-h", "--help"} & set(sys.argv) and \
                os.environ.get("GGUF_ASSETS_RUN_CHILD") != "1":
            print("starting: loading the pipeline", flush=True)
            from gguf_assets.cli.processes import run_in_own_process_group

            return run_in_own_process_group(sys.argv[1:])
    from gguf_assets.cli.commands import main as run_command

    return run_command(argv)
