"""The studio's web app (Starlette, which dagster-webserver already brings, with Jinja2 templates).

One project per app. The page reads the same truths the CLI prints: `status` comes from
lib/project/pipeline.py's one staleness engine, the verdict from the report, what runs now from
the project lock's holder record. Run starts `gguf-trainer run DIR` (the same named Dagster jobs,
the same lock, the same console log); Stop asks Dagster to terminate the project's running run,
which every entry point turns into a clean CANCELED stop. Nothing here keeps state of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.commands import trainer, venv_tool
from gguf_assets.lib.core.lock import holder
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.manifests import DamagedRecord, Report
from gguf_assets.lib.project.pipeline import project_status, with_running
from gguf_assets.lib.project.presets import PRESETS, preset, set_keys
from gguf_assets.lib.project.settings import SettingsError, load_settings, settings_from_text

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
RUN_LOG = "studio-run.log"  # in <project>/.dagster: the console output of the runs the studio starts
STAGE_TITLES = {"materials": "Materials", "corpus": "Corpus", "train_shards": "Train shards",
                "val_shards": "Val shards", "adapter": "Adapter (training)", "gguf": "GGUF export",
                "eval_report": "Evaluation"}


def project_view(paths: ProjectPaths) -> dict:
    """Everything the Project panel shows, as JSON: the stages with why, what runs, the verdict and the GGUF."""
    try:
        settings = load_settings(paths.root)
    except SettingsError as exc:  # the page stays up and says what to fix
        return {"project": str(paths.root), "settings_error": str(exc), "stages": [], "running": None, "report": None}
    lock_holder = holder(paths.lock_file)
    stages = with_running(project_status(paths, settings), lock_holder)
    running = (lock_holder or {}).get("running")
    return {
        "project": str(paths.root),
        "settings_error": None,
        "stages": [{"stage": s.stage, "title": STAGE_TITLES.get(s.stage, s.stage), "state": s.state,
                    "detail": s.detail} for s in stages],
        "busy": (lock_holder or {}).get("what") if lock_holder else None,
        "running": {"run_id": running["run_id"], "job": running["job"]} if running else None,
        "training": _training_now(running["run_id"], settings) if running and "adapter" in running.get("assets", ())
        else None,
        "report": _report_view(paths, settings),
        "run_command": trainer("run", paths.root),
    }


def memory_view(paths: ProjectPaths) -> dict:
    """The memory estimate (lib/telemetry/estimate.py), as the page's Memory panel shows it."""
    from gguf_assets.lib.telemetry.estimate import estimate, peak_gib, size_text
    from gguf_assets.lib.telemetry.hardware import gpu_snapshot

    try:
        lines = estimate(paths, load_settings(paths.root))
    except (SettingsError, OSError, ValueError, KeyError) as exc:
        return {"lines": [], "peak": "?", "gpus": [], "error": str(exc)}
    return {"lines": [{"part": line.part, "size": size_text(line.gib), "how": line.how} for line in lines],
            "peak": size_text(peak_gib(lines)), "error": None,
            "gpus": [f"GPU {g['index']}: {g['mem_total_gib']:.0f} GiB" for g in gpu_snapshot()]}


def _training_now(run_id: str, settings) -> str | None:
    """The running training's latest log line (step, loss, rate, ETA), from the observations the adapter asset
    records at every log step: the same figures as the console and Dagster's plots."""
    import dagster as dg

    from gguf_assets.lib.telemetry.progress import format_seconds

    try:
        records = dg.DagsterInstance.get().fetch_observations(dg.AssetKey("adapter"), limit=20).records
    except Exception:  # noqa: BLE001  the page stays up while the storage is busy or away
        return None
    for record in records:  # newest first
        figures = {k: v.value for k, v in record.asset_observation.metadata.items()}
        if record.run_id == run_id and "loss" in figures:
            step, rate, steps = int(figures["step"]), float(figures.get("steps_per_s", 0.0)), settings.training.steps
            eta = format_seconds((steps - step) / rate) if rate > 0 else "?"
            return f"step {step}/{steps}, loss {figures['loss']:.4f}, {rate:.2f} steps/s, ETA {eta}"
    return "starting (no log step yet)"


def _report_view(paths: ProjectPaths, settings) -> dict | None:
    try:
        report = Report.read(paths.report_json(settings))
    except (DamagedRecord, OSError):
        return None
    if report is None:
        return None
    report_doc = paths.located_doc(report.to_json())
    score = report.val_centred_cosine if report.evaluated else report.val_centred_cosine_torch
    return {"verdict": report.verdict, "advice": report.advice, "score": score, "score_source": report.score_source,
            "gguf_path": report_doc["gguf_path"], "ggk_command": report.ggk_command,
            "report_json": str(paths.report_json(settings))}


def refusal(request: Request) -> JSONResponse | None:
    """What another web page could send is refused (403): a POST must be JSON, which a page of another origin
    cannot send without a CORS preflight (this app grants none), and must come from this page's own origin when
    the browser names one. Otherwise any site the user visits could rewrite project.yaml or start a run."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return JSONResponse({"error": "a change must be sent as application/json (from the studio page)"},
                            status_code=403)
    origin = request.headers.get("origin")
    if origin and origin != f"{request.url.scheme}://{request.headers.get('host', '')}":
        return JSONResponse({"error": f"refused a request from {origin}: only the studio page may change the "
                                      "project"}, status_code=403)
    return None


def build_app(project: str | Path, *, dagster_url: str = "", tensorboard_url: str = "") -> Starlette:
    paths = ProjectPaths.of(project)
    started: list[subprocess.Popen] = []

    async def page(request: Request) -> HTMLResponse:
        return TEMPLATES.TemplateResponse(request, "project.html", {
            "view": project_view(paths), "dagster_url": dagster_url, "tensorboard_url": tensorboard_url,
            "settings_text": paths.project_file.read_text(encoding="utf-8"), "presets": PRESETS,
            "memory": memory_view(paths),
            # "<" escaped: the JSON sits inside a <script> element.
            "presets_json": json.dumps({p.name: p.description for p in PRESETS}).replace("<", "\\u003c")})

    async def status(_request: Request) -> JSONResponse:
        return JSONResponse(project_view(paths))

    async def run(request: Request) -> JSONResponse:
        if (refused := refusal(request)) is not None:
            return refused
        for proc in started:
            proc.poll()  # reap finished runs
        lock_holder = holder(paths.lock_file)
        if lock_holder is not None:
            return JSONResponse({"error": f"{paths.root} is busy: {lock_holder.get('what', 'another pipeline')}"},
                                status_code=409)
        log_file = paths.dagster_home / RUN_LOG
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "ab") as log:
            # Its own session: stopping the studio does not stop the run (as a run launched in Dagster's UI).
            started.append(subprocess.Popen([venv_tool("gguf-trainer"), "run", str(paths.root)], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True, env=os.environ.copy()))
        return JSONResponse({"started": trainer("run", paths.root), "log": str(log_file)})

    async def stop(request: Request) -> JSONResponse:
        if (refused := refusal(request)) is not None:
            return refused
        running = (holder(paths.lock_file) or {}).get("running")
        if not running:
            return JSONResponse({"error": "nothing of this project is running"}, status_code=409)
        import dagster as dg

        instance = dg.DagsterInstance.get()
        # What Terminate in Dagster's UI does: the run ends CANCELED, resumable, whoever started it.
        instance.run_launcher.terminate(running["run_id"])
        return JSONResponse({"stopping": running["run_id"], "job": running["job"]})

    async def settings_text(_request: Request) -> JSONResponse:
        return JSONResponse({"text": paths.project_file.read_text(encoding="utf-8"),
                             "presets": [{"name": p.name, "description": p.description} for p in PRESETS]})

    async def save_settings(request: Request) -> JSONResponse:
        if (refused := refusal(request)) is not None:
            return refused
        text = (await request.json()).get("text", "")
        try:
            new = settings_from_text(paths.project_file, text)  # the file's own checks: file:line and the fix
        except SettingsError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        try:
            old = load_settings(paths.root)
        except SettingsError:
            old = None
        atomic.write_text(paths.project_file, text)
        changed = settings_history.changed_keys(old, new, lambda s: s.to_dict()) if old is not None else []
        return JSONResponse({"saved": str(paths.project_file), "changed": changed})

    async def apply_preset(request: Request) -> JSONResponse:
        if (refused := refusal(request)) is not None:
            return refused
        body = await request.json()
        try:
            chosen = preset(body.get("name", ""))
        except KeyError as exc:
            return JSONResponse({"error": str(exc.args[0])}, status_code=400)
        return JSONResponse({"text": set_keys(body.get("text", ""), chosen.changes), "preset": chosen.name})

    return Starlette(routes=[Route("/", page), Route("/api/status", status),
                             Route("/api/run", run, methods=["POST"]), Route("/api/stop", stop, methods=["POST"]),
                             Route("/api/settings", settings_text),
                             Route("/api/settings", save_settings, methods=["POST"]),
                             Route("/api/preset", apply_preset, methods=["POST"])])
