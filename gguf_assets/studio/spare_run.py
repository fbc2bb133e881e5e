"""A spare `gguf-trainer run` for the studio: started ahead of a Run, it loads the pipeline's modules (Dagster, the
definitions' modules, torch) and waits; Run hands it the go, so the first training step comes after the planning
and the step alone, not after seconds of imports (#36 item 4: about two thirds of Run -> first step were imports).

The spare reads one line on its stdin. ``run`` starts the pipeline exactly as the child of `gguf-trainer run DIR`
does (GGUF_ASSETS_RUN_CHILD: the same code, lock, Dagster jobs and console log). End of file (the studio ended, a
kill -9 included) ends it having done nothing: nothing is written before the go. What depends on the project
(project.yaml, the Dagster instance, the code location) is read at the go, as a cold run reads it; a gguf_assets
source file edited since the spare loaded it makes the go a cold run (a fresh interpreter), so an edit of the code
takes effect at the next Run, as before (a library upgraded in the venv takes a restart of `ui`, as the studio does).

    python -m gguf_assets.studio.spare_run DIR LOG [RUN ARGS]   # the studio starts it (SpareRun)
    # then "run" on its stdin is the go: `gguf-trainer run DIR [RUN ARGS]`
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from gguf_assets.cli.processes import RUN_CHILD_ENV

GO = "run"
# What a run loads before its first step, and nothing that reads the project: training's curves TensorBoard's
# writer; gguf_assets.definitions reads project.yaml, so it loads at the go. (Not torch._dynamo: the trainer's
# optimizer no longer loads it, lib/training/optimizer.py; a run that precomputes loads it with transformers.)
PRELOAD = ("gguf_assets.orchestration.launching", "gguf_assets.lib.training.train", "torch.utils.tensorboard")


def spare_command(project: Path, log_file: Path, run_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "gguf_assets.studio.spare_run", str(project), str(log_file), *run_args]


class SpareRun:
    """The studio's one spare run process, for the project ``project``, writing to the run log ``log_file``; at the
    go it runs `gguf-trainer run project *run_args`."""

    def __init__(self, project: Path, log_file: Path, run_args: list[str] | None = None) -> None:
        self.project, self.log_file, self.run_args = project, log_file, list(run_args or [])
        self._process: subprocess.Popen | None = None
        self._broken = False  # a spare failed while loading: Runs start cold (their log shows why), none is retried

    def ready(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def ensure(self) -> None:
        """Start a spare unless one waits already (call it while no run is going: loading competes for the CPU)."""
        if self.ready() or self._broken:
            return
        if self._process is not None and self._process.returncode != 0:
            self._broken = True
            return
        # Its own session, as the runs the studio starts: stopping the studio does not stop a run it began. Its
        # output goes to the run log from the go on (main), so a spare that never runs leaves no trace.
        self._process = subprocess.Popen(spare_command(self.project, self.log_file, self.run_args),
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)

    def go(self) -> subprocess.Popen | None:
        """Hand the waiting spare the go and return it (it is the run now), or None when none waits."""
        if not self.ready():
            return None
        process, self._process = self._process, None
        try:
            process.stdin.write(f"{GO}\n".encode())
            process.stdin.close()
        except BrokenPipeError:  # it ended between the check and the go
            return None
        return process


def _edited_since(loaded_at: float) -> list[str]:
    """gguf_assets' source files loaded here and edited since ``loaded_at``."""
    edited = []
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and module.__name__.startswith("gguf_assets") and os.path.getmtime(file) > loaded_at:
            edited.append(file)
    return edited


def _await_go(go: threading.Event) -> None:
    if sys.stdin.readline().strip() != GO:
        os._exit(0)  # the studio ended before a Run: at once, loaded or not (nothing was written)
    go.set()


def main(argv: list[str]) -> int:
    project, log_file, *run_args = argv
    loaded_at = time.time()
    go = threading.Event()
    threading.Thread(target=_await_go, args=(go,), name="await-go", daemon=True).start()
    for name in PRELOAD:
        importlib.import_module(name)
    go.wait()
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    log = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for stream in (1, 2):  # the run's console goes to the run log, as a cold run's does
        os.dup2(log, stream)
    os.close(log)
    os.environ[RUN_CHILD_ENV] = "1"
    print("starting: the pipeline (loaded ahead by the studio)", flush=True)
    if _edited_since(loaded_at):  # the code changed since it loaded: the go is a cold run of the code on disk
        os.execv(sys.executable, [sys.executable, "-m", "gguf_assets.cli", "run", project, *run_args])
    from gguf_assets import cli

    return cli.main(["run", project, *run_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
