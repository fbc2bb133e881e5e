"""What the user reads on the console: short lines, no library noise, one clear message per error."""

import re
import subprocess

import dagster as dg
from conftest import CLI, cli_env, project_instance

ANSI = re.compile(r"\x1b\[")


def assert_clean_console(out: str) -> None:
    """No stack trace, no library load report or progress bar, no colour codes, no doubled line."""
    assert "Traceback" not in out and "LOAD REPORT" not in out and "Loading weights" not in out, out
    assert not ANSI.search(out), out
    lines = [line for line in out.splitlines() if line.strip()]
    doubled = [a for a, b in zip(lines, lines[1:]) if a.split(" ", 1)[-1] == b.split(" ", 1)[-1]]
    assert not doubled, doubled


def test_a_user_error_in_a_step_is_one_message_with_where_the_full_log_is(make_project):
    paths = make_project(steps=5, mock_teacher=True, materials={"student": "materials/demo/no-such-student"})
    done = subprocess.run([*CLI, "run", str(paths.root)], capture_output=True, text=True, env=cli_env(), timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert_clean_console(out)
    last = done.stderr.strip().splitlines()
    assert last[-2].startswith("pipeline failed at materials: materials.student = 'materials/demo/no-such-student'")
    assert "MaterialsError" not in out  # the message names the fix; its type is for the log
    assert f"gguf-trainer ui {paths.root}" in last[-1]
    # The console line of the step is short: time, step, message.
    assert re.search(r"^\d\d:\d\d:\d\d materials +failed: materials.student", done.stderr, re.M), done.stderr
    # The stack trace is kept in the run's event log.
    instance = project_instance(paths)
    run = instance.get_run_records(limit=1)[0].dagster_run
    failure = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE)[0]
    assert "Traceback" in failure.dagster_event.event_specific_data.error.to_string() or \
        failure.dagster_event.event_specific_data.error.stack
    assert run.job_name == "materials_and_corpus"
