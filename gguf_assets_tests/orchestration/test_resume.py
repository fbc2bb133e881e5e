"""Survive a kill -9: the cut-off run is marked failed, by the sensor or by --auto-resume at boot.

(A kill -9 during training followed by a bit-identical resume, and the refusal of a second
pipeline, are in test_orchestration.py; kills at named points in test_faults.py.)"""

import os
import signal
import subprocess

import dagster as dg
import pytest
from conftest import (
    CLI,
    cli_env,
    copy_project,
    free_port,
    project_instance,
    wait_for,
    wait_http,
)


def test_sensor_marks_cut_off_runs_failed_and_frees_their_gpu_slots(tmp_path):
    """What the daemon does between boots: a run whose process is gone, or that began before a
    reboot, is failed with the reason and its `gpu` slot freed; a live run is left alone."""
    from conftest import create_run_with_status

    from gguf_assets.defs.sensors import interrupted_runs_sensor
    from gguf_assets.lib.core.liveness import boot_id
    from gguf_assets.pipeline.run_tags import BOOT_TAG, PID_TAG

    gone = subprocess.Popen(["true"])
    gone.wait()
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 2)
        runs = {
            "killed": {PID_TAG: str(gone.pid), BOOT_TAG: boot_id()},
            "before_reboot": {PID_TAG: str(os.getppid()), BOOT_TAG: "an-earlier-boot"},
            "alive": {PID_TAG: str(os.getppid()), BOOT_TAG: boot_id()},
        }
        ids = {}
        for name, tags in runs.items():
            ids[name] = create_run_with_status(instance, status=dg.DagsterRunStatus.STARTED, tags=tags).run_id
        for name in ("killed", "alive"):
            assert storage.claim_concurrency_slot("gpu", ids[name], "adapter").is_claimed

        skip = interrupted_runs_sensor()(dg.build_sensor_context(instance=instance))
        assert "marked 2 interrupted run(s)" in skip.skip_message

        status = {name: instance.get_run_by_id(run_id).status for name, run_id in ids.items()}
        assert status == {"killed": dg.DagsterRunStatus.FAILURE, "before_reboot": dg.DagsterRunStatus.FAILURE,
                          "alive": dg.DagsterRunStatus.STARTED}
        failure = instance.all_logs(ids["killed"], of_type=dg.DagsterEventType.RUN_FAILURE)[0]
        assert f"pid {gone.pid}" in failure.message and "Interrupted" in failure.message
        info = storage.get_concurrency_info("gpu")
        assert info.active_run_ids == {ids["alive"]} and info.active_slot_count == 1
        # A second pass finds nothing more to do.
        result = interrupted_runs_sensor()(dg.build_sensor_context(instance=instance))
        assert "no interrupted runs" in result.skip_message


def test_sensor_runs_by_default_only_when_auto_resume_is_on(make_project):
    from gguf_assets.definitions import build_definitions
    from gguf_assets.lib.project.settings import load_settings, replace, write_project_file

    paths = make_project(steps=5, mock_teacher=True)
    sensor = build_definitions(str(paths.root)).resolve_sensor_def("interrupted_runs_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    write_project_file(paths.root, replace(load_settings(paths.root), output={"auto_resume": False}))
    sensor = build_definitions(str(paths.root)).resolve_sensor_def("interrupted_runs_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.STOPPED


@pytest.mark.slow  # a whole pipeline or subprocesses
def test_auto_resume_serves_the_ui_and_its_daemon_fails_runs_cut_off_later(finished_project, tmp_path):
    """`--auto-resume DIR --ui-port P` on a finished project: the UI answers, the daemon's sensor (on by default)
    fails a run that dies while it watches, and Ctrl-C stops the webserver and the daemon. (The kill tests run it
    on unfinished work.)"""
    import psutil
    from conftest import create_run_with_status

    from gguf_assets.lib.core.liveness import boot_id
    from gguf_assets.pipeline.run_tags import BOOT_TAG, PID_TAG

    paths = copy_project(finished_project[0], tmp_path / "copy")
    port = free_port()
    proc = subprocess.Popen([*CLI, "--auto-resume", str(paths.root), "--ui-port", str(port)], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/server_info", timeout=120, proc=proc)
        wait_for(lambda: any("dagster-daemon" in " ".join(_cmdline(c))
                              for c in psutil.Process(proc.pid).children(recursive=True)),
                  timeout=600, what="the daemon", proc=proc)
        instance = project_instance(paths)
        gone = subprocess.Popen(["true"])
        gone.wait()
        cut_off = create_run_with_status(instance, status=dg.DagsterRunStatus.STARTED,
                                      tags={PID_TAG: str(gone.pid), BOOT_TAG: boot_id()}).run_id
        wait_for(lambda: instance.get_run_by_id(cut_off).status == dg.DagsterRunStatus.FAILURE, timeout=120,
                  what="the sensor to fail the cut-off run", proc=proc)
        children = psutil.Process(proc.pid).children(recursive=True)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("gguf-trainer --auto-resume did not stop within 30 s of Ctrl-C")
    assert "marked 0 interrupted run(s)" in out and "starting dagster-daemon" in out
    # The sensor ticked (it failed the run), and the webserver and the daemon served: none of their INFO lines.
    assert "INFO" not in out, out
    assert all(s.state == "current" for s in _status(paths)), out
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {[c.cmdline() for c in alive]}"


def _cmdline(process) -> list[str]:
    """A child's command line, or nothing for one that has just exited (zombie or gone)."""
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _status(paths):
    from gguf_assets.lib.project.settings import load_settings
    from gguf_assets.lib.status.states import project_status

    return project_status(paths, load_settings(paths.root))


def test_a_stop_between_two_runs_still_tells_the_daemon_to_leave_the_pipeline(make_project, monkeypatch):
    """Ctrl-C that lands after a run succeeded and before the next starts: the latest run is tagged
    stopped, so the resume sensor waits for the user instead of starting the next job."""
    from gguf_assets.orchestration import launching
    from gguf_assets.orchestration.launching import run_pipeline
    from gguf_assets.pipeline.resume import resume_decision
    from gguf_assets.pipeline.run_tags import STOPPED_TAG

    paths = make_project(steps=5, mock_teacher=True)
    real_next_work, calls = launching.next_work, []

    def stop_before_the_second_job(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_next_work(*args, **kwargs)

    monkeypatch.setattr(launching, "next_work", stop_before_the_second_job)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(paths, echo=lambda _: None)
    instance = project_instance(paths)
    [latest] = instance.get_run_records(limit=1)
    assert latest.dagster_run.status == dg.DagsterRunStatus.SUCCESS and STOPPED_TAG in latest.dagster_run.tags
    assert "stopped on purpose" in resume_decision(instance).skip_message


@pytest.mark.slow  # a whole pipeline or subprocesses
def test_auto_resume_with_auto_resume_off_only_reports_and_exits(make_project):
    """`output.auto_resume: false`: `--auto-resume` reports what is unfinished and exits 0, with no
    run created and no daemon or webserver left behind (it used to start dagster-daemon anyway)."""
    from gguf_assets.lib.project.settings import load_settings, replace, write_project_file

    paths = make_project(steps=5, mock_teacher=True)
    write_project_file(paths.root, replace(load_settings(paths.root), output={"auto_resume": False}))
    done = subprocess.run([*CLI, "--auto-resume", str(paths.root), "--ui-port", str(free_port())],
                          capture_output=True, text=True, env=cli_env(), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "output.auto_resume is false" in done.stdout and "only reporting what is unfinished" in done.stdout
    assert "materials    missing" in done.stdout, done.stdout
    assert "starting dagster-daemon" not in done.stdout and "Dagster UI" not in done.stdout
    assert project_instance(paths).get_run_records() == []


@pytest.mark.slow  # `--auto-resume` with its daemon (about 20 s)
def test_sigterm_to_the_daemon_is_a_clean_stop(finished_project, tmp_path):
    """systemd (or a user) sends SIGTERM to dagster-daemon alone: it stops without a traceback, and
    `--auto-resume` says which service stopped and how, stops the rest and leaves nothing running."""
    import psutil

    paths = copy_project(finished_project[0], tmp_path / "copy")
    proc = subprocess.Popen([*CLI, "--auto-resume", str(paths.root)], env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        def daemon():
            return next((c for c in psutil.Process(proc.pid).children(recursive=True)
                         if "dagster-daemon" in " ".join(_cmdline(c))), None)

        wait_for(lambda: daemon() is not None, timeout=300, what="the daemon", proc=proc)
        the_daemon = daemon()
        # Once its sensor daemon has beaten (it has asked the project's code server): a stop now has threads to end.
        instance = project_instance(paths)
        wait_for(lambda: "SENSOR" in instance.get_daemon_heartbeats(), timeout=120, what="the daemon's sensors",
                 proc=proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        the_daemon.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "grpc" not in out.lower(), out
    assert "dagster-daemon stopped (by SIGTERM" in out or "dagster-daemon stopped (exit code 0)" in out, out
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"left running: {[_cmdline(c) for c in alive]}"


@pytest.mark.slow  # a real `auto-resume`, held while its pipeline's process loads
def test_sigterm_while_the_pipeline_loads_stops_auto_resume_without_starting_the_daemon(make_project, tmp_path):
    """#58: a SIGTERM to the process group of `auto-resume` just after it started the pipeline's process (in a group
    of its own, which it forwards stops to) kills that process while it loads, before it handles a stop: no
    "stopped" line, no code of its own. `auto-resume` took that for a finished pipeline, started the daemon and ran
    on (seen 85 minutes later; a second SIGTERM stopped both). The process is held at that moment (fault point
    pipeline-load); `auto-resume` must end within seconds, start no daemon and leave nothing running."""
    import psutil

    paths = make_project()
    reached = tmp_path / "reached"
    reached.mkdir()
    env = cli_env(GGUF_ASSETS_FAULT="pipeline-load:stall:300", GGUF_ASSETS_FAULT_REACHED=str(reached))
    proc = subprocess.Popen([*CLI, "auto-resume", str(paths.root)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: any(reached.iterdir()), timeout=180, what="the pipeline's process to load", proc=proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopped (SIGTERM)" in out and "starting dagster-daemon" not in out, out
    assert "Traceback" not in out, out
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"left running: {[_cmdline(c) for c in alive]}"


def test_sigterm_while_the_pipeline_loads_stops_run_with_one_line_and_its_code(make_project, tmp_path):
    """The same moment for a plain `gguf-trainer run`: its pipeline process dies of the SIGTERM before it handles a
    stop. `run` says so in one line and exits 128 + SIGTERM (it passed the child's -15 on as exit status 241, with
    nothing said)."""
    paths = make_project()
    reached = tmp_path / "reached"
    reached.mkdir()
    env = cli_env(GGUF_ASSETS_FAULT="pipeline-load:stall:300", GGUF_ASSETS_FAULT_REACHED=str(reached))
    proc = subprocess.Popen([*CLI, "run", str(paths.root)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: any(reached.iterdir()), timeout=180, what="the pipeline's process to load", proc=proc)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopped (SIGTERM) while the pipeline was loading" in out and "Traceback" not in out, out
