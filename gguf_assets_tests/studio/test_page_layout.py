"""The studio page's layout in headless Chromium, on a copy of the finished demo project (no pipeline run here).

At 1,400 x 900 the first screen holds the verdict, the ggk command and its Copy button, Run, Stop and the stage
table; the panels below fold, and stay as the user left them; the settings are grouped, marked where they differ
from the schema's defaults, and narrowed by the filter; a number field is text checked on the field as the server
checks it (the browser used to turn `2o00` into 200), and a Save it refuses sends nothing; the server's own refusal
marks the field it names. A 390-px phone scrolls nothing sideways, and dark mode follows the system. Last, the
Training metrics panel's Snapshot button and its list's Evaluate and Delete (#57) work on the copy, and Runs' Compare
offers two different runs once a second one appears (#65). Screenshots
go to the test's tmp folder, and to $GGUF_ASSETS_SCREENSHOTS too when it is set.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from browser import CHROMIUM, CHROMIUM_ARGS, PHONE, WIDE, need_browser
from conftest import cli_env, copy_project, free_port, stop_with_ctrl_c, wait_for, wait_http

from gguf_assets.lib.core import atomic
from gguf_assets.lib.project.settings import SECTION_CLASSES, SettingsError
from gguf_assets.studio.settings_form import apply_form

pytestmark = [pytest.mark.slow,  # a studio and a browser (about 30 s on 2 cores; the demo project is the suite's)
              pytest.mark.xdist_group("page_layout")]  # on one worker: one studio and browser (conftest.py)

N_SETTINGS = sum(len(section.model_fields) for section in SECTION_CLASSES.values())


class Studio:
    """One studio on a copy of the finished demo project, one Chromium, and where the screenshots go."""

    def __init__(self, paths, url: str, browser, shots: Path) -> None:
        self.paths, self.url, self.browser, self.shots = paths, url, browser, shots
        self.contexts: list = []

    def page(self, viewport: dict = WIDE, init_script: str | None = None, **options):
        context = self.browser.new_context(viewport=viewport, **options)
        self.contexts.append(context)
        if init_script:  # runs in the page before its own scripts
            context.add_init_script(init_script)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.errors = errors  # the page's script must never throw
        page.goto(self.url)
        return page

    def shot(self, page, name: str, *, full_page: bool = False) -> None:
        path = self.shots / f"{name}.png"
        page.screenshot(path=str(path), full_page=full_page)
        if os.environ.get("GGUF_ASSETS_SCREENSHOTS"):
            folder = Path(os.environ["GGUF_ASSETS_SCREENSHOTS"])
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, folder / path.name)


@pytest.fixture(scope="module")
def studio(finished_project, tmp_path_factory):
    need_browser()
    from playwright.sync_api import sync_playwright

    paths = copy_project(finished_project[0], tmp_path_factory.mktemp("layout") / "project")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gguf_assets.studio", str(paths.root), "--port", str(port),
                             "--no-spare-run"],  # no test here needs a run loaded ahead: it would only take CPU
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/status", timeout=60, proc=proc)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield Studio(paths, f"http://127.0.0.1:{port}", browser, tmp_path_factory.mktemp("screenshots"))
            browser.close()
    finally:
        stop_with_ctrl_c(proc, what="the studio")


@pytest.fixture(autouse=True)
def _close_pages(studio):
    """Each test's pages go when it ends (they poll the studio every 2 s)."""
    yield
    while studio.contexts:
        studio.contexts.pop().close()


def _height(page) -> float:
    """How tall the page's content is (the document is never shorter than the window)."""
    return page.evaluate("document.body.getBoundingClientRect().bottom + window.scrollY")


def _scroll_width(page) -> int:
    return page.evaluate("document.documentElement.scrollWidth")


def _shown_fields(page) -> list[str]:
    return page.evaluate("[...document.querySelectorAll('#settings-form .field')]"
                         ".filter((f) => f.getClientRects().length).map((f) => f.dataset.field)")


def _luminance(css_colour: str) -> float:
    red, green, blue = (int(part) for part in re.findall(r"\d+", css_colour)[:3])
    return (0.2126 * red + 0.7152 * green + 0.0722 * blue) / 255


def _field(page, key: str):
    return page.locator(f'[data-key="{key}"]')


def _error(page, key: str):
    return page.locator(f'[id="error-{key}"]')


def test_the_first_screen_holds_the_verdict_the_ggk_command_run_stop_and_the_stages(studio):
    page = studio.page()
    report = atomic.read_json(studio.paths.root / "output" / "demo-adapter.report.json")
    assert page.locator("#verdict").inner_text() == report["verdict"]
    assert page.locator("#ggk-command").inner_text() == report["ggk_command"]
    assert page.locator("#stages tr").count() == 7
    for selector in ("#verdict", "#score", "#ggk-command", "#copy-ggk", "#run", "#stop", "#stages", "#run-preview"):
        box = page.locator(selector).bounding_box()
        assert box is not None, selector
        assert box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= WIDE["width"] \
            and box["y"] + box["height"] <= WIDE["height"], (selector, box)
    assert _scroll_width(page) <= WIDE["width"]
    assert _luminance(page.evaluate("getComputedStyle(document.body).backgroundColor")) > 0.9  # light by default
    assert _command_words_broken(page) == []  # the command wraps at its spaces only (#65)
    # The emphasis note shows its examples as code, not as Markdown's backticks (#65).
    assert "`" not in page.locator("#ggk-emphasis").inner_text()
    assert page.locator("#ggk-emphasis code").all_inner_texts() == ["a \\(red\\) cat", "a (red) cat"]
    # The tab's title says the state (#65): the finished pipeline's score; Notify asks for notifications.
    assert page.title() == f"✓ {report['val_centred_cosine']:.3f} · project"
    assert page.locator("#notify").is_visible() and page.locator("#notify").inner_text() == "Notify me"
    studio.shot(page, "wide-first-screen")
    studio.shot(page, "wide-as-opened", full_page=True)
    assert not page.errors, page.errors


def _command_words_broken(page) -> list[str]:
    """The words of the ggk command that the page draws over more than one line, but for a word wider than the box
    itself (a phone's), which wraps inside rather than widen the page."""
    return page.evaluate("""() => {
        const box = document.getElementById("ggk-command"), text = box.textContent, broken = [];
        const range = document.createRange(), style = getComputedStyle(box);
        const measure = document.createElement("canvas").getContext("2d");
        measure.font = style.font;
        const room = box.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
        for (const match of text.matchAll(/\\S+/g)) {  // each word's own characters, wherever the page put them
            let start = match.index, end = start + match[0].length, offset = 0, rects = new Set();
            const walker = document.createTreeWalker(box, NodeFilter.SHOW_TEXT);
            for (let node = walker.nextNode(); node; node = walker.nextNode()) {
                const from = Math.max(start - offset, 0), to = Math.min(end - offset, node.length);
                if (from < to) {
                    range.setStart(node, from); range.setEnd(node, to);
                    for (const r of range.getClientRects()) if (r.width > 0) rects.add(Math.round(r.top));
                }
                offset += node.length;
            }
            if (rects.size > 1 && measure.measureText(match[0]).width <= room) broken.push(match[0]);
        }
        return broken;
    }""")


def test_the_panels_fold_and_stay_as_the_user_left_them(studio):
    page = studio.page()
    # The Evaluation panel opens with the page, each score saying which way is better (#65).
    assert page.locator("#evaluation").is_visible()
    scores = page.locator("#evaluation tr td:first-child").all_inner_texts()
    assert len(scores) > 10 and all("is better" in measure for measure in scores[:-1]), scores
    as_opened = _height(page)
    assert as_opened < 4 * WIDE["height"], as_opened  # the first screen, the training metrics and the evaluation
    page.click("#open-all")
    everything = _height(page)
    assert everything > 4 * WIDE["height"], everything  # what the page was before it folded
    page.click("#fold-all")
    folded = _height(page)
    assert folded <= WIDE["height"] + 100, folded  # the first screen and a heading per panel
    assert page.locator("#curves").is_hidden() and page.locator("#panel-settings .fold-toggle").first \
        .get_attribute("aria-expanded") == "false"
    studio.shot(page, "wide-folded", full_page=True)
    page.reload()  # kept in the browser's storage
    assert page.locator("#curves").is_hidden() and _height(page) == folded
    page.click("#panel-training > h2 > .fold-toggle")
    assert page.locator("#curves").is_visible()
    page.reload()
    assert page.locator("#curves").is_visible() and page.locator("#files").is_hidden()
    page.click('nav a[href="#panel-files"]')  # a link to a folded panel opens it
    assert page.locator("#files").is_visible()
    assert not page.errors, page.errors


def test_settings_are_grouped_marked_where_not_the_default_and_filtered(studio):
    page = studio.page()
    page.click('nav a[href="#panel-settings"]')
    legends = page.locator("#settings-form legend").all_inner_texts()
    assert [re.sub(r"\s*\(.*", "", text) for text in legends] == ["Materials", "Corpus", "Precompute", "Training",
                                                                 "Output"]
    assert _shown_fields(page) == []  # every group folded as the page opens
    assert re.fullmatch(r"Training\s*\(\d+ changed\)", legends[3]), legends[3]  # what differs, counted
    page.click("#form-training > legend > .fold-toggle")
    steps, grad_clip = page.locator('.field[data-field="training.steps"]'), \
        page.locator('.field[data-field="training.grad_clip"]')
    # The demo trains 40 steps (the default is 20000); it keeps the default gradient clip.
    assert "changed" in steps.get_attribute("class") and steps.locator(".badge").is_visible()
    assert steps.locator(".badge").get_attribute("title") == "differs from the default: 20000"
    assert "changed" not in grad_clip.get_attribute("class") and grad_clip.locator(".badge").is_hidden()
    _field(page, "training.steps").fill("20000")  # the default typed in: not changed, but not saved either
    assert "changed" not in steps.get_attribute("class") and "edited" in steps.get_attribute("class")
    assert page.locator("#unsaved").inner_text() == "1 not saved"
    _field(page, "training.steps").fill("40")
    assert "changed" in steps.get_attribute("class") and "edited" not in steps.get_attribute("class")
    studio.shot(page, "wide-settings-training")

    page.fill("#settings-filter", "warmup")
    assert _shown_fields(page) == ["training.warmup_steps"]
    assert page.locator("#form-materials").is_hidden()
    assert page.locator("#filter-count").inner_text() == f"1 of {N_SETTINGS} settings shown"
    page.fill("#settings-filter", "cuda")  # a folded group with a match opens while the filter is on
    # The filter reads the help text too: training.precision's names the CUDA GPUs that compute bf16.
    assert _shown_fields(page) == ["precompute.device", "training.device", "training.precision"]
    studio.shot(page, "wide-settings-filtered")
    page.fill("#settings-filter", "")
    assert "folded" in page.locator("#form-precompute").get_attribute("class").split()  # as it was
    assert len(_shown_fields(page)) == len(SECTION_CLASSES["training"].model_fields)
    page.check("#only-changed")
    shown = _shown_fields(page)
    assert "training.steps" in shown and "training.grad_clip" not in shown and "materials.student" in shown
    assert all("changed" in page.locator(f'.field[data-field="{key}"]').get_attribute("class") for key in shown)
    page.uncheck("#only-changed")
    assert not page.errors, page.errors


# What the page says on a number field, and the server says the same (settings.py's words): `2o00` is no number
# (type=number used to drop the letter and save 200), the int64 limits, finiteness and each key's bounds.
NUMBERS = [("training.steps", "2o00", "must be an integer"), ("training.steps", "0", "must be >= 1"),
           ("training.steps", "9223372036854775808", "is out of range: a number here lies between "
                                                     "-9223372036854775808 and 9223372036854775807"),
           ("training.steps", "9223372036854775807", ""), ("training.steps", "2.5", "must be an integer"),
           ("training.learning_rate", "1e400", "must be a finite number"), ("training.learning_rate", "2e-4", ""),
           ("training.learning_rate", "9" * 400, "is out of range"), ("training.learning_rate", "abc",
                                                                       "must be a number"),
           ("training.ema_decay", "1", "must be below 1.0"), ("training.ema_decay", "0.999", ""),
           ("corpus.empty_fraction", "0.6", "must be <= 0.5"), ("materials.teacher_layer", "-3", "")]


def test_a_number_field_is_checked_on_the_field_as_the_server_checks_it(studio):
    page = studio.page()
    page.click("#open-all")
    sent = []
    page.on("request", lambda request: sent.append(request.url) if request.method == "POST" else None)
    before = studio.paths.project_file.read_bytes()
    text = before.decode()
    for key, typed, said in NUMBERS:
        field = _field(page, key)
        field.fill(typed)
        field.press("Tab")  # checked when the user leaves the field
        assert field.input_value() == typed  # nothing the browser could not read is dropped
        if said:
            assert field.get_attribute("aria-invalid") == "true", (key, typed)
            assert _error(page, key).is_visible() and _error(page, key).inner_text().startswith(said), \
                (key, typed, _error(page, key).inner_text())
        else:
            assert field.get_attribute("aria-invalid") is None and _error(page, key).is_hidden(), (key, typed)
        try:  # the server's own check, on the same text
            apply_form(studio.paths.project_file, text, {key: typed})
            refused = ""
        except SettingsError as exc:
            refused = str(exc)
        assert (said in refused) if said else not refused, (key, typed, refused)
    for key in {key for key, _, _ in NUMBERS}:  # back to the file's values
        field = _field(page, key)
        field.fill(json.loads(field.get_attribute("data-initial")))
        assert field.get_attribute("aria-invalid") is None  # the mark goes as soon as the value is right

    steps = _field(page, "training.steps")
    steps.fill("2o00")
    page.click("#save-form")  # refused on the page: nothing is sent, nothing written
    assert steps.get_attribute("aria-invalid") == "true" and _error(page, "training.steps").is_visible()
    assert page.locator("#form-message").inner_text().startswith(
        "not saved: training.steps = '2o00' must be an integer")
    assert page.evaluate("document.activeElement.dataset.key") == "training.steps"
    box = steps.bounding_box()  # in view, above the Save bar
    assert 0 <= box["y"] and box["y"] + box["height"] <= page.locator(".sticky-save").bounding_box()["y"], box
    studio.shot(page, "wide-invalid-field")
    page.wait_for_timeout(300)
    assert not [url for url in sent if url.endswith("/api/settings/form")], sent
    assert studio.paths.project_file.read_bytes() == before
    steps.fill("40")
    assert steps.get_attribute("aria-invalid") is None  # the mark goes as soon as the value is right

    # A rule across keys is the server's: its refusal (file:line, key, the rule) marks the field it names.
    heads = _field(page, "training.heads")
    heads.fill("7")
    page.click("#save-form")
    wait_for(lambda: page.locator("#form-message").inner_text().startswith(f"{studio.paths.project_file}:"),
             timeout=10, what="the server's refusal")
    assert heads.get_attribute("aria-invalid") == "true"
    assert _error(page, "training.heads").inner_text() == ("training.heads is 7, but ggk runs heads of 64, so width 64 "
                                                            "has 1; remove the key (or set 0)")
    assert studio.paths.project_file.read_bytes() == before
    heads.fill("4")
    assert heads.get_attribute("aria-invalid") is None and _error(page, "training.heads").is_hidden()
    assert not page.errors, page.errors


def test_a_phone_scrolls_nothing_sideways(studio):
    page = studio.page(PHONE, is_mobile=True, has_touch=True)  # a mobile browser honours the viewport meta
    assert page.evaluate("document.documentElement.clientWidth") == PHONE["width"]
    assert _scroll_width(page) <= PHONE["width"]
    assert page.locator("#run").is_visible() and page.locator("#verdict").is_visible()
    assert _command_words_broken(page) == []  # "--tokenizer-pack" was "-" / "-tokenizer-pack" (#65)
    studio.shot(page, "phone-first-screen")
    studio.shot(page, "phone-as-opened", full_page=True)
    page.click("#open-all")  # every panel and settings group open: tables scroll inside themselves
    assert _scroll_width(page) <= PHONE["width"], _scroll_width(page)
    box = page.locator('[data-key="training.steps"]').bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], box
    assert not page.errors, page.errors


def test_dark_mode_follows_the_system(studio):
    page = studio.page(color_scheme="dark")
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    text = page.evaluate("getComputedStyle(document.body).color")
    assert _luminance(background) < 0.15 and _luminance(text) > 0.7, (background, text)
    field = page.evaluate("getComputedStyle(document.querySelector('[data-key=\"training.steps\"]')).backgroundColor")
    assert _luminance(field) < 0.4, field  # the form's controls too (color-scheme)
    studio.shot(page, "dark-first-screen")
    page.click('nav a[href="#panel-settings"]')
    page.click("#form-training > legend > .fold-toggle")
    page.locator('.field[data-field="training.steps"]').scroll_into_view_if_needed()
    studio.shot(page, "dark-settings")
    assert not page.errors, page.errors


# The text elements whose colour against their background (the nearest opaque one, translucent layers blended in)
# is under WCAG's AA contrast: 4.5, or 3 for large text; disabled controls and the charts' SVG are exempt.
LOW_CONTRAST = r"""() => {
  const rgba = (s) => { const m = s.match(/[\d.]+/g).map(Number); return [m[0], m[1], m[2], m.length > 3 ? m[3] : 1]; };
  const lin = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
  const lum = ([r, g, b]) => 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b);
  const background = (e) => {
    let layers = [];
    for (let a = e; a; a = a.parentElement) {
      const c = rgba(getComputedStyle(a).backgroundColor);
      if (c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    let out = layers.length && layers[layers.length - 1][3] >= 1 ? layers.pop() : [255, 255, 255, 1];
    if (!layers.length && out[3] < 1) out = [255, 255, 255, 1];
    for (const c of layers.reverse()) out = [0, 1, 2].map((i) => c[i] * c[3] + out[i] * (1 - c[3]));
    return out;
  };
  const bad = [];
  for (const e of document.querySelectorAll('body *')) {
    const own = [...e.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!own || e.closest('svg') || e.disabled || e.closest('[disabled]')) continue;
    const r = e.getBoundingClientRect(); const st = getComputedStyle(e);
    if (!r.width || !r.height || st.visibility === 'hidden' || st.display === 'none' || +st.opacity === 0) continue;
    const fg = rgba(st.color), bg = background(e);
    const fgm = [0, 1, 2].map((i) => fg[i] * fg[3] + bg[i] * (1 - fg[3]));
    const [a, b] = [lum(fgm), lum(bg)].sort((x, y) => y - x);
    const ratio = (a + 0.05) / (b + 0.05);
    const size = parseFloat(st.fontSize), bold = +st.fontWeight >= 700;
    const need = size >= 24 || (bold && size >= 18.66) ? 3 : 4.5;
    if (ratio < need)
      bad.push(`${ratio.toFixed(2)} < ${need}: ${e.tagName}#${e.id}.${e.className} "${e.textContent.slice(0, 40)}"`);
  }
  return bad;
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_every_text_is_readable_in_light_and_dark_at_both_widths(studio, scheme):
    """The finished project with every panel open, at 1,400 and 390 px, in the system's light and dark schemes:
    each text reaches AA contrast, and nothing scrolls sideways (screenshots kept)."""
    for viewport in (WIDE, PHONE):
        page = studio.page(viewport, color_scheme=scheme)
        page.click("#open-all")
        assert page.evaluate(LOW_CONTRAST) == [], (scheme, viewport)
        assert _scroll_width(page) <= viewport["width"], (scheme, viewport, _scroll_width(page))
        studio.shot(page, f"{scheme}-{viewport['width']}-all-open", full_page=True)
        assert not page.errors, page.errors
        page.context.close()


# Each notification the page makes, kept for the test; the browser's own Notification still makes it.
RECORD_NOTIFICATIONS = """
  window.notices = [];
  const BrowserNotification = window.Notification;
  window.Notification = class extends BrowserNotification {
    constructor(title, options) { super(title, options); window.notices.push([title, options.body]); }
  };
"""


def test_a_notification_comes_once_when_a_run_the_page_watched_ends(studio):
    """#65: with notifications allowed, the page tells the end of a run it saw running, once. The copy has finished
    (nothing runs here): the studio's /api/status answers as while a pipeline trains (the signal page_signal.py
    makes then), then its own answer again."""
    report = atomic.read_json(studio.paths.root / "output" / "demo-adapter.report.json")
    done = f"✓ {report['val_centred_cosine']:.3f} · project"
    page = studio.page(permissions=["notifications"], init_script=RECORD_NOTIFICATIONS)
    assert page.title() == done
    assert page.locator("#notify").inner_text() == "Notifications on" and page.locator("#notify").is_disabled()
    training = {"running": True}

    def status(route):
        view = route.fetch().json()
        if training["running"]:
            view = {**view, "busy": "gguf-trainer run project",
                    "signal": {**view["signal"], "state": "running", "title": "⏳ 20/40 · project", "detail": ""}}
        route.fulfill(json=view)

    page.route("**/api/status", status)
    page.evaluate("refresh()")
    assert page.title() == "⏳ 20/40 · project" and page.evaluate("window.notices") == []
    training["running"] = False
    page.evaluate("refresh()")
    assert page.title() == done
    assert page.evaluate("window.notices") == [[done, report["verdict"]]]
    page.evaluate("refresh()")  # still finished: no second notification
    training["running"] = True
    page.evaluate("refresh()")
    training["running"] = False
    page.evaluate("refresh()")  # the same run again: told already
    assert page.evaluate("window.notices") == [[done, report["verdict"]]]
    assert not page.errors, page.errors


def test_a_snapshot_is_taken_evaluated_and_deleted_from_the_training_panel(studio):
    """#57 in the Training metrics panel: Snapshot says "Taking snapshot…" and is disabled until the studio answers,
    then the list has a row with its step and file, and the GGUF is on disk; Evaluate puts the GGUF's own score in
    its row; Delete removes the GGUF (its row is the kept step again, to export once more). Late in the module: the
    project keeps that kept step."""
    from playwright.sync_api import expect

    from gguf_assets.lib.output.snapshots import read_snapshots

    answered = 60_000  # ms: an export or an evaluation on a loaded machine (about a second on an idle one)
    page = studio.page(permissions=["clipboard-read", "clipboard-write"])
    page.on("dialog", lambda dialog: dialog.accept())  # Delete asks first
    snapshot, message = page.locator("#snapshot"), page.locator("#snapshot-message")
    # Before any snapshot: a row per step a snapshot can take, labelled as the line above says (#65).
    final_row = page.locator('#snapshots tr[data-step="40"][data-weights="step40"]')
    assert final_row.locator("td").all_inner_texts()[3] == "step40 (final weights)"
    expect(final_row.locator("td.snapshot-file")).to_have_text("no GGUF yet")
    assert page.locator("#snapshot-steps").inner_text() == \
        "steps a snapshot can take: 30, 35 (checkpoints), 40 (final weights)"
    assert page.locator("#kept-steps").inner_text() == "kept steps on a schedule: off (training.keep_steps_every 0)"
    held: list = []  # the request held until the button's state is read: the check never races the answer
    page.route("**/api/snapshot", lambda route: held.append(route))
    snapshot.click()
    expect(snapshot).to_have_text("Taking snapshot…")
    expect(snapshot).to_be_disabled()
    expect(page.locator("#snapshot-best")).to_be_disabled()
    for _ in range(600):  # the route reaches its handler while Playwright waits
        if held:
            break
        page.wait_for_timeout(50)
    assert len(held) == 1
    held[0].continue_()
    page.unroute("**/api/snapshot")
    gguf = studio.paths.root / "output" / "demo-adapter-step40.gguf"
    expect(message).to_have_text(re.compile(rf"^snapshot of step 40 of 40 \(step40\): {re.escape(str(gguf))}; val "
                                            r"centred cosine at that step \d\.\d{4}$"), timeout=answered)
    row = page.locator('#snapshots tr[data-step="40"][data-weights="step40"]')
    expect(row.locator("td.snapshot-file")).to_have_text(str(gguf))
    assert gguf.is_file()
    expect(snapshot).to_be_enabled()
    expect(snapshot).to_have_text("Snapshot")
    assert row.locator("td").all_inner_texts()[1:6] == ["40", "40", "step40 (kept for a snapshot)",
                                                        f"{_kept_score(studio, 40):.4f}", "-"]
    expect(page.locator("#snapshot-steps")).to_have_text(
        "steps a snapshot can take: 30, 35 (checkpoints), 40 (kept for a snapshot)")
    studio.shot(page, "wide-snapshot-taken")
    # Copy (#65): the ggk command line that loads this snapshot as the adapter.
    report = atomic.read_json(studio.paths.root / "output" / "demo-adapter.report.json")
    command = report["ggk_command"].replace(" output/demo-adapter.gguf ", f" output/{gguf.name} ")
    row.get_by_role("button", name="Copy").click()
    expect(message).to_have_text(f"copied the ggk command for {gguf.name}: {command}")
    assert page.evaluate("navigator.clipboard.readText()") == command

    row.get_by_role("button", name="Evaluate").click()
    expect(message).to_contain_text("; this GGUF on the val shards ", timeout=answered)
    (entry,) = read_snapshots(_run_dir(studio))
    expect(row.locator("td").nth(5)).to_have_text(f"{entry['eval']['val_centred_cosine']:.4f}")
    page.locator("#panel-training h3", has_text="Snapshots").scroll_into_view_if_needed()
    studio.shot(page, "wide-snapshot-evaluated")
    page.set_viewport_size(PHONE)  # the row's long path scrolls inside its table, not the page
    assert _scroll_width(page) <= PHONE["width"], _scroll_width(page)
    row.scroll_into_view_if_needed()
    studio.shot(page, "phone-snapshot-evaluated")
    page.set_viewport_size(WIDE)

    # Compare (#65): the Runs panel's lists offer the snapshot below the runs; compared with its run, its row under
    # the curves holds its GGUF's evaluation, and its line is its point at step 40.
    from gguf_assets.lib.runs.listing import read_runs

    (run,) = read_runs(studio.paths).runs
    page.reload()  # the Runs panel lists what is there when it loads
    page.click('nav a[href="#runs"]')
    page.select_option("#runs-b", gguf.name)
    page.click("#runs-compare")
    compared = page.locator("#runs-scores tbody tr")
    expect(compared).to_have_count(2)
    cells = compared.nth(1).locator("td").all_inner_texts()
    assert [cells[0], cells[1], cells[4]] == [f"{gguf.name} (snapshot of {run.name})", "40",
                                              f"{entry['eval']['val_centred_cosine']:.4f}"], cells
    expect(page.locator("#runs-svg circle")).to_have_count(3)

    row.get_by_role("button", name="Delete").click()
    expect(message).to_have_text(f"deleted {gguf}", timeout=answered)
    expect(row.locator("td.snapshot-file")).to_have_text("no GGUF yet")
    assert not gguf.exists() and read_snapshots(_run_dir(studio)) == []
    expect(row.get_by_role("button", name="Export")).to_be_enabled()  # the kept step stays
    assert not page.errors, page.errors


def _run_dir(studio):
    final = atomic.read_json(studio.paths.root / "checkpoints" / "final.json")
    return studio.paths.checkpoints_dir(final["fingerprint"])


def _kept_score(studio, step: int) -> float:
    from gguf_assets.lib.training.kept_steps import kept_step_meta

    return kept_step_meta(_run_dir(studio), step)["val_centred_cosine"]


def test_compare_starts_with_two_different_runs_as_a_second_run_comes(studio):
    """#65: with one run, Compare's two selects hold it; once a second run appears (a continuation started from the
    studio), the panel's next refresh offers two different runs, the newest and the best other (not the first run
    twice), and Compare draws both. Last in the module: the second run is removed again."""
    from playwright.sync_api import expect

    page = studio.page()
    first = _run_dir(studio).name
    a, b = page.locator("#runs-a"), page.locator("#runs-b")
    expect(a).to_have_value(first)
    expect(b).to_have_value(first)
    page.click('nav a[href="#runs"]')  # a link to a folded panel opens it
    second = studio.paths.root / "checkpoints" / "0123456789abcdef"
    shutil.copytree(_run_dir(studio), second, ignore=shutil.ignore_patterns("export"))
    try:
        # The panel refreshes every 10 s, and at once after a change made on it: an unchanged label, here.
        page.once("dialog", lambda dialog: dialog.accept(""))
        page.locator("#runs-table tr").first.get_by_role("button", name="Label").click()
        expect(b).to_have_value(second.name)
        expect(a).to_have_value(first)
        page.click("#runs-compare")
        expect(page.locator("#runs-svg polyline")).to_have_count(2)
    finally:
        shutil.rmtree(second)
    assert not page.errors, page.errors
