"""The studio page that `gguf-trainer ui` serves beside Dagster, in headless Chromium (Debian's package).

On a finished project: the page shows every stage current, the verdict, the exported files and the
evaluation from the report, the machine and its libraries; `training.steps` changed in the settings form
is saved into project.yaml (comments kept) and shows up with the key old → new (the one staleness engine):
raised after a finished run, the run goes on from its last step (#57); Run starts the named Dagster job the
CLI runs and the progress bar moves with the trainer's log steps; Stop ends that run CANCELED within seconds,
resumable; Run again trains to the end from the checkpoint, and the new verdict and ggk command are read and
copied; the Runs panel lists both runs with their scores and settings diff, "Use" puts the first back (its
GGUF bytes again, nothing retrained) and Delete removes the second, saying what it freed. One pipeline run to
the end. The walk runs at 1,400 px wide; each step is also shot at 390 px (a phone). Screenshots go to
test-artifacts/studio-*.png.
"""

import re
import subprocess
import time
from importlib import metadata

import dagster as dg
import psutil
import pytest
from browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, WIDE, need_browser, shoot_both_widths
from conftest import CLI, cli_env, copy_project, free_port, project_instance, stop_with_ctrl_c, wait_for, wait_http

from gguf_assets.lib.core import atomic
from gguf_assets.lib.output.report import score_rows
from gguf_assets.lib.project.manifests import Report
from gguf_assets.orchestration.instance import instance_env

pytestmark = pytest.mark.slow  # a UI, a browser and a pipeline run

# Raising training.steps from 40 to 60 goes on from the finished run's step 40 (#57). The runs the studio starts
# stall after their 11th optimizer step (faults.py counts per process), step 51, so Stop lands at the step-50
# checkpoint; the run that resumes from it has 10 steps left and never reaches an 11th.
STALL_AFTER_50 = "train-step@11:stall:300"  # Stop ends it; long enough that nothing else can


def _rows(page) -> dict[str, tuple[str, str]]:
    """The Pipeline table as {stage: (state, why)}."""
    rows = {}
    for row in page.locator("#stages tr").all():
        cells = row.locator("td").all_inner_texts()
        rows[row.get_attribute("data-stage")] = (cells[1], cells[2])
    return rows


def _cells(page, selector: str) -> list[list[str]]:
    return [row.locator("td").all_inner_texts() for row in page.locator(f"{selector} tr").all()]


def _training_now(page) -> tuple[str, float]:
    """The training line and its bar's percent, read at once: the page sets both in one update."""
    text, width = page.evaluate('() => [document.getElementById("training").textContent, '
                                'document.getElementById("progress-bar").style.width]')
    return text, float(width.rstrip("%"))


def _shot(page, panel: str, name: str) -> None:
    page.locator(panel).screenshot(path=str(ARTIFACTS / f"studio-{name}.png"))


def _code_servers(ui: subprocess.Popen) -> list[int]:
    """The pids of the Dagster code servers (`dagster api grpc`) that `ui` started."""
    return sorted(child.pid for child in psutil.Process(ui.pid).children(recursive=True)
                  if "grpc" in child.cmdline())


def _resume_ticks(instance: dg.DagsterInstance, *, since: float) -> list:
    """The resume sensor's ticks since ``since`` (a time.time()), once each has ended."""
    return [tick for state in instance.all_instigator_state() if state.instigator_name == "resume_pipeline_sensor"
            for tick in instance.get_ticks(state.instigator_origin_id, state.selector_id, after=since)
            if tick.status.value != "STARTED"]


def _run_row(page, run: dict):
    return page.locator(f'#runs-table tr[data-run="{run["name"]}"]')


def test_studio_edits_settings_in_its_form_runs_stops_resumes_and_shows_the_result(finished_project, tmp_path,
                                                                                     monkeypatch):
    need_browser()
    from playwright.sync_api import sync_playwright

    paths = copy_project(finished_project[0], tmp_path / "copy")
    for name, value in instance_env(paths).items():  # restored after the test
        monkeypatch.setenv(name, value)
    instance = project_instance(paths)
    report = atomic.read_json(paths.root / "output" / "demo-adapter.report.json")
    first_gguf = (paths.root / "output" / "demo-adapter.gguf").read_bytes()
    port, studio_port = free_port(), free_port()
    console = tmp_path / "ui.log"  # a file, not a pipe: nobody reads a pipe while the browser works
    with open(console, "w") as out:
        ui = subprocess.Popen([*CLI, "ui", str(paths.root), "--port", str(port), "--studio-port", str(studio_port),
                               "--no-tensorboard"], stdout=out, stderr=subprocess.STDOUT, text=True,
                              env=cli_env(GGUF_ASSETS_FAULT=STALL_AFTER_50, GGUF_ASSETS_SENSOR_INTERVAL_S="3"))
    studio = f"http://127.0.0.1:{studio_port}"
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        wait_for(lambda: console.read_text().strip(), timeout=60, what="the UI's first line", proc=ui)
        first = console.read_text().splitlines()[0]
        assert first == f"Studio for {paths.root} on {studio}", first  # its URL first
        wait_http(studio + "/api/status", timeout=60, proc=ui)
        wait_http(f"http://127.0.0.1:{port}/server_info", timeout=120, proc=ui)
        code_servers = _code_servers(ui)
        assert len(code_servers) == 1, code_servers  # the webserver's and the daemon's one
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            context = browser.new_context(viewport=WIDE,
                                          permissions=["clipboard-read", "clipboard-write"])
            page = context.new_page()
            page.goto(studio)
            page.click("#open-all")  # every panel and settings group (below the first screen, most start folded)
            assert {state for state, _ in _rows(page).values()} == {"current"} and len(_rows(page)) == 7
            assert page.locator("#verdict").inner_text() == report["verdict"]
            assert page.locator("#gguf-path").inner_text() == str(paths.located(report["gguf_path"]))
            assert page.locator("#score").inner_text() == f"{report['val_centred_cosine']:.4f}"
            assert _training_now(page) == ("training: finished: 40/40 steps", 100.0), _training_now(page)
            _shot(page, "#panel-project", "project")
            # The memory estimate, before anything loads (this project's teacher is the mock one: none loads).
            memory = {row.get_attribute("data-part"): row.locator("td").all_inner_texts()
                      for row in page.locator("#memory tr").all()}
            assert memory["teacher"][1] == "0.0 MiB" and memory["student"][1].endswith("MiB"), memory
            assert "parameters" in memory["adapter training"][2] and "peak" in memory
            # Exported files and the evaluation, as the report records them.
            assert _cells(page, "#files") == [[str(paths.located(f["path"])), f["role"], f"{f['bytes'] / 1024:.1f} KiB",
                                               f["sha256"]] for f in report["files"]]
            assert [row[0] for row in _cells(page, "#per-shard")] == [s["shard"] for s in report["per_shard"]]
            assert _cells(page, "#worst")[0] == [f"{report['worst'][0]['cosine']:.4f}", report["worst"][0]["text"]]
            # Every score of the report (the other scores and the GGUF against the checkpoint), as report.md has them.
            assert [tuple(row) for row in _cells(page, "#evaluation")] == score_rows(Report.from_json(report))
            _shot(page, "#panel-files", "exported-files")
            _shot(page, "#panel-evaluation", "evaluation")
            # Hardware and Environment: this machine and the libraries the pipeline runs with; live CPU and RAM.
            environment = dict(_cells(page, "#environment"))
            assert environment["torch"] == metadata.version("torch") and environment["dagster"] == dg.__version__
            live = {row.get_attribute("data-part"): row.locator("td").all_inner_texts()
                    for row in page.locator("#hardware-now tr").all()}
            assert live["cpu"][1].endswith("%") and re.fullmatch(r"[\d.]+ / [\d.]+ GiB", live["ram"][1]), live
            assert page.locator('#hardware-now tr[data-part="ram"] svg polyline').count() == 1  # its sparkline
            _shot(page, "#panel-machine", "hardware-environment")
            _shot(page, "#panel-hardware-now", "live-hardware-and-memory")

            # The advanced view edits project.yaml as text: a typo is refused with the file's line and the fix.
            before = paths.project_file.read_text()
            page.click("#advanced summary")
            assert page.locator("#settings").input_value() == before
            page.fill("#settings", before.replace("  steps: 40", "  stepz: 40"))
            page.click("#save")
            wait_for(lambda: page.locator("#settings-message").inner_text(), timeout=10, what="the save's answer")
            refusal = page.locator("#settings-message").inner_text()
            assert "project.yaml:" in refusal and "stepz" in refusal and "steps" in refusal, refusal
            assert paths.project_file.read_text() == before

            # The settings form: a preset fills in its keys only, until Save.
            steps = page.locator('[data-key="training.steps"]')
            validate_every = page.locator('[data-key="training.validate_every"]')
            assert steps.input_value() == "40" and page.locator('[data-key="precompute.mock_teacher"]').is_checked()
            page.select_option("#preset", "first look")
            page.click("#apply-preset")
            wait_for(lambda: steps.input_value() == "2000", timeout=10, what="the preset in the form")
            assert validate_every.input_value() == "250" and paths.project_file.read_text() == before
            # A value out of bounds is refused on its field, in the CLI's words; nothing is sent or written.
            steps.fill("0")
            page.click("#save-form")
            assert steps.get_attribute("aria-invalid") == "true"
            assert page.locator('[id="error-training.steps"]').inner_text() == "must be >= 1"
            assert page.locator("#form-message").inner_text() == "not saved: training.steps = '0' must be >= 1"
            assert paths.project_file.read_text() == before
            # A rule across keys is refused as the CLI refuses it: file:line, key, the rule; nothing written.
            steps.fill("60")
            heads = page.locator('[data-key="training.heads"]')
            heads.fill("7")
            page.click("#save-form")
            wait_for(lambda: page.locator("#form-message").inner_text().startswith(f"{paths.project_file}:"),
                     timeout=10, what="the form's answer")
            line = before.splitlines().index("  heads: 0") + 1
            refusal = page.locator("#form-message").inner_text()
            assert refusal == (f"{paths.project_file}:{line}: training.heads is 7, but ggk runs heads of 64, so width "
                               "64 has 1; remove the key (or set 0)"), refusal
            assert heads.get_attribute("aria-invalid") == "true" and paths.project_file.read_text() == before
            heads.fill("0")  # back to the file's value: not a change
            validate_every.fill("20")  # back to the file's value: not a change
            page.click("#save-form")
            wait_for(lambda: page.locator("#form-message").inner_text().startswith("saved"), timeout=10,
                     what="the save")
            assert page.locator("#form-message").inner_text() == "saved: training.steps 40 → 60"
            after = paths.project_file.read_text()
            assert after == before.replace("  steps: 40\n", "  steps: 60\n")  # one line, in place, comments kept
            _shot(page, "#panel-settings", "settings-form")
            # The page says what the change does and why, as `status` does: the finished run goes on from step 40.
            wait_for(lambda: _rows(page)["adapter"][0] == "partial", timeout=30, what="the adapter to show partial")
            assert "training.steps 40 → 60: goes on from step 40 to 60" in _rows(page)["adapter"][1]
            assert _rows(page)["gguf"] == ("blocked", "waits for adapter")
            # The result shown was made under the old settings, and the page says so; and what Run will do.
            wait_for(lambda: page.locator("#result-outdated").is_visible(), timeout=30, what="the outdated mark")
            assert "training.steps 40 → 60" in page.locator("#result-outdated").inner_text()
            assert page.locator("#run-preview").inner_text() == \
                "Run starts at Adapter (training) (partial) and resumes training from step 40 of 60"
            assert page.locator("#run").is_enabled() and page.locator("#stop").is_disabled()
            # The daemon runs beside the studio: a raised step count is new work (perhaps a half-typed value), not
            # an interrupted run, and it waits for Run (it once started training within 30 s). Its resume sensor
            # ticks every 3 s here: two ticks after the save, each saying why it waits, and no run.
            saved = time.time()
            wait_for(lambda: len(_resume_ticks(instance, since=saved)) >= 2, timeout=60, what="two sensor ticks")
            ticks = _resume_ticks(instance, since=saved)
            assert all(tick.status.value == "SKIPPED" and "waits after a settings edit (adapter partial: "
                       "training.steps 40 → 60" in tick.skip_reason for tick in ticks), ticks
            assert not [r for r in instance.get_runs() if r.status != dg.DagsterRunStatus.SUCCESS]

            page.click("#run")
            wait_for(lambda: _rows(page)["adapter"][0] == "running", timeout=180, what="the run to train")
            assert page.locator("#run").is_disabled() and page.locator("#stop").is_enabled()  # while it runs
            (running,) = [r for r in instance.get_runs() if r.status == dg.DagsterRunStatus.STARTED]
            assert running.job_name == "train_export_evaluate"  # the named job `gguf-trainer run` runs
            assert running.run_id[:8] in page.locator("#message").inner_text()
            assert page.locator("#run-link").get_attribute("href") == f"http://127.0.0.1:{port}/runs/{running.run_id}"
            # The live training line and bar: the run's latest log step (log_every 10), as on the console. The page
            # polls every 2 s, so it may skip log steps (10 tiny steps can take less than a poll); the stall holds
            # step 50 on it. Each line seen, with the bar beside it, read together from one poll's update.
            seen: list[tuple[int, float]] = []

            def at_step_50() -> bool:
                text, percent = _training_now(page)
                if match := re.match(r"training: step (\d+)/60, loss ", text):
                    seen.append((int(match[1]), percent))
                return bool(match) and match[1] == "50"

            wait_for(at_step_50, timeout=180, what="the step-50 log step on the page")
            assert all(percent == round(100 * step / 60, 2) for step, percent in seen), seen  # the bar is the step's
            assert [step for step, _ in seen] == sorted(step for step, _ in seen) and seen[-1] == (50, 83.33), seen
            assert re.search(r", [\d.]+ steps/s, ETA \d+(m\d\d)?s$", page.locator("#training").inner_text())
            assert page.locator("#curves svg polyline").count() >= 2  # loss and val curves against the step
            _shot(page, "#panel-training", "training-live")
            # Training stalls after its step-50 checkpoint: stop it there.
            wait_for(lambda: any(paths.root.glob("checkpoints/*/step-00000050")), timeout=60,
                     what="the new run's step-50 checkpoint")
            asked = time.monotonic()
            page.click("#stop")
            wait_for(lambda: instance.get_run_by_id(running.run_id).status == dg.DagsterRunStatus.CANCELED,
                     timeout=30, what="the run to end CANCELED")
            stopped_s = time.monotonic() - asked
            wait_for(lambda: _rows(page)["adapter"][0] == "partial", timeout=30, what="the page to show partial")
            assert "trained to step 50 of 60" in _rows(page)["adapter"][1]
            wait_for(lambda: page.locator("#training").inner_text().startswith("training: stopped at step 50/60"),
                     timeout=30, what="the training line to say where it stopped")
            # Where it stopped, and that Run continues from there.
            wait_for(lambda: "stopped" in page.locator("#last-run-state").inner_text(), timeout=30,
                     what="the last run to show stopped")
            stopped = page.locator("#last-run-state").inner_text()
            assert "step 50 of 60" in stopped and stopped.endswith("Run continues from there"), stopped
            # (the run's process may still hold the project's lock for a moment after its run ended CANCELED)
            wait_for(lambda: page.locator("#run-preview").inner_text().endswith("resumes training from step 50 of 60"),
                     timeout=30, what="Run to say it resumes from step 50")
            _shot(page, "#panel-project", "stopped")
            shoot_both_widths(page, "studio-walk-stopped")

            # Run again: it resumes from the step-50 checkpoint and goes to the end (export and evaluation too).
            page.click("#run")
            def second_run_succeeded() -> bool:
                newest = instance.get_runs(limit=1)[0]  # newest first
                return newest.run_id != running.run_id and newest.status == dg.DagsterRunStatus.SUCCESS

            wait_for(second_run_succeeded, timeout=300, what="the second run to succeed")
            wait_for(lambda: {state for state, _ in _rows(page).values()} == {"current"}, timeout=60,
                     what="every stage current again")
            wait_for(lambda: page.locator("#run-preview").inner_text() == "nothing to do: every stage is current",
                     timeout=30, what="Run to say there is nothing to do")
            assert page.locator("#last-run-state").inner_text().startswith("finished")
            assert page.locator("#result-outdated").is_hidden()
            assert "resuming training run" in (paths.dagster_home / "studio-run.log").read_text()
            new_report = atomic.read_json(paths.root / "output" / "demo-adapter.report.json")
            assert new_report["fingerprint"] != report["fingerprint"]
            wait_for(lambda: page.locator("#verdict").inner_text() == new_report["verdict"], timeout=30,
                     what="the new verdict on the page")
            assert page.locator("#score").inner_text() == f"{new_report['val_centred_cosine']:.4f}"
            wait_for(lambda: page.locator("#training").inner_text() == "training: finished: 60/60 steps",
                     timeout=30, what="the training line to say it finished")  # once the run lets go of the lock
            # Use it in ggk: the command, copied as it is.
            assert page.locator("#ggk-command").inner_text() == new_report["ggk_command"]
            page.click("#copy-ggk")
            wait_for(lambda: page.locator("#copy-message").inner_text() == "copied", timeout=10, what="the copy")
            assert page.evaluate("navigator.clipboard.readText()") == new_report["ggk_command"]
            _shot(page, "#panel-ggk", "use-it-in-ggk")
            shoot_both_widths(page, "studio-walk-finished")

            # Where the Clipboard API is missing (a page not served from localhost, an older browser), the Copy
            # button falls back to copying a selected text area: the copy event carries the command.
            bare = context.new_page()
            bare.add_init_script("Object.defineProperty(navigator, 'clipboard', {value: undefined})")
            bare.goto(studio)
            bare.evaluate("document.addEventListener('copy', (e) => { window.copied = e.target.value; })")
            bare.click("#copy-ggk")
            wait_for(lambda: bare.locator("#copy-message").inner_text() == "copied", timeout=10, what="the fallback")
            assert bare.evaluate("window.copied") == new_report["ggk_command"]

            # Runs: the finished project's run (40 steps) and the one just trained (60), with their scores and how
            # each differs from project.yaml.
            page.reload()
            page.click("#open-all")
            wait_for(lambda: page.locator("#runs-table tr[data-run]").count() == 2, timeout=30, what="both runs listed")
            listed = page.evaluate("fetch('api/runs').then((answer) => answer.json())")
            first, second = sorted(listed["runs"], key=lambda run: run["steps"])
            assert (first["steps"], second["steps"]) == (40, 60) and {first["state"], second["state"]} == {"finished"}
            assert second["current"] and not first["current"]  # the output folder holds the newer run's GGUF
            # Columns: actions, run, label, state, steps, best val (step), final val, wall, disk, now, vs project.yaml.
            first_cells, second_cells = (_run_row(page, run).locator("td").all_inner_texts() for run in (first, second))
            assert first_cells[1:5] == [first["name"], "-", "finished", "40/40"], first_cells
            assert second_cells[1:5] == [second["name"], "-", "finished", "60/60"], second_cells
            for cells, run in ((first_cells, first), (second_cells, second)):
                assert cells[6] == f"{run['final_val_centred_cosine']:.4f}", cells
                assert cells[5].startswith(f"{run['best_val_centred_cosine']:.4f} ("), cells
            assert "training.steps=40" in first_cells[10] and first_cells[9] == "-", first_cells
            assert second_cells[10] == "same" and second_cells[9] == "current, project.yaml", second_cells
            assert _run_row(page, second).locator("button", has_text="Delete").is_disabled()  # never the current
            page.locator("#runs").scroll_into_view_if_needed()
            _shot(page, "#runs", "runs")
            shoot_both_widths(page, "studio-walk-runs")

            # "Use" the first run: project.yaml back to 40 steps, its GGUF bytes current again, nothing retrained.
            page.on("dialog", lambda dialog: dialog.accept())  # Use and Delete ask first (confirm)
            runs_before = len(instance.get_runs())
            with page.expect_navigation(timeout=60_000):  # the page reloads itself once Use is done
                _run_row(page, first).locator("button", has_text="Use").click()
            wait_for(lambda: "  steps: 40\n" in paths.project_file.read_text(), timeout=30,
                     what="project.yaml set back")
            wait_for(lambda: (paths.root / "output" / "demo-adapter.gguf").read_bytes() == first_gguf, timeout=30,
                     what="the first run's GGUF in the output folder again")
            assert paths.project_file.read_text() == after.replace("  steps: 60\n", "  steps: 40\n")
            # The report comes back after the GGUF (the last thing Use writes; a loaded machine showed the gap), and
            # only then can the preview below not be the one from before the Use, which also read "nothing to do".
            report_file = paths.root / "output" / "demo-adapter.report.json"
            wait_for(lambda: atomic.read_json(report_file)["fingerprint"] == report["fingerprint"], timeout=30,
                     what="the first run's report, current again")
            wait_for(lambda: page.locator("#run-preview").inner_text() == "nothing to do: every stage is current",
                     timeout=60, what="every stage current under the first run's settings")
            assert len(instance.get_runs()) == runs_before  # no run started: nothing retrained

            # Delete the second run: the page says what it freed, and its folder is gone.
            page.reload()
            page.click("#open-all")
            wait_for(lambda: page.locator("#runs-table tr[data-run]").count() == 2, timeout=30, what="the runs again")
            assert _run_row(page, first).locator("td").all_inner_texts()[9] == "current, project.yaml"
            second_folder = paths.checkpoints_dir(second["fingerprint"])
            assert second_folder.is_dir()
            _run_row(page, second).locator("button", has_text="Delete").click()
            wait_for(lambda: "freed" in page.locator("#runs-message").inner_text(), timeout=30, what="the delete")
            deleted = page.locator("#runs-message").inner_text()
            assert re.fullmatch(rf"deleted {re.escape(second['name'])}: freed [\d.]+ (KiB|MiB|GiB)", deleted), deleted
            assert not second_folder.exists()
            wait_for(lambda: page.locator("#runs-table tr[data-run]").count() == 1, timeout=30, what="one run left")
            shoot_both_widths(page, "studio-walk-deleted")
            page.screenshot(path=str(ARTIFACTS / "studio.png"), full_page=True)
            browser.close()
        assert stopped_s < 15, stopped_s
        # The daemon reloads its workspace every 60 s; on a code server of its own it started a new one each time,
        # and the dropped one printed "No heartbeat received in 20 seconds, shutting down" on this console.
        wait_for(lambda: time.time() - saved > 65, timeout=65, what="a minute of the daemon")
        assert _code_servers(ui) == code_servers
        assert "heartbeat" not in console.read_text(), console.read_text()
    finally:
        stop_with_ctrl_c(ui, what="gguf-trainer ui")
