"""The Dagster UI and TensorBoard on a materialized demo project, in headless Chromium (Debian's package).

Checks the Overview lists the runs of `gguf-trainer run`, the lineage graph shows every asset,
the evaluation report's metadata is visible, the adapter's page shows its settings table and its
plots, a shard partition shows its own figures, the runs are listed, TensorBoard (started by
`gguf-trainer ui`) serves the loss against the step, and Ctrl-C stops them all promptly.
Screenshots of each page go to test-artifacts/.
"""

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, need_browser
from conftest import FAULT_SETTINGS, copy_project, free_port, stop_with_ctrl_c, wait_for, wait_http

from gguf_assets.pipeline.groups import lineage_path

pytestmark = pytest.mark.slow  # whole pipelines: excluded from the fast loop (-m 'not slow')

ASSETS = ("materials", "corpus", "train_shards", "val_shards", "adapter", "gguf", "eval_report")
JOBS = ("materials_and_corpus", "precompute_train_shards", "precompute_val_shards", "train_export_evaluate")

def test_ui_shows_graph_report_and_plots_then_stops_on_ctrl_c(finished_project, tmp_path):
    need_browser()
    from playwright.sync_api import sync_playwright

    paths = copy_project(finished_project[0], tmp_path / "project")  # what `gguf-trainer run` left
    port, tb_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "GGUF_ASSETS_PROJECT")}
    ui = subprocess.Popen([sys.executable, "-m", "gguf_assets.cli", "ui", str(paths.root), "--port", str(port),
                           "--tensorboard-port", str(tb_port), "--studio-port", str(free_port())],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base, tensorboard = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{tb_port}"
    fingerprint = json.loads((paths.root / "checkpoints" / "final.json").read_text())["fingerprint"]
    from gguf_assets.lib.project.settings import load_settings
    from gguf_assets.lib.telemetry.curves_log import run_name, tensorboard_timeseries_url

    run = run_name(load_settings(paths.root).training, fingerprint)  # "64x1-40steps-lr…-<fingerprint start>"
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        wait_http(f"{base}/server_info", timeout=120, proc=ui)
        # TensorBoard serves this run's loss against the step (10, 20, 30, 40: log_every 10).
        wait_http(f"{tensorboard}/data/runs", timeout=120, proc=ui)
        with urllib.request.urlopen(f"{tensorboard}/data/plugin/scalars/scalars?tag=train%2Floss&run={run}",
                                    timeout=30) as answer:
            loss = json.loads(answer.read())
        log_every, steps = FAULT_SETTINGS["training"]["log_every"], FAULT_SETTINGS["steps"]
        assert [step for _, step, _ in loss] == list(range(log_every, steps + 1, log_every)), loss
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1000})

            # The landing page (Overview, timeline) lists the runs that `gguf-trainer run` made, by job.
            page.goto(base)
            page.wait_for_url("**/overview/**", timeout=60_000)
            for job in JOBS:
                page.get_by_text(job, exact=True).first.wait_for(timeout=60_000)
            assert page.get_by_text("No runs or scheduled ticks").count() == 0
            page.screenshot(path=str(ARTIFACTS / "ui-overview.png"), full_page=True)

            # The lineage link `gguf-trainer ui` prints: every group open, in pipeline order.
            page.goto(base + lineage_path())
            for name in ASSETS:
                page.get_by_text(name, exact=True).first.wait_for(timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "ui-graph.png"))

            page.goto(f"{base}/assets/eval_report")
            page.get_by_text("val_centred_cosine", exact=True).first.wait_for(timeout=60_000)
            page.get_by_text("Use it in ggk").first.wait_for(timeout=30_000)
            page.screenshot(path=str(ARTIFACTS / "ui-eval-report.png"), full_page=True)

            page.goto(f"{base}/assets/adapter")
            # The settings the adapter depends on, as a table, with the demo's width.
            page.get_by_text("training.width", exact=True).first.wait_for(timeout=60_000)
            assert page.get_by_text("project_folder").count() > 0 and page.get_by_text("tensorboard").count() > 0
            page.screenshot(path=str(ARTIFACTS / "ui-adapter-settings.png"), full_page=True)
            page.get_by_role("button", name="Plots").click()
            # Numeric metadata (loss, val centred cosine) is plotted as charts.
            page.locator("canvas, svg.recharts-surface").first.wait_for(timeout=60_000)
            assert page.get_by_text("val_centred_cosine").count() > 0
            page.screenshot(path=str(ARTIFACTS / "ui-training-plots.png"), full_page=True)

            # A shard partition shows its own figures: 100 prompts (not the run's 400).
            page.goto(f"{base}/assets/train_shards?view=partitions&partition=00001")
            page.get_by_text("teacher_tokens").first.wait_for(timeout=60_000)
            page.get_by_text("100", exact=True).first.wait_for(timeout=60_000)
            # The page renders in steps (once, under load, the run's total was still on it at this point): wait for
            # it to settle, and say where the total is should it stay.
            where: list[str] = []

            def no_run_total() -> bool:
                where[:] = page.get_by_text("400", exact=True).evaluate_all(
                    "found => found.map(e => (e.parentElement.parentElement || e).innerText)")  # one read
                return not where

            try:
                wait_for(no_run_total, timeout=30, what="the partition's page without the run's total")
            except AssertionError:
                raise AssertionError(f"the run's total (400) on the partition's page: {where}") from None
            page.screenshot(path=str(ARTIFACTS / "ui-shard-partition.png"), full_page=True)

            # The runs, by their job names.
            page.goto(f"{base}/runs")
            for job in JOBS:
                page.get_by_text(job).first.wait_for(timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "ui-runs.png"), full_page=True)

            # The link the adapter's page and `gguf-trainer ui` give: this run, unsmoothed (TensorBoard's default
            # smoothing 0.6 would show 4 validation points as one smoothed value), opening on the loss: its cards
            # are sorted by tag, and the "hardware/" ones came first, the loss out of sight below them (#65).
            page.goto(tensorboard_timeseries_url(tensorboard, run=run))
            smoothing = page.locator(".scalars-smoothing input.slider-input")
            smoothing.wait_for(timeout=60_000)
            assert smoothing.input_value() == "0"
            page.locator("card-view .tag", has_text="train/loss").first.wait_for(timeout=60_000)
            cards = page.locator("card-view .tag").evaluate_all(
                "tags => tags.map((t) => [t.textContent.trim(), t.getBoundingClientRect().bottom])")
            assert [tag for tag, _ in cards[:2]] == ["train/loss", "val/val_centred_cosine"], cards
            assert cards[0][1] < 1000, cards  # on the first screen (the window is 1,000 px high)
            assert page.get_by_text(run).count() > 0  # the run is named by its shape, steps, lr and fingerprint
            page.screenshot(path=str(ARTIFACTS / "tensorboard.png"), full_page=True)
            browser.close()
    finally:
        stop_with_ctrl_c(ui, what="gguf-trainer ui")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{base}/server_info", timeout=2)
