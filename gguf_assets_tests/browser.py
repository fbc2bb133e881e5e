"""Headless Chromium (Debian's package) for the browser tests, driven by Playwright: where it is, its flags, and
the skip (a developer's laptop) or failure (CI) when it is missing."""

import os
import shutil
from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"  # screenshots, kept by CI
WIDE, PHONE = {"width": 1400, "height": 900}, {"width": 390, "height": 844}  # a desktop window and a phone
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


def shoot_both_widths(page, name: str) -> None:
    """The whole page as it is now, at 1,400 px and at 390 px wide (then back to 1,400): test-artifacts/NAME-1400.png
    and NAME-390.png. At 390 px nothing may scroll sideways (wide tables scroll inside themselves)."""
    ARTIFACTS.mkdir(exist_ok=True)
    page.set_viewport_size(WIDE)
    page.screenshot(path=str(ARTIFACTS / f"{name}-1400.png"), full_page=True)
    page.set_viewport_size(PHONE)
    width = page.evaluate("document.documentElement.scrollWidth")
    if width > PHONE["width"]:  # name the innermost elements that stick out
        wide = page.evaluate("""() => [...document.querySelectorAll('body *')]
            .filter((e) => e.getBoundingClientRect().right > innerWidth + 1 && !e.querySelector('*'))
            .filter((e) => { for (let a = e.parentElement; a; a = a.parentElement)  // not inside a scroll box
                               if (['auto', 'scroll', 'hidden'].includes(getComputedStyle(a).overflowX)) return false;
                             return true; })
            .slice(0, 8).map((e) => `${e.tagName}#${e.id}.${e.className}: ${e.textContent.slice(0, 60)}`)""")
        raise AssertionError(f"{name}: the page is {width} px wide at {PHONE['width']} px: {wide}")
    page.screenshot(path=str(ARTIFACTS / f"{name}-390.png"), full_page=True)
    page.set_viewport_size(WIDE)
