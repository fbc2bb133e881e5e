"""The studio's routes (Starlette handlers): the page and its live view, Run and Stop, project.yaml's editor and
forms, the Runs panel, the Snapshots; and ``Studio``, what they keep between requests.

Run starts `gguf-trainer run DIR` (the same named Dagster jobs, the same lock, the same console log); Stop asks Dagster
to terminate the project's running run, which every entry point turns into a clean CANCELED stop. Every POST is a
``json_change``. The panels' data comes from views.py; the page's contract is page.py's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from gguf_assets.lib.core.commands import trainer, venv_tool
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.ggk_contract import ESCAPE_HINT
from gguf_assets.lib.core.lock import ProjectLocked, holder
from gguf_assets.lib.core.units import bytes_text
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.output import snapshots  # by module: a test holds take_snapshot to see one change at a time
from gguf_assets.lib.precompute.shards_run import require_current
from gguf_assets.lib.project import settings_file, settings_history
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.presets import PRESETS, preset, set_keys
from gguf_assets.lib.project.settings import Settings, SettingsError, load_settings, settings_from_text
from gguf_assets.lib.runs.changes import delete_run, label_run, use_run
from gguf_assets.lib.runs.compare import compare_runs, compared_scores
from gguf_assets.lib.runs.listing import read_runs
from gguf_assets.lib.telemetry.curves_log import tensorboard_timeseries_url
from gguf_assets.lib.telemetry.hardware import AUTO_WORKERS
from gguf_assets.lib.training.training_run import planned_adapter_run
from gguf_assets.studio.page import TEMPLATES, PageView, inline_code
from gguf_assets.studio.settings_form import NUMBER_RULES, apply_form, form_sections, form_values
from gguf_assets.studio.spare_run import SpareRun
from gguf_assets.studio.views import (
    LiveHardware,
    ObservationFeed,
    machine_view,
    memory_view,
    project_view,
    refused_until_it_loads,
    runs_view,
)

# What loads dagster is imported where it is used: the page starts without it.

# What Run runs after `gguf-trainer run DIR`: the shards on every GPU of the machine, one worker each (one on a CPU
# machine).
RUN_ARGS = ["--workers", AUTO_WORKERS]
RUN_LOG = "studio-run.log"  # in <project>/.dagster: the console output of the runs the studio starts


def refusal(request: Request) -> JSONResponse | None:
    """A change must be sent as JSON (403 otherwise): a page of another origin cannot send JSON without a CORS
    preflight, which this app grants none of. The Host allow-list, the Origin check and the body cap are
    guard.py's, around the whole app."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return JSONResponse({"error": "a change must be sent as application/json (from the studio page)"},
                            status_code=403)
    return None


def json_change(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A route that changes something (every POST here): ``refusal`` is asked first, before the body is read.
    The one place the check is written; the wrapped handler is marked, so a test can see that each POST has it."""
    @functools.wraps(handler)
    async def guarded(request: Request) -> Response:
        if (refused := refusal(request)) is not None:
            return refused
        return await handler(request)

    guarded.json_change = True
    return guarded



def settings_or_refusal(paths: ProjectPaths, what: str) -> tuple[Settings | None, JSONResponse | None]:
    """(the project's settings, None), or (None, the 400 that refuses ``what`` while project.yaml does not load)."""
    try:
        return load_settings(paths.root), None
    except SettingsError as exc:
        return None, JSONResponse({"error": refused_until_it_loads(what, exc)}, status_code=400)


class BadRequest(Exception):
    """A request body the studio page would never send: answered 400 with this message."""


async def json_object(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequest(f"the request body is not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def base_sha256(body: dict) -> str:
    """The sha256 of the project.yaml text the page's edit was built from (see settings_file.py)."""
    base = body.get("base_sha256")
    if not isinstance(base, str) or len(base) != 64:
        raise BadRequest("base_sha256 (the sha256 of the project.yaml text this edit was made on) is missing; "
                         "reload the studio page")
    return base


def run_ref(body: dict) -> str:
    """The run a Runs panel request names (its name, fingerprint or label)."""
    ref = body.get("run")
    if not isinstance(ref, str) or not ref.strip():
        raise BadRequest("run (the name of a run, as the Runs panel lists it) is missing; reload the studio page")
    return ref



@dataclass
class Studio:
    """What one studio app keeps between requests: its project, the runs it started, the spare run loaded ahead,
    the observations and hardware readings read so far, the project.yaml texts it served, and the last view made
    under valid settings."""

    paths: ProjectPaths
    dagster_url: str = ""
    tensorboard_url: str = ""
    spare: SpareRun | None = None
    started: list[subprocess.Popen] = field(default_factory=list)
    feed: ObservationFeed = field(default_factory=ObservationFeed)
    hardware: LiveHardware = field(default_factory=LiveHardware)
    seen: settings_file.SeenTexts = field(default_factory=settings_file.SeenTexts)
    last_good: PageView | None = None  # the last view made under valid settings (project_view)
    snapshotting: asyncio.Lock = field(default_factory=asyncio.Lock)  # one snapshot change at a time

    def view(self) -> PageView:
        view = project_view(self.paths, self.feed, self.hardware, self.last_good)
        if view.settings_error is None:
            self.last_good = view
        return view

    def served(self) -> settings_file.SettingsText:
        """project.yaml as it is now, remembered as a text the page was served (the base of its next edit)."""
        return self.seen.remember(settings_file.read(self.paths.project_file))

    def keep_a_spare(self) -> None:
        """A spare run loads while nothing runs (a run it would compete with for the CPU: one just started
        here, or one holding the project)."""
        if (self.spare is not None and all(proc.poll() is not None for proc in self.started)
                and holder(self.paths.lock_file) is None):
            self.spare.ensure()


def routes(studio: Studio) -> list[Route]:
    """Every route of one studio app, sharing ``studio``."""
    return [*_page_routes(studio), *_run_routes(studio), *_settings_routes(studio), *_runs_routes(studio),
            *_snapshot_routes(studio)]


def _page_routes(studio: Studio) -> list[Route]:
    """The page, and the live view it polls."""
    async def page(request: Request) -> HTMLResponse:
        served = studio.served()  # the one source of truth, on every load
        text = served.text
        return TEMPLATES.TemplateResponse(request, "project.html", {
            "settings_sha256": served.sha256,
            "view": studio.view(), "dagster_url": studio.dagster_url,
            "tensorboard_url": tensorboard_timeseries_url(studio.tensorboard_url) if studio.tensorboard_url else "",
            "settings_text": text, "presets": PRESETS, "forms": form_sections(text), "number_rules": NUMBER_RULES,
            "memory": memory_view(studio.paths), "machine": machine_view(), "escape_hint": inline_code(ESCAPE_HINT),
            # "<" escaped: the JSON sits inside a <script> element.
            "presets_json": json.dumps({p.name: p.description for p in PRESETS}).replace("<", "\\u003c")})

    async def status(_request: Request) -> JSONResponse:
        studio.keep_a_spare()  # the page asks every 2 s
        return JSONResponse(studio.view().to_json())

    return [Route("/", page), Route("/api/status", status)]


def _run_routes(studio: Studio) -> list[Route]:
    """Run (`gguf-trainer run DIR`, in its own session) and Stop (Dagster terminates the running run)."""
    paths, started, spare = studio.paths, studio.started, studio.spare

    @json_change
    async def run(request: Request) -> JSONResponse:
        for proc in started:
            proc.poll()  # reap finished runs
        lock_holder = holder(paths.lock_file)
        if lock_holder is not None:
            busy = lock_holder.what if lock_holder.what is not None else "another pipeline"
            return JSONResponse({"error": f"{paths.root} is busy: {busy}"},
                                status_code=409)
        _, refused = settings_or_refusal(paths, "Run")  # the run would stop at once with the same message
        if refused is not None:
            return refused
        log_file = paths.dagster_home / RUN_LOG
        log_file.parent.mkdir(parents=True, exist_ok=True)
        process = spare.go() if spare is not None else None
        if process is None:
            with open(log_file, "ab") as log:
                # Its own session: stopping the studio does not stop the run (as a run launched in Dagster's UI).
                process = subprocess.Popen([venv_tool("gguf-trainer"), "run", str(paths.root), *RUN_ARGS], stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True, env=os.environ.copy())
        started.append(process)
        return JSONResponse({"started": trainer("run", paths.root, *RUN_ARGS), "log": str(log_file)})

    @json_change
    async def stop(request: Request) -> JSONResponse:
        lock_holder = holder(paths.lock_file)
        running = lock_holder.running if lock_holder is not None else None
        if running is None:
            return JSONResponse({"error": "nothing of this project is running"}, status_code=409)
        import dagster as dg

        instance = dg.DagsterInstance.get()
        # What Terminate in Dagster's UI does: the run ends CANCELED, resumable, whoever started it.
        instance.run_launcher.terminate(running.run_id)
        return JSONResponse({"stopping": running.run_id, "job": running.job})

    return [Route("/api/run", run, methods=["POST"]), Route("/api/stop", stop, methods=["POST"])]


def _write_checked(studio: Studio, new_text: str, new, base: str) -> JSONResponse:
    """Write a checked project.yaml text atomically if the file is still the text the page edited (409
    with what changed otherwise); the answer says which keys changed."""
    paths = studio.paths
    try:
        old = load_settings(paths.root)
    except SettingsError:
        old = None
    try:
        saved = settings_file.save_if_unchanged(paths.project_file, paths.dagster_home, new_text, base, studio.seen)
    except settings_file.SettingsChanged as exc:
        return JSONResponse({"error": str(exc), "diff": exc.diff, "sha256": exc.current.sha256},
                            status_code=409)
    changed = settings_history.changed_keys(old, new, lambda s: s.to_dict()) if old is not None else []
    return JSONResponse({"saved": str(paths.project_file), "changed": changed, "text": saved.text,
                         "sha256": saved.sha256, "values": form_values(saved.text)})


def _settings_routes(studio: Studio) -> list[Route]:
    """project.yaml: read it, save the text editor's or the forms' edit, apply a preset to the editor's text."""
    paths = studio.paths

    async def settings_text(_request: Request) -> JSONResponse:
        served = studio.served()
        return JSONResponse({"text": served.text, "sha256": served.sha256, "values": form_values(served.text),
                             "presets": [{"name": p.name, "description": p.description} for p in PRESETS]})

    @json_change
    async def save_settings(request: Request) -> JSONResponse:
        """The text editor's Save (a preset applied there is saved this way too)."""
        body = await json_object(request)
        text = body.get("text")
        if not isinstance(text, str):
            raise BadRequest("text (the whole project.yaml) must be a string")
        try:
            new = settings_from_text(paths.project_file, text)  # the file's own checks: file:line and the fix
        except SettingsError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return _write_checked(studio, text, new, base_sha256(body))

    @json_change
    async def save_form(request: Request) -> JSONResponse:
        """The settings forms' Save: only the fields the user changed, set in project.yaml as it is now."""
        body = await json_object(request)
        values = body.get("values", {})
        if not isinstance(values, dict):
            raise BadRequest("values must be an object of section.key: value")
        try:
            saved = apply_form(paths.project_file, settings_file.read(paths.project_file).text, values)
        except SettingsError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return _write_checked(studio, saved.text, saved.settings, base_sha256(body))

    @json_change
    async def apply_preset(request: Request) -> JSONResponse:
        body = await json_object(request)
        try:
            chosen = preset(str(body.get("name", "")))
        except KeyError as exc:
            return JSONResponse({"error": str(exc.args[0])}, status_code=400)
        text = body.get("text")
        text = paths.project_file.read_text(encoding="utf-8") if text is None else text
        if not isinstance(text, str):
            raise BadRequest("text (the editor's project.yaml) must be a string")
        with_preset = set_keys(text, chosen.changes)
        shown = form_values(with_preset)
        # The form gets the preset's fields only: what the user changed elsewhere in the form stays.
        return JSONResponse({"text": with_preset, "preset": chosen.name,
                             "values": {f"{section}.{key}": shown[f"{section}.{key}"]
                                        for section, keys in chosen.changes.items() for key in keys}})

    return [Route("/api/settings", settings_text), Route("/api/settings", save_settings, methods=["POST"]),
            Route("/api/settings/form", save_form, methods=["POST"]),
            Route("/api/preset", apply_preset, methods=["POST"])]


def _runs_routes(studio: Studio) -> list[Route]:
    """The Runs panel: list, compare, use, delete and label training runs (lib/runs/)."""
    paths = studio.paths

    async def runs_list(_request: Request) -> JSONResponse:
        """The Runs panel: every training run (lib/runs/), diffed against the project.yaml text whose
        sha256 comes with it: "use" names that text, so an edit made since is never overwritten."""
        served = studio.served()
        return JSONResponse({**(await run_in_threadpool(runs_view, paths, served)), "settings_sha256": served.sha256})

    @json_change
    async def runs_use(request: Request) -> JSONResponse:
        body = await json_object(request)
        ref, base = run_ref(body), base_sha256(body)
        try:
            used = await run_in_threadpool(lambda: use_run(paths, ref, base_sha256=base, seen=studio.seen))
        except settings_file.SettingsChanged as exc:
            return JSONResponse({"error": str(exc), "diff": exc.diff, "sha256": exc.current.sha256}, status_code=409)
        from gguf_assets.orchestration.runs import tell_dagster

        problem = await run_in_threadpool(lambda: tell_dagster(paths, used, studio.feed.instance))
        return JSONResponse({**used.to_json(), "dagster": problem})

    @json_change
    async def runs_delete(request: Request) -> JSONResponse:
        ref = run_ref(await json_object(request))
        deleted = await run_in_threadpool(delete_run, paths, ref)
        return JSONResponse({"deleted": deleted.name, "fingerprint": deleted.fingerprint,
                             "freed_bytes": deleted.freed_bytes, "freed": bytes_text(deleted.freed_bytes)})

    @json_change
    async def runs_label(request: Request) -> JSONResponse:
        body = await json_object(request)
        ref, label = run_ref(body), body.get("label", "")
        if not isinstance(label, str):
            raise BadRequest("label must be a string (empty removes it)")
        run = await run_in_threadpool(label_run, paths, ref, label)
        return JSONResponse(run.to_json())

    async def runs_compare(request: Request) -> JSONResponse:
        refs = request.query_params.getlist("run")
        if not refs:
            raise BadRequest("name the runs to compare: ?run=A&run=B")
        compared, svg = compare_runs(await run_in_threadpool(read_runs, paths), refs)
        return JSONResponse({"runs": [r.name for r in compared], "svg": svg,
                             "scores": [compared_scores(r) for r in compared]})

    return [Route("/api/runs", runs_list), Route("/api/runs/compare", runs_compare),
            Route("/api/runs/use", runs_use, methods=["POST"]),
            Route("/api/runs/delete", runs_delete, methods=["POST"]),
            Route("/api/runs/label", runs_label, methods=["POST"])]


def _snapshot_target(paths: ProjectPaths, settings):
    """The materials, the folder of the training run these settings make, and its val shards (checked current),
    as `gguf-trainer snapshot` finds them."""
    materials = load_manifest(paths)
    run_dir = paths.checkpoints_dir(planned_adapter_run(paths, settings, materials).fingerprint)
    if not snapshots.has_started(paths, run_dir):
        raise snapshots.SnapshotError("no training run of these settings has started yet: Run starts it, and a "
                                      "snapshot can be taken as soon as it trains")
    return materials, run_dir, require_current(paths, settings, materials, "val")


def _snapshot_request(body: dict) -> tuple[int | None, bool, bool]:
    step, best, evaluate = body.get("step"), body.get("best", False), body.get("eval", False)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise BadRequest("step must be a whole number of steps (absent: the newest)")
    if not isinstance(best, bool) or not isinstance(evaluate, bool):
        raise BadRequest("best and eval must be true or false")
    if best and step is not None:
        raise BadRequest("ask for a step or for best, not both")
    return step, best, evaluate


def _snapshot_to_delete(body: dict) -> str | int:
    """The snapshot GGUF a Delete names: its file name (the Snapshots list's rows send it), or a step that has one
    file."""
    name, step = body.get("file"), body.get("step")
    if name is not None:
        if not isinstance(name, str) or not name or "/" in name or "\\" in name:
            raise BadRequest("file must be a snapshot GGUF's name, as the Snapshots list shows it")
        return name
    if isinstance(step, bool) or not isinstance(step, int):
        raise BadRequest("name the snapshot to delete: file (its name, as the Snapshots list shows it), or step (a "
                         "whole number)")
    return step


def _snapshot_routes(studio: Studio) -> list[Route]:
    """Snapshot (a GGUF of the adapter now, its best, or a kept step; also while it trains: the trainer keeps its
    current step, lib/output/snapshots.py) and the Snapshots list's Export, Evaluate and Delete. One at a time
    (409 while one is under way); each runs off the event loop, so the page keeps polling meanwhile."""
    paths = studio.paths

    def busy() -> JSONResponse:
        return JSONResponse({"error": "a snapshot is being taken or deleted now: wait for it to end"},
                            status_code=409)

    @json_change
    async def snapshot(request: Request) -> JSONResponse:
        step, best, evaluate = _snapshot_request(await json_object(request))
        settings, refused = settings_or_refusal(paths, "Snapshot")
        if refused is not None:
            return refused
        if studio.snapshotting.locked():
            return busy()

        def take() -> dict:
            materials, run_dir, val_folders = _snapshot_target(paths, settings)
            return snapshots.take_snapshot(paths, settings, materials, run_dir, val_folders=val_folders, step=step,
                                           best=best, evaluate=evaluate, say=logging.getLogger(__name__).info)

        async with studio.snapshotting:
            entry = await run_in_threadpool(take)
        return JSONResponse({**entry, "path": str(paths.located(entry["file"]))})

    @json_change
    async def delete(request: Request) -> JSONResponse:
        which = _snapshot_to_delete(await json_object(request))
        settings, refused = settings_or_refusal(paths, "Delete")
        if refused is not None:
            return refused
        if studio.snapshotting.locked():
            return busy()

        def remove() -> list[str]:
            run = planned_adapter_run(paths, settings, load_manifest(paths)).fingerprint
            removed = snapshots.delete_snapshot(paths, paths.checkpoints_dir(run), which,
                                                output_dir=paths.output_dir(settings))
            return [str(paths.located(f)) for f in removed]

        async with studio.snapshotting:
            deleted = await run_in_threadpool(remove)
        return JSONResponse({"deleted": deleted, **({"step": which} if isinstance(which, int) else {"file": which})})

    return [Route("/api/snapshot", snapshot, methods=["POST"]),
            Route("/api/snapshot/delete", delete, methods=["POST"])]


def exception_handlers() -> dict:
    """The answers to a request the handlers refuse by raising: a malformed body, or a refusal from lib/."""
    async def bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    async def refused_by_the_library(_request: Request, exc: UserError) -> JSONResponse:
        """The Runs panel's and the Snapshots' refusals, each one line from lib/: an unknown run, the current one,
        one that trains now, a step that is not kept (400); the project held by a pipeline (ProjectLocked, 409)."""
        return JSONResponse({"error": str(exc)}, status_code=409 if isinstance(exc, ProjectLocked) else 400)

    return {BadRequest: bad_request, UserError: refused_by_the_library}
