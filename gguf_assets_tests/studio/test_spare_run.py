"""The studio's spare run (studio/spare_run.py): loaded ahead, it runs the pipeline as `gguf-trainer run` does
when Run hands it the go, and ends having done nothing when the studio goes away first."""

import subprocess

import pytest
from conftest import CLI, cli_env, copy_project

from gguf_assets.studio.spare_run import SpareRun

pytestmark = pytest.mark.slow  # each spare loads Dagster and torch (seconds of CPU)


def _ended(process: subprocess.Popen) -> int:
    return process.wait(timeout=300)


def test_a_spare_whose_studio_goes_away_ends_having_written_nothing(tmp_path, monkeypatch):
    for name, value in cli_env().items():  # the environment a studio started by `gguf-trainer ui` has
        monkeypatch.setenv(name, value)
    log = tmp_path / ".dagster" / "studio-run.log"
    spare = SpareRun(tmp_path, log)
    spare.ensure()
    spare.ensure()  # one spare at a time
    waiting = spare._process
    waiting.stdin.close()  # what the studio's end (a kill -9 too) does to the spare's pipe
    assert _ended(waiting) == 0
    assert list(tmp_path.iterdir()) == []  # no run log, no lock, no instance
    assert spare.go() is None  # Run then starts a cold run


def test_the_go_runs_the_pipeline_as_gguf_trainer_run_does(finished_project, tmp_path, monkeypatch):
    for name, value in cli_env().items():
        monkeypatch.setenv(name, value)
    paths = copy_project(finished_project[0], tmp_path / "project")
    log = paths.dagster_home / "studio-run.log"
    spare = SpareRun(paths.root, log)
    spare.ensure()
    run = spare.go()
    assert run is not None and not spare.ready()
    assert _ended(run) == 0
    warm = log.read_text(encoding="utf-8").splitlines()
    cold = subprocess.run([*CLI, "run", str(paths.root)], env=cli_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)  # as the run log holds both
    assert cold.returncode == 0, cold.stdout
    # The same status and results, after each one's own first line.
    assert warm[0] == "starting: the pipeline (loaded ahead by the studio)"
    assert cold.stdout.splitlines()[0] == "starting: loading the pipeline"
    assert warm[1:] == cold.stdout.splitlines()[1:] and any(line.startswith("GGUF:") for line in warm), warm
