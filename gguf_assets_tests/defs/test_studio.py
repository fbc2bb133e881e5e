"""The studio page that `gguf-trainer ui` serves beside Dagster, in headless Chromium (Debian's package).

On a finished project: the page shows every stage current, the verdict and the GGUF path from the
report; a settings edit shows up as stale with the key old → new (the one staleness engine); Run
starts the named Dagster job the CLI runs; Stop ends that run CANCELED within seconds.
A screenshot goes to test-artifacts/studio.png.
"""

import subprocess
import time

import dagster as dg
import pytest
from conftest import CLI, cli_env, copy_project, free_port, project_instance, stop_with_ctrl_c, wait_for, wait_http
from test_ui_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _need_browser

from gguf_assets.lib.core import atomic
from gguf_assets.runner import instance_env

pytestmark = pytest.mark.slow  # a UI, a browser and a pipeline run


def _rows(page) -> dict[str, tuple[str, str]]:
    """The Pipeline table as {stage: (state, why)}."""
    rows = {}
    for row in page.locator("#stages tr").all():
        cells = row.locator("td").all_inner_texts()
        rows[row.get_attribute("data-stage")] = (cells[1], cells[2])
    return rows


def test_studio_shows_the_project_and_its_run_and_stop_drive_the_named_jobs(finished_project, tmp_path,
                                                                            monkeypatch):
    _need_browser()
    from playwright.sync_api import sync_playwright

    paths = copy_project(finished_project[0], tmp_path / "copy")
    for name, value in instance_env(paths).items():  # restored after the test
        monkeypatch.setenv(name, value)
    instance = project_instance(paths)
    report = atomic.read_json(paths.root / "output" / "demo-adapter.report.json")
    port, studio_port = free_port(), free_port()
    # Training stalls after step 10 in the runs the studio starts, so Stop lands mid-training.
    console = tmp_path / "ui.log"  # a file, not a pipe: nobody reads a pipe while the browser works
    with open(console, "w") as out:
        ui = subprocess.Popen([*CLI, "ui", str(paths.root), "--port", str(port), "--studio-port", str(studio_port),
                               "--no-tensorboard", "--no-daemon"], stdout=out, stderr=subprocess.STDOUT,
                              text=True, env=cli_env(GGUF_ASSETS_FAULT="train-step@11:stall:60"))
    studio = f"http://127.0.0.1:{studio_port}"
    try:
        wait_for(lambda: console.read_text().strip(), timeout=60, what="the UI's first line", proc=ui)
        first = console.read_text().splitlines()[0]
        assert first == f"Studio for {paths.root} on {studio}", first  # its URL first
        wait_http(studio + "/api/status", timeout=60, proc=ui)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page()
            page.goto(studio)
            assert {state for state, _ in _rows(page).values()} == {"current"} and len(_rows(page)) == 7
            assert page.locator("#verdict").inner_text() == report["verdict"]
            assert page.locator("#gguf-path").inner_text() == str(paths.located(report["gguf_path"]))
            assert page.locator("#score").inner_text() == f"{report['val_centred_cosine']:.4f}"
            # The memory estimate, before anything loads (this project's teacher is the mock one: none loads).
            memory = {row.get_attribute("data-part"): row.locator("td").all_inner_texts()
                      for row in page.locator("#memory tr").all()}
            assert memory["teacher"][1] == "0.0 MiB" and memory["student"][1].endswith("MiB"), memory
            assert "parameters" in memory["adapter training"][2] and "peak" in memory

            # The Settings panel edits project.yaml itself. A typo is refused with the file's line and the fix,
            # and nothing is written.
            before = paths.project_file.read_text()
            assert page.locator("#settings").input_value() == before
            page.fill("#settings", before.replace("  steps: 40", "  stepz: 40"))
            page.click("#save")
            wait_for(lambda: page.locator("#settings-message").inner_text(), timeout=10, what="the save's answer")
            refusal = page.locator("#settings-message").inner_text()
            assert "project.yaml:" in refusal and "stepz" in refusal and "steps" in refusal, refusal
            assert paths.project_file.read_text() == before
            # A preset changes only its keys, comments kept; Save writes it and says what changed.
            page.fill("#settings", before)
            page.select_option("#preset", "first look")
            page.click("#apply-preset")
            wait_for(lambda: "steps: 2000" in page.locator("#settings").input_value(), timeout=10,
                     what="the preset in the editor")
            assert paths.project_file.read_text() == before  # not saved yet
            page.click("#save")
            wait_for(lambda: page.locator("#settings-message").inner_text().startswith("saved"), timeout=10,
                     what="the save")
            assert "training.steps 40 → 2000" in page.locator("#settings-message").inner_text()
            after = paths.project_file.read_text()
            assert [line for line in after.splitlines() if line.strip().startswith("#")] == \
                [line for line in before.splitlines() if line.strip().startswith("#")]  # every comment kept
            # The page says which stage is stale and why, as `status` does.
            wait_for(lambda: _rows(page)["adapter"][0] == "stale", timeout=30, what="the adapter to show stale")
            assert "training.steps 40 → 2000" in _rows(page)["adapter"][1]
            assert _rows(page)["gguf"] == ("blocked", "waits for adapter")

            page.click("#run")
            wait_for(lambda: _rows(page)["adapter"][0] == "running", timeout=180, what="the run to train")
            (running,) = [r for r in instance.get_runs() if r.status == dg.DagsterRunStatus.STARTED]
            assert running.job_name == "train_export_evaluate"  # the named job `gguf-trainer run` runs
            assert running.run_id[:8] in page.locator("#message").inner_text()
            page.screenshot(path=str(ARTIFACTS / "studio.png"), full_page=True)
            # Training stalls after its step-10 checkpoint (the old run kept only 30..40): stop it there.
            wait_for(lambda: any(paths.root.glob("checkpoints/*/step-00000010")), timeout=120,
                     what="the new run's step-10 checkpoint")
            # The live training line: the run's latest log step, as on the console (log_every 10).
            wait_for(lambda: page.locator("#training").inner_text().startswith("training: step 10/2000, loss "),
                     timeout=30, what="the live training line")
            assert "steps/s, ETA " in page.locator("#training").inner_text()

            asked = time.monotonic()
            page.click("#stop")
            wait_for(lambda: instance.get_run_by_id(running.run_id).status == dg.DagsterRunStatus.CANCELED,
                     timeout=30, what="the run to end CANCELED")
            stopped_s = time.monotonic() - asked
            wait_for(lambda: _rows(page)["adapter"][0] == "partial", timeout=30, what="the page to show partial")
            assert "trained to step 10 of 2000" in _rows(page)["adapter"][1]
            browser.close()
        assert stopped_s < 15, stopped_s
    finally:
        stop_with_ctrl_c(ui, what="gguf-trainer ui")
