"""The studio changes the project only for its own page: another web page cannot rewrite project.yaml or
start a run (a cross-site request cannot be JSON without a CORS preflight, and its Origin is checked)."""

import contextlib
import hashlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest
from browser import CHROMIUM, CHROMIUM_ARGS, WIDE, need_browser, shoot_both_widths
from conftest import cli_env, free_port, stop_with_ctrl_c, wait_for, wait_http


def _post(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _command_lines(processes) -> list[str]:
    """Their command lines, leaving out any that ended meanwhile (a run the test started and the studio reaped)."""
    lines = []
    for process in processes:
        try:
            lines.append(" ".join(process.cmdline()))
        except psutil.Error:
            pass
    return lines


@pytest.fixture
def studio(make_project):
    paths = make_project()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gguf_assets.studio", str(paths.root), "--port", str(port),
                             "--no-spare-run"],  # no test here needs a run loaded ahead: it would only take CPU
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/api/status", timeout=60, proc=proc)
        yield paths, base
        # --no-spare-run: the page's status polls (which load a spare otherwise, test_studio.py) started none
        assert not [c for c in _command_lines(psutil.Process(proc.pid).children()) if "spare_run" in c]
    finally:
        stop_with_ctrl_c(proc, what="the studio")


def test_a_cross_site_request_changes_nothing(studio):
    paths, base = studio
    before = paths.project_file.read_text()
    hostile = json.dumps({"text": before.replace("trust_remote_code: false", "trust_remote_code: true")}).encode()
    # A simple (preflight-free) cross-site POST: text/plain, as any web page can send.
    assert _post(base + "/api/settings", hostile, {"Content-Type": "text/plain"})[0] == 403
    assert _post(base + "/api/run", b"", {})[0] == 403
    # JSON from another origin (a browser would preflight it; a script outside one does not).
    status, body = _post(base + "/api/settings", hostile, {"Content-Type": "application/json",
                                                           "Origin": "http://evil.example"})
    assert status == 403 and "evil.example" in body["error"]
    assert paths.project_file.read_text() == before
    assert not (paths.dagster_home / "studio-run.log").exists()  # no run was started

    # The page itself (same origin, JSON) may: a preset comes back for the editor.
    status, body = _post(base + "/api/preset", json.dumps({"name": "first look", "text": before}).encode(),
                         {"Content-Type": "application/json", "Origin": base})
    assert status == 200 and "steps: 2000" in body["text"]
    # The settings form's Save too.
    hostile_form = json.dumps({"values": {"materials.trust_remote_code": True}}).encode()
    assert _post(base + "/api/settings/form", hostile_form, {"Content-Type": "text/plain"})[0] == 403
    assert _post(base + "/api/settings/form", hostile_form, {"Content-Type": "application/json",
                                                             "Origin": "http://evil.example"})[0] == 403
    assert paths.project_file.read_text() == before


def _page(base: str) -> str:
    with urllib.request.urlopen(base + "/", timeout=30) as answer:
        return answer.read().decode()


def test_the_settings_form_shows_project_yaml_and_saves_only_what_changed(studio):
    paths, base = studio
    page = _page(base)
    for section in ("Materials", "Corpus", "Precompute", "Training", "Output"):
        assert f"<legend>{section}</legend>" in page
    assert "<h3>Extra local prompt files</h3>" in page and 'data-key="training.steps"' in page
    assert 'value="120"' in page  # the project's training.steps
    # A hand edit shows in the form on reload: project.yaml is the one source of truth.
    before = paths.project_file.read_text().replace("  steps: 120", "  steps: 130")
    paths.project_file.write_text(before)
    assert 'data-key="training.steps" data-initial=\'"130"\' value="130"' in _page(base)

    headers = {"Content-Type": "application/json", "Origin": base}
    sha = hashlib.sha256(before.encode()).hexdigest()  # the text the page's form was built from
    assert f'baseSha256 = "{sha}"' in _page(base)
    status, body = _post(base + "/api/settings/form", json.dumps({"values": {"training.steps": "0"},
                                                                  "base_sha256": sha}).encode(), headers)
    line = before.splitlines().index("  steps: 130") + 1
    assert status == 400 and body["error"].startswith(f"{paths.project_file}:{line}: training.steps = 0 must be >= 1")
    assert paths.project_file.read_text() == before
    status, body = _post(base + "/api/settings/form", json.dumps({"values": {"training.steps": "60",
                                                                              "training.depth": "1"},
                                                                  "base_sha256": sha}).encode(), headers)
    after = paths.project_file.read_text()
    assert status == 200 and body["changed"] == ["training.steps 130 → 60"] and body["text"] == after
    assert after == before.replace("  steps: 130", "  steps: 60") and body["values"]["training.steps"] == "60"

    for _ in range(2):  # live hardware: each poll reads the machine again and extends its sparklines
        with urllib.request.urlopen(base + "/api/status", timeout=30) as answer:
            view = json.load(answer)
    now = view["hardware_now"]
    assert now["ram_total_gib"] > 0 and 0 < now["ram_used_gib"] <= now["ram_total_gib"]
    assert isinstance(now["gpus"], list) and set(now["sparks"]) == {"cpu", "ram"} | {f"gpu{g['index']}"
                                                                                    for g in now["gpus"]}
    assert len(now["sparks"]["ram"].split('points="')[1].split('"')[0].split()) >= 3  # the page's read and two polls


@contextlib.contextmanager
def _browser_page(base: str):
    """The studio's page in headless Chromium at 1,400 px, every panel open."""
    need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_context(viewport=WIDE).new_page()
        page.goto(base)
        page.click("#open-all")
        yield page
        browser.close()


def _status(base: str) -> dict:
    with urllib.request.urlopen(base + "/api/status", timeout=30) as answer:
        return json.load(answer)


@pytest.mark.slow  # a real `gguf-trainer run` started from the studio
def test_a_failed_run_shows_at_its_stage_and_a_typo_keeps_the_view_and_refuses_run(studio):
    """The studio tells the truth about the last run: a Run that fails (the teacher folder lost its config.json)
    shows its message at its stage, with its log; then a typo in project.yaml keeps the last good view, marked
    with the file's line, and Run is refused with the same message."""
    paths, base = studio
    headers = {"Content-Type": "application/json", "Origin": base}
    view = _status(base)
    assert view["last_run"] is None and view["run_preview"].startswith("Run starts at Materials (missing)")
    assert "trains from step 0 to 120" in view["run_preview"]
    (paths.root / "materials" / "demo" / "teacher" / "config.json").unlink()
    started = _post(base + "/api/run", b"{}", headers)
    assert started[0] == 200 and started[1]["started"].endswith(" --workers auto"), started  # one worker per GPU
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and ((view := _status(base))["last_run"] or {}).get("state") != "failed":
        time.sleep(1)
    last = view["last_run"]
    assert last["state"] == "failed" and last["stage"] == "materials", last
    assert "has no config.json" in last["message"] and "Traceback" not in last["message"], last
    assert any("has no config.json" in line for line in last["log"]), last["log"]
    with _browser_page(base) as page:  # as the user sees it, at 1,400 and 390 px
        assert page.locator("#last-run-state").inner_text().startswith("failed at materials: ")
        assert "has no config.json" in page.locator("#last-run-state").inner_text()
        failed_cell = page.locator('#stages tr[data-stage="materials"] td.state')
        wait_for(lambda: failed_cell.get_attribute("class") == "state failed", timeout=10, what="materials failed")
        assert page.locator("#run-log-box").get_attribute("open") is not None  # the log opens on a failure
        assert "has no config.json" in page.locator("#run-log").inner_text()
        shoot_both_widths(page, "studio-walk-failed-run")

    good_stages = view["stages"]
    text = paths.project_file.read_text()
    broken = text.replace("  steps: 120", "  steps 120")  # a missing colon, typed by hand
    paths.project_file.write_text(broken)
    view = _status(base)
    assert view["stages"] == good_stages and view["last_run"]["state"] == "failed"  # the last good view stays
    line = broken.splitlines().index("  steps 120")
    assert f"{paths.project_file}:" in view["settings_error"], view["settings_error"]
    status, body = _post(base + "/api/run", b"{}", headers)
    assert status == 400 and view["settings_error"] in body["error"] and "refused" in body["error"], body
    assert abs(int(view["settings_error"].split(":")[1]) - (line + 1)) <= 1  # the typo's line (YAML's own count)
    with _browser_page(base) as page:
        assert page.locator("#settings-error").inner_text() == view["settings_error"]
        assert page.locator("#run").is_disabled()  # Run is refused while the settings are invalid
        assert page.locator("#last-run-state").inner_text().startswith("failed at materials: ")  # the view stays
        assert len(page.locator("#stages tr").all()) == len(good_stages)
        shoot_both_widths(page, "studio-walk-typo")


def test_every_post_route_carries_the_json_guard(tmp_path):
    """The JSON-only check is written once (app.json_change) and every route that changes something wears it: a
    POST route added without it fails here. Each one refuses a text/plain body with 403 before reading it."""
    import asyncio

    from starlette.requests import Request
    from starlette.routing import Route

    from gguf_assets.studio.app import build_app

    posts = [r for r in build_app(tmp_path).routes if isinstance(r, Route) and "POST" in (r.methods or ())]
    assert len(posts) == 10
    for route in posts:
        assert getattr(route.endpoint, "json_change", False), f"{route.path} lacks @json_change"

        async def never_read():
            raise AssertionError(f"{route.path} read the body of a refused request")

        request = Request({"type": "http", "method": "POST", "path": route.path, "query_string": b"",
                           "headers": [(b"content-type", b"text/plain")]}, never_read)
        answer = asyncio.run(route.endpoint(request))
        assert answer.status_code == 403 and b"application/json" in answer.body, route.path
