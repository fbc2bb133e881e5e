"""Dagster is the orchestrator: every entry point survives a crash, and the daemon resumes by itself.

These run the real console script, the real Dagster CLI and the real dagster-daemon on a demo
project (mock teacher, about 20 s a pipeline), as a user would after a kill -9 or a reboot.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import dagster as dg
import psutil
import pytest
from conftest import (
    CLI,
    FAULT_SETTINGS,
    assert_clean_console,
    cli_env,
    copy_project,
    pipeline_outputs,
    project_instance,
    unwrapped,
    wait_for,
)
from warm_runs import trainer_popen, trainer_run

from gguf_assets.pipeline.run_tags import PID_TAG

pytestmark = pytest.mark.slow


def _instance(paths) -> dg.DagsterInstance:
    return project_instance(paths)


def _start_run(paths, command=("run",), *, warm: bool = False, **env) -> subprocess.Popen:
    """``command`` on the project in a session of its own; ``warm``: a warm `run` (warm_runs.py), for a test that is
    not about `gguf-trainer run`'s parent process."""
    return trainer_popen([*command, str(paths.root)], warm=warm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=cli_env(**env), start_new_session=True)


def _kill9_during_training(paths, *, refuse_second: bool = False) -> None:
    """`gguf-trainer run`, killed with its whole process group once training has saved two checkpoints.

    Training stalls after step 11, so the kill lands inside it however slow the machine (a loaded one could
    otherwise finish the 40 steps while the second pipeline is being refused)."""
    # The refusal names the cold run's child as the holder: that one needs the parent.
    proc = _start_run(paths, warm=not refuse_second, GGUF_ASSETS_FAULT="train-step@11:stall:120")
    try:
        wait_for(lambda: any(paths.root.glob("checkpoints/*/step-00000010")), timeout=240,
                 what="the second checkpoint", proc=proc)
        if refuse_second:  # one pipeline per folder: a second one is refused and names the holder
            second = trainer_run(["run", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=120)
            assert second.returncode != 0
            assert "in use by another pipeline" in second.stderr
            # The holder is the process that executes the pipeline: `gguf-trainer run`'s own child.
            holder = int(re.search(r"\(pid (\d+)", second.stderr).group(1))
            assert holder in {c.pid for c in psutil.Process(proc.pid).children()}, second.stderr
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _status(paths) -> dict[str, str]:
    from gguf_assets.lib.project.settings import load_settings
    from gguf_assets.lib.status.states import project_status

    return {s.stage: s.state for s in project_status(paths, load_settings(paths.root))}


def _runs(paths, *statuses) -> list:
    return [r.dagster_run for r in _instance(paths).get_run_records(filters=dg.RunsFilter(statuses=list(statuses)))]


def test_sigterm_then_kill9_then_a_plain_run_is_byte_identical(make_project, reference_run):
    """SIGTERM during the shards stops `--auto-resume` (which runs the pipeline, then would start the
    daemon) within 10 s, daemon not started; a kill -9 during training leaves a STARTED run behind;
    a plain `gguf-trainer run` (no --auto-resume) then finishes, bit-identical."""
    paths = make_project(**FAULT_SETTINGS)
    proc = _start_run(paths, command=("--auto-resume",))
    wait_for(lambda: (paths.root / "shards/train/00001/student.json").is_file(), timeout=240,
              what="the second train shard", proc=proc)
    asked = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    stopped_s = time.monotonic() - asked
    print(f"SIGTERM to exit: {stopped_s:.1f} s")
    assert stopped_s < 10 and proc.returncode == 130, out
    assert "dagster-daemon" not in out, "a stop during the pipeline must not go on to start the daemon"
    assert "continues from there" in out.splitlines()[-1] or "continues from there" in out
    assert not _runs(paths, dg.DagsterRunStatus.STARTED), "a stopped run must not stay STARTED"
    # Stopped on purpose: resumable, but the daemon leaves it until the user asks.
    from gguf_assets.pipeline.resume import resume_decision

    assert "stopped on purpose" in resume_decision(_instance(paths)).skip_message

    _kill9_during_training(paths, refuse_second=True)
    assert not any(paths.root.glob("checkpoints/*/final"))
    assert len(_runs(paths, dg.DagsterRunStatus.STARTED)) == 1, "Dagster leaves a killed run STARTED"

    started = time.monotonic()
    done = trainer_run(["run", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=600)
    print(f"plain run after the kill: {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_clean_console(done.stdout + done.stderr)
    from gguf_assets.lib.core.commands import trainer

    # A command that works when pasted: the venv's gguf-trainer, not the bare name.
    assert done.stdout.strip().splitlines()[-1] == f"open the UI (runs, metrics, report): {trainer('ui', paths.root)}"
    assert "marked 1 run(s) cut off" in done.stdout
    assert "resuming training run" in done.stdout + done.stderr
    assert not _runs(paths, dg.DagsterRunStatus.STARTED)
    assert pipeline_outputs(paths.root) == reference_run[0]


def test_daemon_alone_resumes_a_killed_pipeline_and_its_runs_are_never_reaped_alive(shards_done_project,
                                                                                      reference_run):
    """Only `dagster-daemon run`, started the documented way, after a kill -9 during training: the
    interrupted-runs sensor (every 2 s here) fails the dead run, the resume sensor launches the
    rest as a multi-step run in its own process, and that live run gets no failure event."""
    paths = shards_done_project
    earlier = {r.dagster_run.run_id for r in _instance(paths).get_run_records()}  # the finished project's own
    _kill9_during_training(paths)
    cut_off = _runs(paths, dg.DagsterRunStatus.STARTED)[0].run_id

    exports = trainer_run(["env", str(paths.root)], capture_output=True, text=True, env=cli_env(), check=True)
    env = cli_env(GGUF_ASSETS_SENSOR_INTERVAL_S="2")
    for line in exports.stdout.splitlines():  # export NAME=VALUE (shell-quoted; no spaces in test paths)
        name, value = line.removeprefix("export ").split("=", 1)
        env[name] = value.strip("'")
    start = time.monotonic()
    daemon = subprocess.Popen([str(Path(CLI[0]).parent / "dagster-daemon"), "run", "-m", "gguf_assets.definitions"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        wait_for(lambda: set(_status(paths).values()) == {"current"}, timeout=400, what="all current", proc=daemon)
        print(f"daemon start to all-current: {time.monotonic() - start:.1f} s")

        def resumed_run_ended() -> bool:  # the files are current before its last events (SUCCESS) are written
            return any(r.dagster_run.is_finished for r in _instance(paths).get_run_records()
                       if r.dagster_run.run_id not in {cut_off, *earlier}
                       and r.dagster_run.job_name == "train_export_evaluate")

        wait_for(resumed_run_ended, timeout=60, what="the resumed run to end", proc=daemon)
        # Let the reaper tick a few more times over the finished instance.
        time.sleep(5)
    finally:
        os.killpg(daemon.pid, signal.SIGINT)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
    instance = _instance(paths)
    assert instance.get_run_by_id(cut_off).status == dg.DagsterRunStatus.FAILURE
    resumed = [r.dagster_run for r in instance.get_run_records() if r.dagster_run.run_id not in {cut_off, *earlier}
               and r.dagster_run.job_name == "train_export_evaluate"]
    assert len(resumed) == 1 and resumed[0].status == dg.DagsterRunStatus.SUCCESS
    assert resumed[0].tags[PID_TAG] != str(daemon.pid)  # its own run worker process
    assert not instance.all_logs(resumed[0].run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
    assert {s for s in ("adapter", "gguf", "eval_report")} <= {
        e.dagster_event.asset_key.to_user_string() for e in
        instance.all_logs(resumed[0].run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION)}
    assert pipeline_outputs(paths.root) == reference_run[0]


def test_the_daemon_leaves_work_made_stale_by_a_settings_edit_alone(make_project, finished_project, tmp_path):
    """After an edit of project.yaml, the resume sensor says why it waits instead of retraining."""
    from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
    from gguf_assets.pipeline.resume import resume_decision

    # A new project is the user's to start (its first run may download a 30 GB teacher).
    assert "nothing has run in this project yet" in resume_decision(project_instance(make_project())).skip_message
    paths = copy_project(finished_project[0], tmp_path / "finished")
    instance = project_instance(paths)
    assert "everything is current" in resume_decision(instance).skip_message
    finished = load_settings(paths.root)
    # A raised step count is new work (hours of GPU time, perhaps from a half-typed value in an editor), not an
    # interrupted run: it waits for Run, though the adapter is "partial" and nothing is replaced.
    write_project_file(paths.root, replace(finished, training={"steps": finished.training.steps * 2}))
    decision = resume_decision(instance)
    assert isinstance(decision, dg.SkipReason), decision
    assert "after a settings edit (adapter partial: training.steps" in decision.skip_message, decision.skip_message
    write_project_file(paths.root, replace(finished, training={"learning_rate": 1e-4}))
    decision = resume_decision(instance)
    assert isinstance(decision, dg.SkipReason) and "after a settings edit (adapter stale: training.learning_rate" \
        in decision.skip_message, decision.skip_message
    # A missing output is different: the daemon makes it by itself.
    shutil.rmtree(paths.root / "shards" / "val")
    write_project_file(paths.root, replace(load_settings(paths.root), training={"learning_rate": 2e-4}))
    decision = resume_decision(instance)
    assert isinstance(decision, dg.RunRequest) and decision.job_name == "precompute_val_shards"


def test_a_copied_project_is_independent_of_its_original(finished_project, tmp_path):
    """`cp -a` a finished project: nothing in the copy names the original, and running, editing or
    deleting in the copy never reads or writes the original."""
    original = copy_project(finished_project[0], tmp_path / "original")  # the suite's reference stays untouched
    copy_root = original.root.parent / "copy"
    subprocess.run(["cp", "-a", str(original.root), str(copy_root)], check=True)
    from gguf_assets.lib.project.layout import ProjectPaths

    copy = ProjectPaths.of(copy_root)
    for file in [*copy_root.rglob("*.json"), *copy_root.rglob("*.yaml"), *copy_root.rglob("*.md")]:
        assert str(original.root) not in file.read_text(encoding="utf-8"), file

    env = cli_env(DAGSTER_HOME=str(copy.dagster_home))
    info = subprocess.run([str(Path(CLI[0]).parent / "dagster"), "instance", "info"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert info.returncode == 0, info.stderr
    assert str(copy.dagster_home) in info.stdout and str(original.dagster_home) not in info.stdout

    before = {str(p): p.stat().st_mtime_ns for p in original.root.rglob("*") if p.is_file()}
    # The copy's student weights rewritten with the same bytes and a new mtime: the content
    # settles it (lib/verify), so nothing is redone.
    student = next(copy_root.glob("materials/demo/student/*.safetensors"))
    student.write_bytes(student.read_bytes())
    os.utime(student, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert set(_status(copy).values()) == {"current"}
    # A real edit of the copy's student weights, and its GGUF deleted: the copy sees both, the original neither.
    weights = student.read_bytes()
    data = bytearray(weights)
    data[-1] ^= 0x01  # a weight's last byte: still a loadable file
    student.write_bytes(bytes(data))
    (copy_root / "output" / "demo-adapter.gguf").unlink()
    status = subprocess.run([*CLI, "status", str(copy_root)], capture_output=True, text=True, env=cli_env())
    assert "materials    stale" in status.stdout, status.stdout
    assert set(_status(original).values()) == {"current"}
    # The edit undone (the content settles it again), a run in the copy exports the GGUF again into the copy: the
    # whole pipeline redone from a new student would prove nothing more about where the copy writes.
    student.write_bytes(weights)
    done = trainer_run(["run", str(copy_root)], capture_output=True, text=True, env=cli_env(), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"GGUF:    {copy_root}/output/demo-adapter.gguf" in done.stdout
    assert (copy_root / "output" / "demo-adapter.gguf").is_file()
    after = {str(p): p.stat().st_mtime_ns for p in original.root.rglob("*") if p.is_file()}
    assert after == before, "the copy wrote into the original"


def test_the_documented_dagster_cli_commands_work(finished_project, tmp_path, monkeypatch):
    """docs/dagster.md's Dagster CLI commands: `eval "$(gguf-trainer env DIR)"`, then `dagster asset materialize`
    of one asset and of one shard partition, as named jobs' runs on the project's own instance."""
    from gguf_assets.lib.core import atomic

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # restored after the test; _instance re-points it
    paths = copy_project(finished_project[0], tmp_path / "project")
    shard = paths.root / "shards" / "train" / "00001"
    original = {f.name: f.read_bytes() for f in shard.glob("*.safetensors")}
    shutil.rmtree(shard)
    (paths.root / "output" / "report.json").unlink()
    dagster = Path(CLI[0]).parent / "dagster"
    script = f"""set -e
        eval "$({' '.join(CLI)} env {paths.root})"
        {dagster} asset materialize -m gguf_assets.definitions --select train_shards --partition 00001
        {dagster} asset materialize -m gguf_assets.definitions --select eval_report
        {dagster} job execute -m gguf_assets.definitions -j train_export_evaluate
    """
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=cli_env(), timeout=600,
                          cwd="/")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {f.name: f.read_bytes() for f in shard.glob("*.safetensors")} == original
    assert atomic.read_json(paths.root / "output" / "report.json")["gguf_sha256"]
    assert set(_status(paths).values()) == {"current"}
    runs = _instance(paths).get_run_records()
    assert runs[0].dagster_run.job_name == "train_export_evaluate"
    assert [r.dagster_run.status for r in runs[:3]] == [dg.DagsterRunStatus.SUCCESS] * 3
    assert json.dumps(runs[0].dagster_run.run_config).find(str(paths.root)) == -1  # no path in run storage


def test_an_edit_during_training_affects_only_the_next_run(shards_done_project):
    """One settings snapshot per run: `learning_rate` doubled and `adapter_name → edited` written at a checkpoint
    mid-training. The run trains its 40 steps at the rate it started with and exports under the name it started
    with; the console says the edit is for the next run, and status names the edit as the reason. (training.steps
    is the one setting a run follows while it trains: lowered to its step or below, the run ends there, #57;
    cli/test_snapshots.py.)"""
    from gguf_assets.lib.project.settings import load_settings, replace, write_project_file
    from gguf_assets.lib.status.states import project_status

    paths = shards_done_project
    started = load_settings(paths.root)
    name, rate = started.output.adapter_name, started.training.learning_rate
    proc = _start_run(paths, warm=True)
    try:
        wait_for(lambda: any(paths.root.glob("checkpoints/*/step-00000010")), timeout=240,
                 what="the second checkpoint", proc=proc)
        write_project_file(paths.root, replace(started, training={"learning_rate": rate * 2},
                                               output={"adapter_name": "edited"}))
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    assert_clean_console(out)
    change = f"training.learning_rate {rate!r} → {rate * 2!r}"
    assert "project.yaml changed during the run (" in out and change in out, out
    assert "still not current" not in out
    final = json.loads(next(paths.root.glob("checkpoints/*/final/meta.json")).read_text())
    assert final["step"] == 40 and final["training"]["learning_rate"] == rate
    assert (paths.root / "output" / f"{name}.gguf").is_file() and not (paths.root / "output" / "edited.gguf").exists()
    report = json.loads((paths.root / "output" / f"{name}.report.json").read_text())
    assert report["settings_hash"] == json.loads(paths.adapter_manifest.read_text())["settings_hash"]
    status = {s.stage: s for s in project_status(paths, load_settings(paths.root))}
    assert status["adapter"].state == "stale" and change in status["adapter"].detail, status
    assert re.search(rf"adapter +stale +{re.escape(change)}", out), out  # the closing status says it too


def _latest_step(paths) -> int:
    from gguf_assets.lib.project.layout import STEP_DIR

    return max((int(m.group(1)) for d in paths.root.glob("checkpoints/*/step-*") if (m := STEP_DIR.match(d.name))),
               default=0)


def test_terminate_in_the_ui_and_ctrl_c_stop_a_cli_run_canceled_and_resumable(shards_done_project, reference_run):
    """Terminate (what the UI's button calls: the run launcher's terminate, which cannot reach an
    in-process run) stops a `gguf-trainer run` within 10 s; so does a Ctrl-C to the terminal's whole
    process group. Each run ends CANCELED, never FAILURE, with no traceback and a "stopped" line that
    says where; the next run finishes byte-identical to an uninterrupted one."""
    paths = shards_done_project
    # Training stalls after step 11 (one step past a checkpoint), so each stop lands mid-training.
    proc = _start_run(paths, warm=True, GGUF_ASSETS_FAULT="train-step@11:stall:120")
    wait_for(lambda: _latest_step(paths) >= 10, timeout=240, what="the second checkpoint", proc=proc)
    instance = _instance(paths)
    (running,) = _runs(paths, dg.DagsterRunStatus.STARTED)
    # While it trains, status says so, with the run.
    status = "\n".join(unwrapped(subprocess.run([*CLI, "status", str(paths.root)], capture_output=True, text=True,
                                                 env=cli_env(), timeout=60, check=True).stdout))  # 80 columns
    assert re.search(rf"adapter +running +run {running.run_id[:8]} of train_export_evaluate; was partial: trained "
                     r"to step 10 of 40", status), status
    asked = time.monotonic()
    instance.run_launcher.terminate(running.run_id)
    out, _ = proc.communicate(timeout=60)
    print(f"Terminate to exit: {time.monotonic() - asked:.1f} s")
    assert time.monotonic() - asked < 10 and proc.returncode == 130, out
    assert_clean_console(out)
    assert instance.get_run_by_id(running.run_id).status == dg.DagsterRunStatus.CANCELED
    assert "stopped during adapter training, at the checkpoint of step 10 of 40" in out, out

    # Resumes training from that checkpoint (step 10), stalls after step 16; Ctrl-C it there (cold: the Ctrl-C
    # reaches `gguf-trainer run`'s parent process too).
    proc = _start_run(paths, GGUF_ASSETS_FAULT="train-step@6:stall:120")
    reached = _latest_step(paths)
    wait_for(lambda: _latest_step(paths) > reached, timeout=240, what="a later checkpoint", proc=proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert_clean_console(out)  # no KeyboardInterrupt traceback from Dagster's helper processes
    assert "stopped during adapter training, at the checkpoint of step 15 of 40" in out, out
    statuses = [r.status for r in _runs(paths, dg.DagsterRunStatus.CANCELED, dg.DagsterRunStatus.FAILURE)]
    assert statuses == [dg.DagsterRunStatus.CANCELED] * 2, statuses

    done = trainer_run(["run", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pipeline_outputs(paths.root) == reference_run[0]
