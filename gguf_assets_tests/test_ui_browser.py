"""The Dagster UI on a materialized demo project, in headless Chromium (Debian's package).

Checks the lineage graph shows every asset, the evaluation report's metadata is visible,
a training plot renders, and Ctrl-C stops the webserver and daemon promptly. Screenshots go
to test-artifacts/ (CI keeps them).
"""

import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, wait_http

from gguf_assets.runner import run_pipeline

pytestmark = pytest.mark.slow  # whole pipelines: excluded from the fast loop (-m 'not slow')

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
ASSETS = ("materials", "corpus", "train_shards", "val_shards", "adapter", "gguf", "eval_report")
# Flags for a sandboxed, offline machine: without the background-networking ones Chromium
# keeps trying to reach Google's hosts.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _need_browser():
    missing = not Path(CHROMIUM).exists()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = True
    if missing:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium and the playwright package (see .ci/run)")
        pytest.skip("chromium or playwright not installed (CI installs them)")


def test_ui_shows_graph_report_and_plots_then_stops_on_ctrl_c(make_project):
    _need_browser()
    from playwright.sync_api import sync_playwright

    paths = make_project(steps=40, mock_teacher=True, training={"log_every": 5, "validate_every": 10})
    run_pipeline(paths, echo=lambda _: None)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "GGUF_ASSETS_PROJECT")}
    ui = subprocess.Popen([sys.executable, "-m", "gguf_assets.cli", "ui", str(paths.root), "--port", str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        wait_http(f"{base}/server_info", timeout=120, proc=ui)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 1000})

            page.goto(f"{base}/assets/eval_report?view=lineage&lineageScope=upstream&lineageDepth=10")
            for name in ASSETS:
                page.get_by_text(name, exact=True).first.wait_for(timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "ui-graph.png"))

            page.goto(f"{base}/assets/eval_report")
            page.get_by_text("val_centred_cosine", exact=True).first.wait_for(timeout=60_000)
            page.get_by_text("Use it in ggk").first.wait_for(timeout=30_000)
            page.screenshot(path=str(ARTIFACTS / "ui-eval-report.png"), full_page=True)

            page.goto(f"{base}/assets/adapter")
            page.get_by_role("button", name="Plots").click()
            # Numeric metadata (loss, val centred cosine) is plotted as charts.
            page.locator("canvas, svg.recharts-surface").first.wait_for(timeout=60_000)
            assert page.get_by_text("val_centred_cosine").count() > 0
            page.screenshot(path=str(ARTIFACTS / "ui-training-plots.png"), full_page=True)
            browser.close()
    finally:
        ui.send_signal(signal.SIGINT)
        try:
            ui.wait(timeout=30)
        except subprocess.TimeoutExpired:
            ui.kill()
            raise AssertionError("gguf-trainer ui did not stop within 30 s of Ctrl-C")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{base}/server_info", timeout=2)
