"""output.notify_url (#65): when a run ends, its own process POSTs how it ended to the user's webhook, a real HTTP
server on 127.0.0.1 here. Real Dagster runs in this process (`run_pipeline`, as `gguf-trainer run` runs them) on a
copy of the suite's finished project, each cheap: a new ggk command re-makes only the report, a new adapter name
the export and the report. A run whose process died is told when it is marked failed. A webhook that cannot be
reached is one line in the run's log, naming the URL by scheme and host only, and the run's outcome is its own."""

import os
import subprocess

import dagster as dg
import pytest
from conftest import copy_project, create_run_with_status, project_instance
from webhook_server import webhook_receiver

from gguf_assets.lib.core import atomic, faults
from gguf_assets.lib.core.liveness import boot_id
from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
from gguf_assets.orchestration.instance import instance_env
from gguf_assets.orchestration.launching import run_pipeline
from gguf_assets.orchestration.outages import PipelineFailed
from gguf_assets.pipeline.resume import mark_interrupted_runs
from gguf_assets.pipeline.run_tags import BOOT_TAG, LEADER_TAG, PID_TAG, WORKER_TAG

pytestmark = pytest.mark.slow  # three small Dagster runs on a copy of the finished project (about 20 s)

SECRET = "/services/T0KEN?key=s3cret"  # a token in the path and the query: no log line may show either


def _set_output(root, **output) -> None:
    write_project_file(root, replace(load_settings(root), output=output))


def _latest_run(instance) -> dg.DagsterRun:
    return instance.get_runs(limit=1)[0]


def _log_lines(instance, run_id: str) -> list[str]:
    return [entry.user_message or "" for entry in instance.all_logs(run_id)]


@pytest.fixture
def project(finished_project, tmp_path, monkeypatch):
    paths = copy_project(finished_project[0], tmp_path / "notice-project")
    for name, value in instance_env(paths).items():  # restored after the test
        monkeypatch.setenv(name, value)
    return paths, project_instance(paths)


def test_a_run_s_end_is_posted_and_an_unreachable_webhook_never_fails_the_run(project, monkeypatch):
    paths, instance = project
    ggk_command = load_settings(paths.root).output.ggk_command
    with webhook_receiver() as hook:
        # Finished: the report is made again (a new ggk command), so the notice carries its score and verdict.
        _set_output(paths.root, notify_url=hook.url + SECRET, ggk_command=ggk_command + " --seed 1")
        run_pipeline(paths, echo=lambda _: None)
        run = _latest_run(instance)
        report = atomic.read_json(paths.root / "output" / "demo-adapter.report.json")
        ((path, notice),) = hook.posts
        assert path == SECRET
        assert {k: notice[k] for k in ("event", "project", "run_id", "job", "outcome", "message", "val_centred_cosine",
                                       "verdict", "gguf")} == {
            "event": "gguf_assets.run_end", "project": "notice-project", "run_id": run.run_id,
            "job": "train_export_evaluate", "outcome": "finished", "message": "",
            "val_centred_cosine": report["val_centred_cosine"], "verdict": report["verdict"],
            "gguf": "demo-adapter.gguf"}
        assert notice["text"].startswith(f"✓ {report['val_centred_cosine']:.3f} · notice-project")
        assert f"run-end notice (finished) sent to {hook.url} (output.notify_url)" in _log_lines(instance, run.run_id)

        # Failed: a full disk in the export; the notice says which step and why, with no score (the report there is
        # the earlier run's).
        faults.reset()
        monkeypatch.setenv(faults.ENV, "gguf-export:enospc")
        _set_output(paths.root, adapter_name="other-adapter")
        with pytest.raises(PipelineFailed, match="No space left on device"):
            run_pipeline(paths, echo=lambda _: None)
        monkeypatch.delenv(faults.ENV)
        failed = _latest_run(instance)
        assert failed.status == dg.DagsterRunStatus.FAILURE
        notice = hook.posts[1][1]
        assert (notice["run_id"], notice["outcome"], notice["val_centred_cosine"], notice["verdict"],
                notice["gguf"]) == (failed.run_id, "failed", None, None, None)
        assert notice["message"].startswith("gguf: ") and "No space left on device" in notice["message"], notice
        assert notice["text"].startswith("✗ failed · notice-project (train_export_evaluate, run ")

    # Unreachable (the receiver is gone): the run finishes as it would without a webhook, and its log says so once.
    said: list[str] = []
    run_pipeline(paths, echo=said.append)
    unreachable = _latest_run(instance)
    assert unreachable.status == dg.DagsterRunStatus.SUCCESS and unreachable.run_id != failed.run_id
    lines = _log_lines(instance, unreachable.run_id)
    told = [line for line in lines if line.startswith("run-end notice")]
    assert told == [f"run-end notice (finished) not delivered to {hook.url} (output.notify_url): [Errno 111] "
                    "Connection refused; the run's outcome is unchanged"], told
    for run_id in (run.run_id, failed.run_id, unreachable.run_id):
        assert not [line for line in _log_lines(instance, run_id) if "T0KEN" in line or "s3cret" in line]
    assert not [line for line in said if "T0KEN" in line]


def test_a_run_whose_process_died_is_told_when_it_is_marked_failed(project):
    paths, instance = project
    gone = subprocess.Popen(["true"])
    gone.wait()
    with webhook_receiver() as hook:
        _set_output(paths.root, notify_url=hook.url + SECRET)
        cut_off = create_run_with_status(instance, status=dg.DagsterRunStatus.STARTED,
                                         tags={PID_TAG: str(gone.pid), BOOT_TAG: boot_id()})
        assert mark_interrupted_runs(instance) == [cut_off.run_id]
        assert mark_interrupted_runs(instance) == []  # marked once, told once
    ((_, notice),) = hook.posts
    assert (notice["project"], notice["run_id"], notice["outcome"]) == ("notice-project", cut_off.run_id, "failed")
    assert notice["message"] == f"interrupted: its process (pid {gone.pid}) is gone or the machine rebooted since it " \
                                "started"
    assert os.path.basename(paths.root) == notice["project"] and str(paths.root) not in str(notice)


def test_worker_runs_cut_off_together_are_told_once_and_not_while_their_leader_lives(project):
    """#65: one pipeline, one notice. The worker runs of `run --workers 2` whose processes died are told of when
    they are marked failed only if their leader (`gguf-trainer run`) is gone too, and then once for the pipeline,
    not once per worker run; while the leader lives, it tells the pipeline's end itself."""
    paths, instance = project
    gone = subprocess.Popen(["true"])
    gone.wait()

    def workers(leader: int) -> list[str]:
        return [create_run_with_status(instance, status=dg.DagsterRunStatus.STARTED,
                                       tags={PID_TAG: str(gone.pid), BOOT_TAG: boot_id(), LEADER_TAG: str(leader),
                                             WORKER_TAG: f"{n}/2"}).run_id for n in (1, 2)]

    with webhook_receiver() as hook:
        _set_output(paths.root, notify_url=hook.url)
        led = workers(os.getpid())  # their leader lives (this process): it tells the end
        assert sorted(mark_interrupted_runs(instance)) == sorted(led)
        assert hook.posts == []
        orphans = workers(gone.pid)  # their leader died with them
        assert sorted(mark_interrupted_runs(instance)) == sorted(orphans)
    ((_, notice),) = hook.posts
    assert notice["outcome"] == "failed" and notice["run_id"] in orphans, notice
