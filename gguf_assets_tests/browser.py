"""Headless Chromium (Debian's package) for the browser tests, driven by Playwright: where it is, its flags, and
the skip (a developer's laptop) or failure (CI) when it is missing."""

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Flags for a sandboxed, offline machine: without the background-networking ones Chromium
# keeps trying to reach Google's hosts.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def need_browser() -> None:
    missing = not Path(CHROMIUM).exists()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = True
    if missing:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium and the playwright package (see .ci/run)")
        pytest.skip("chromium or playwright not installed (CI installs them)")
