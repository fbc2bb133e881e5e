"""The studio's web app (Starlette, which dagster-webserver already brings, with Jinja2 templates).

One project per app. The page reads the same truths the CLI prints: `status` comes from
lib/status/states.py's one staleness engine, the verdict from the report, what runs now from
the project lock's holder record. Run starts `gguf-trainer run DIR` (the same named Dagster jobs,
the same lock, the same console log); Stop asks Dagster to terminate the project's running run,
which every entry point turns into a clean CANCELED stop. Nothing here keeps state of its own (the
observations it has read are a cache: the instance holds them).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from markupsafe import Markup, escape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.commands import trainer, venv_tool
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.ggk_contract import ESCAPE_HINT
from gguf_assets.lib.core.lock import ProjectLocked, holder
from gguf_assets.lib.core.metrics import EMPTY_PROMPT_COSINE, VAL_CENTRED_COSINE
from gguf_assets.lib.materials.hub import token_from_env
from gguf_assets.lib.materials.hub_shapes import quick_options
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.output import snapshots  # by module: a test holds take_snapshot to see one change at a time
from gguf_assets.lib.output.report import ggk_line, read_report, score_rows, shown_advice, verdict_rule
from gguf_assets.lib.precompute.shards import require_current
from gguf_assets.lib.project import settings_file, settings_history
from gguf_assets.lib.project.layout import FINAL_DIR, META_FILE, ProjectPaths
from gguf_assets.lib.project.presets import PRESETS, preset, set_keys
from gguf_assets.lib.project.settings import Settings, SettingsError, load_settings, settings_from_text
from gguf_assets.lib.runs.changes import delete_run, label_run, use_run
from gguf_assets.lib.runs.compare import compare_runs
from gguf_assets.lib.runs.listing import list_runs, read_runs, size_text
from gguf_assets.lib.status.pace import stage_paces
from gguf_assets.lib.status.run_end import report_score
from gguf_assets.lib.status.stages import SHARD_STAGES, stage_title
from gguf_assets.lib.status.states import (
    ProjectView,
    State,
    adapter_fingerprint_of,
    status_view,
    where_stopped,
    with_running,
)
from gguf_assets.lib.telemetry.curves_log import tensorboard_timeseries_url
from gguf_assets.lib.telemetry.hardware import (
    AUTO_WORKERS,
    environment_report,
    gpu_snapshot,
    hardware_report,
    host_snapshot,
)
from gguf_assets.lib.telemetry.live import merged_history, precompute_progress, training_progress
from gguf_assets.lib.telemetry.render import curves_svg, sparkline_svg
from gguf_assets.lib.training.training_run import (
    ended_early,
    finished_meta,
    history_to_the_end,
    last_checkpoint_step,
    parent_of,
    planned_adapter_run,
)
from gguf_assets.studio.last_run import last_run_view
from gguf_assets.studio.page_signal import page_signal
from gguf_assets.studio.settings_form import NUMBER_RULES, apply_form, form_sections, form_values
from gguf_assets.studio.spare_run import SpareRun

# What loads torch or dagster is imported where it is used: the page starts without either.

# What Run runs after `gguf-trainer run DIR`: the shards on every GPU of the machine, one worker each (one on a CPU
# machine).
RUN_ARGS = ["--workers", AUTO_WORKERS]
TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
RUN_LOG = "studio-run.log"  # in <project>/.dagster: the console output of the runs the studio starts


@dataclass(frozen=True)
class PageView:
    """The page's contract: everything its live panels show, one record. The page renders it
    (templates/project.html reads these fields) and /api/status serves it as JSON (``to_json``: these names are
    the JSON keys the page's script reads). Each field is JSON already (the panels' own dicts and lists)."""

    project: str
    settings_error: str | None = None  # project.yaml's error while it does not load (the rest: the last good view)
    stages: list[dict] = field(default_factory=list)  # {stage, title, state, detail}, in pipeline order
    busy: str | None = None  # what holds the project lock, in its own words
    running: dict | None = None  # {run_id, job}: the Dagster run inside it
    run_preview: str = ""  # what Run would do now, one line
    last_run: dict | None = None  # studio/last_run.py's view of the newest Dagster run
    training: dict | None = None  # the Training metrics panel (training_view)
    snapshots: dict | None = None  # the Snapshots list (snapshots_view)
    precompute: list[dict] = field(default_factory=list)  # the precompute progress rows
    pace: list[str] = field(default_factory=list)  # the precompute's speed and ETA (training's: in ``training``)
    hardware_now: dict = field(default_factory=dict)  # the machine's load now (LiveHardware)
    report: dict | None = None  # the verdict and the exported files, marked "outdated" when made earlier
    run_command: str = ""  # the command Run runs
    signal: dict = field(default_factory=dict)  # the title and the state a notification follows (page_signal.py)

    def to_json(self) -> dict:
        """/api/status's answer: the fields by name, in this order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def project_view(paths: ProjectPaths, feed: ObservationFeed | None = None,
                 hardware: LiveHardware | None = None, last_good: PageView | None = None) -> PageView:
    """Everything the page's live panels show: the stages with why, what runs, what Run would do, the last
    run (failed at which stage, or stopped where, with its log), training and precompute progress, the machine's
    load now, the verdict (marked when made under earlier settings), the GGUF and the exported files.

    ``last_good``: the last view made under valid settings (the studio keeps it); while project.yaml does not
    load, that view is shown again, marked with the file's error, instead of an empty page."""
    try:
        settings = load_settings(paths.root)
    except SettingsError as exc:  # the page stays up and says what to fix
        return replace(last_good or PageView(str(paths.root)), settings_error=str(exc),
                       run_preview=refused_until_it_loads("Run", exc),
                       hardware_now=(hardware or LiveHardware()).read())
    lock_holder = holder(paths.lock_file)
    status = status_view(paths, settings)  # every panel below reuses its shard plans: the corpus is read once
    stages = with_running(status.stages, lock_holder)
    running = lock_holder.running if lock_holder is not None else None
    assets = set(running.assets) if running is not None else set()
    feed = feed or ObservationFeed()
    report = _report_view(paths, settings)
    paces = {p.what: p.text() for p in stage_paces(paths, settings, stages, status)}  # measured speed and ETA
    stage_rows = [{"stage": s.stage, "title": stage_title(s.stage), "state": s.state, "detail": s.detail}
                  for s in stages]
    last_run = _last_run(paths, settings, feed, status)
    # Live only once the run works on the adapter (a run that precomputes first would show "starting").
    training = training_view(paths, settings, feed.entries("adapter", running.run_id)
                             if any(s.stage == "adapter" and s.state == State.RUNNING for s in stages) else None,
                             view=status)
    if training is not None:  # its pace under its own panel, where its line does not say it already
        training["pace"] = "" if training["running"] else paces.get("training", "")
    return PageView(
        project=str(paths.root),
        settings_error=None,
        stages=stage_rows,
        busy=lock_holder.what if lock_holder is not None else None,
        running={"run_id": running.run_id, "job": running.job} if running is not None else None,
        run_preview=run_preview(paths, settings, stages, busy=lock_holder is not None, view=status),
        last_run=last_run,
        training=training,
        snapshots=snapshots_view(paths, settings, status),  # the training run's snapshots and kept steps
        precompute=precompute_progress([(asset.removesuffix("_shards"), figures) for asset in SHARD_STAGES
                                        if asset in assets for figures in feed.entries(asset, running.run_id)]),
        pace=[paces["precompute"]] if "precompute" in paces else [],  # under the Precompute heading
        hardware_now=(hardware or LiveHardware()).read(),
        report=report and {**report, "outdated": _outdated(stages)},
        run_command=trainer("run", paths.root),
        signal=page_signal(paths.root.name, busy=lock_holder is not None, stages=stage_rows, training=training,
                           last_run=last_run, report=report),
    )


def _outdated(stages: list) -> str | None:
    """Why the shown result is not what these settings would make: the first stage that is not current."""
    for s in stages:
        if s.state != State.CURRENT:
            return f"{stage_title(s.stage)} is {s.state}" + (f": {s.detail}" if s.detail else "")
    return None


def run_preview(paths: ProjectPaths, settings, stages: list, *, busy: bool, view: ProjectView | None = None) -> str:
    """What Run would do now, in one line: nothing, or where it starts and whether training starts over or
    resumes (from the newest checkpoint of the training run these settings make). ``view``: the status_view
    ``stages`` came from (its adapter fingerprint is used)."""
    if busy:
        return "a run works on the project now: Stop ends it, and the next Run continues from where it stopped"
    todo = [s for s in stages if s.state != State.CURRENT]
    if not todo:
        return "nothing to do: every stage is current"
    first = todo[0]
    adapter = next((s for s in stages if s.stage == "adapter"), None)
    if adapter is None or adapter.state == State.CURRENT:
        training = "keeps the trained adapter"
    else:
        step = _checkpoint_step(paths, settings, view)
        training = (f"resumes training from step {step} of {settings.training.steps}" if step
                    else f"trains from step 0 to {settings.training.steps}")
    return f"Run starts at {stage_title(first.stage)} ({first.state}) and {training}"


def _checkpoint_step(paths: ProjectPaths, settings, view: ProjectView | None = None) -> int:
    try:
        return last_checkpoint_step(paths, adapter_fingerprint_of(paths, settings, view))
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return 0  # no materials or corpus yet: nothing trained


def _last_run(paths: ProjectPaths, settings, feed: ObservationFeed, view: ProjectView | None = None) -> dict | None:
    try:
        return last_run_view(feed.instance(), lambda: where_stopped(paths, settings, view))
    except Exception:  # noqa: BLE001  the page stays up while the storage is busy or away
        return None


class ObservationFeed:
    """The observations the pipeline's assets record (training log steps and validations, precompute progress),
    read from the project's Dagster instance: each poll reads only what came since the last one."""

    def __init__(self, instance=None) -> None:
        self._instance = instance  # None: the project's own (DAGSTER_HOME), opened when first read
        self._cursors: dict[str, str | None] = {}
        self._by_run: dict[tuple[str, str], list[dict]] = {}

    def instance(self):
        import dagster as dg

        if self._instance is None:
            self._instance = dg.DagsterInstance.get()
        return self._instance

    def entries(self, asset: str, run_id: str) -> list[dict]:
        """The metadata of ``asset``'s observations in the Dagster run ``run_id``, oldest first."""
        import dagster as dg

        try:
            instance = self.instance()
            while True:
                result = instance.fetch_observations(dg.AssetKey(asset), limit=1000,
                                                     cursor=self._cursors.get(asset), ascending=True)
                for record in result.records:
                    figures = {k: v.value for k, v in record.asset_observation.metadata.items()}
                    self._by_run.setdefault((asset, record.run_id), []).append(figures)
                self._cursors[asset] = result.cursor or self._cursors.get(asset)
                if not result.has_more:
                    break
        except Exception:  # noqa: BLE001  the page stays up while the storage is busy or away
            pass
        return self._by_run.get((asset, run_id), [])


def _saved_history(run_dir: Path) -> list[dict]:
    """A training run's history as it stands on disk: its final/ record, else its newest checkpoint's."""
    from gguf_assets.lib.training.checkpoints import latest_checkpoint

    for folder in (run_dir / FINAL_DIR, latest_checkpoint(run_dir) if run_dir.is_dir() else None):
        if folder is not None and (folder / META_FILE).is_file():
            try:
                return history_to_the_end(atomic.read_json(folder / META_FILE))
            except (OSError, ValueError, AttributeError):
                continue
    return []


def training_view(paths: ProjectPaths, settings, live: list[dict] | None, *,
                  view: ProjectView | None = None) -> dict | None:
    """The Training metrics panel: the progress bar's figures and the loss and val curves against the step, for
    the training run these settings make (``live``: the running run's observations, None when none trains),
    else for the adapter last trained. ``view``: this question's status_view (its adapter fingerprint is used)."""
    try:
        fingerprint = adapter_fingerprint_of(paths, settings, view)
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None  # nothing to train on yet (no materials, no corpus)
    run_dir, steps = paths.checkpoints_dir(fingerprint), settings.training.steps
    saved = _saved_history(run_dir)
    final = finished_meta(run_dir) if live is None else None
    finished = final is not None
    if not saved and live is None:  # these settings never trained: show the adapter there is
        try:
            saved = _saved_history(paths.root / atomic.read_json(paths.adapter_manifest)["run_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            saved = []
    logs = [e for e in (live or []) if "loss" in e]
    # A finished run's own end: its final step, and, when a lowered training.steps ended it, how (not "finished:
    # 1600/1600" for a run that ended at step 1740).
    progress = training_progress(logs[-1] if logs else None, steps, running=live is not None,
                                 saved_step=steps if finished else last_checkpoint_step(paths, fingerprint),
                                 ended=ended_early(final),
                                 continues=not run_dir.is_dir() and parent_of(paths, fingerprint) is not None)
    history = merged_history(saved, live or [])
    return {"running": live is not None, "progress": progress, "text": progress["text"],
            "svg": curves_svg(history, panel_width=440, panel_height=220) if history else ""}


def snapshots_view(paths: ProjectPaths, settings, view: ProjectView | None = None) -> dict | None:
    """The Snapshots list of the training run these settings make and the runs it continues, as `gguf-trainer
    snapshot DIR --list` and a refused step read it (snapshots.lineage_snapshots): one row per step a snapshot can
    take and per snapshot GGUF, by step: its planned steps, the weights it holds (step<N> or best), what holds them
    and in which run, the val centred cosine measured at that step, the GGUF's own eval score when it was scored,
    and the file, with its ggk command line. Read from the runs' folders and the report only: cheap enough for every
    poll. None when there is nothing to train on yet (no materials, no corpus)."""
    try:
        fingerprint = adapter_fingerprint_of(paths, settings, view)
        lineage = snapshots.lineage_snapshots(paths, paths.checkpoints_dir(fingerprint), paths.output_dir(settings))
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None

    def source(held_by: str | None, run: str) -> str:
        return ", ".join(part for part in (held_by, None if run == fingerprint else f"of earlier run {run}") if part)

    ggk_command_of = _snapshot_ggk_command(paths, settings)
    rows: dict[tuple[int, str, int], dict] = {}
    for s in lineage.steps:
        rows[(s.step, f"step{s.step}", lineage.runs.index(s.run))] = {
            "step": s.step, "planned_steps": s.planned_steps, "weights": f"step{s.step}", "run": s.run,
            "source": source(s.held_by, s.run), VAL_CENTRED_COSINE: s.scores.get(VAL_CENTRED_COSINE), "eval": None,
            "file": None, "name": None, "size": None}
    for file in lineage.files:
        entry, present = file.entry, file.path.is_file()
        key = (entry.get("step"), str(entry.get("weights")), lineage.runs.index(file.run))
        row = rows.setdefault(key, {"step": key[0], "weights": key[1], "run": file.run,
                                    "source": source(None, file.run)})
        row.update({"planned_steps": entry.get("planned_steps"), VAL_CENTRED_COSINE: entry.get(VAL_CENTRED_COSINE),
                    "eval": (entry.get("eval") or {}).get(VAL_CENTRED_COSINE), "file": str(file.path),
                    "name": file.name, "size": _size(entry["bytes"]) if isinstance(entry.get("bytes"), int) else None,
                    "missing": not present, "same_file_as": file.same_file_as(paths),
                    "ggk_command": ggk_command_of(file.path) if ggk_command_of and present else None})
    return {"run": fingerprint, "rows": [rows[key] for key in sorted(rows, key=lambda k: (k[0], k[1], k[2]))],
            "steps": lineage.steps_text(), "command": trainer("snapshot", paths.root)}


def _snapshot_ggk_command(paths: ProjectPaths, settings) -> Callable[[Path], str] | None:
    """A snapshot GGUF's ggk command line: the result's (its report's), with the snapshot in place of the run's
    adapter. None before a report names the student GGUF and the other files ggk loads beside the adapter."""
    report = read_report(paths, settings)
    if report is None:
        return None
    return lambda gguf: ggk_line(settings.output.ggk_command, report.ggk_files, report.student.get("path") or "",
                                 adapter_gguf=paths.stored(gguf))


def hardware_now() -> dict:
    """Live hardware: every NVIDIA GPU (pynvml), the CPU's load and the RAM in use (psutil), read now."""
    host = host_snapshot()
    return {"cpu_pct": round(host["cpu_pct"], 1), "ram_used_gib": round(host["ram_used_gib"], 2),
            "ram_total_gib": round(host["ram_total_gib"], 1),
            "gpus": [{k: (round(v, 2) if isinstance(v, float) else (v.decode() if isinstance(v, bytes) else v))
                      for k, v in g.items()} for g in gpu_snapshot()]}


class LiveHardware:
    """The machine's load as it changes: each read (the page polls every 2 s) is kept for a short while, and
    every figure comes with a sparkline of its recent readings."""

    KEPT = 90  # 3 minutes of 2-second polls

    def __init__(self) -> None:
        from collections import deque

        self._readings: deque[dict] = deque(maxlen=self.KEPT)

    def read(self) -> dict:
        now = hardware_now()
        self._readings.append(now)
        sparks = {"cpu": sparkline_svg([r["cpu_pct"] for r in self._readings], maximum=100.0),
                  "ram": sparkline_svg([r["ram_used_gib"] for r in self._readings], maximum=now["ram_total_gib"])}
        for g in now["gpus"]:
            sparks[f"gpu{g['index']}"] = sparkline_svg(
                [gpu["util_pct"] for r in self._readings for gpu in r["gpus"] if gpu["index"] == g["index"]],
                maximum=100.0)
        return {**now, "sparks": sparks}


def machine_view() -> dict:
    """The Hardware and Environment panels: devices and memory, library versions."""
    return {"hardware": hardware_report(), "environment": environment_report()}


def memory_view(paths: ProjectPaths) -> dict:
    """The memory estimate (lib/planning/estimate.py), as the page's Memory panel shows it, with where the
    teacher would go on this machine's GPUs and what that costs in speed (`gguf-trainer estimate`'s lines). A hub
    id not downloaded yet is read from the hub once (kept in the project's .cache), within a few seconds."""
    from gguf_assets.lib.planning.estimate import (
        estimate,
        kept_steps_text,
        missing_piece,
        peak_gib,
        placement_lines,
        size_text,
    )

    gpus = gpu_snapshot()
    hub_access = {"token": token_from_env(), "options": quick_options()}
    try:
        settings = load_settings(paths.root)
        lines = estimate(paths, settings, **hub_access)
        placements = placement_lines(paths, settings, gpus, **hub_access)
    except (UserError, OSError, ValueError, KeyError) as exc:
        return {"lines": [], "peak": "?", "gpus": [], "placements": [], "error": str(exc), "kept_steps": ""}
    return {"lines": [{"part": line.part, "size": size_text(line.gib), "how": line.how} for line in lines],
            "peak": size_text(peak_gib(lines)), "error": missing_piece(lines), "placements": placements,
            "kept_steps": kept_steps_text(settings, lines),  # the disk the training.keep_steps_* schedule takes
            "gpus": [f"GPU {g['index']}: {g['mem_total_gib']:.0f} GiB" for g in gpus]}


def _report_view(paths: ProjectPaths, settings) -> dict | None:
    report = read_report(paths, settings)
    if report is None:
        return None
    report_doc = paths.located_doc(report.to_json())
    score = report_score(report)
    # Read from the report as the export recorded them (sizes, sha256): nothing is hashed again per page load.
    # The advice's commands (better weights: lib/output/better.py) for this project's folder, to paste anywhere.
    return {"verdict": report.verdict, "advice": shown_advice(report, trainer, paths.root), "score": score,
            "score_source": report.score_source,
            "gguf_path": report_doc["gguf_path"], "ggk_command": report.ggk_command,
            "report_json": str(paths.report_json(settings)), "report_md": str(paths.report_md(settings)),
            "files": [{"path": f["path"], "role": f["role"], "is_copy": bool(f.get("copy_of")), "bytes": f["bytes"],
                       "size": _size(f["bytes"]), "sha256": f["sha256"]} for f in report_doc["files"]],
            "score_torch": report.val_centred_cosine_torch, "gguf_vs_torch": report.gguf_vs_torch,
            EMPTY_PROMPT_COSINE: report.empty_prompt_cosine, "n_prompts": report.n_prompts,
            "per_shard": report.per_shard, "worst": report.worst[:10], "student": report.student,
            "ggk_files": report_doc["ggk_files"],
            # The Evaluation panel's table: every score, as report.md lists them (lib/output/report.py).
            "scores": [{"measure": measure, "value": value} for measure, value in score_rows(report)],
            "verdict_rule": verdict_rule(report)}


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


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


def refused_until_it_loads(what: str, exc: SettingsError) -> str:
    return f"{what} is refused until project.yaml loads: {exc}"


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


def runs_view(paths: ProjectPaths, served: settings_file.SettingsText) -> dict:
    """The runs, diffed against the project.yaml text ``served`` (listed without a diff when it does not load)."""
    try:
        view = list_runs(paths, settings_from_text(paths.project_file, served.text))
    except SettingsError as exc:
        view = list_runs(paths, None, settings_error=str(exc))
    doc = view.to_json()
    for run in doc["runs"]:
        run["disk"] = size_text(run["disk_bytes"])
    return doc


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


def build_app(project: str | Path, *, dagster_url: str = "", tensorboard_url: str = "",
              spare_run: bool = False) -> Starlette:
    """The studio of ``project``. ``spare_run``: keep a run process loaded ahead while nothing runs, so Run shows
    the first training step seconds sooner (studio/spare_run.py; `gguf-trainer ui` turns it on)."""
    paths = ProjectPaths.of(project)
    studio = Studio(paths, dagster_url, tensorboard_url,
                    spare=SpareRun(paths.root, paths.dagster_home / RUN_LOG, RUN_ARGS) if spare_run else None)
    return Starlette(exception_handlers=_exception_handlers(), routes=[
        *_page_routes(studio), *_run_routes(studio), *_settings_routes(studio), *_runs_routes(studio),
        *_snapshot_routes(studio)])


def inline_code(text: str) -> Markup:
    """A message of the product for the page: escaped, its `...` spans (Markdown's code, which report.md renders)
    shown as code rather than as backticks."""
    return Markup(re.sub(r"`([^`]*)`", r"<code>\1</code>", str(escape(text))))


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
                             "freed_bytes": deleted.freed_bytes, "freed": size_text(deleted.freed_bytes)})

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
        return JSONResponse({"runs": [r.name for r in compared], "svg": svg})

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


def _exception_handlers() -> dict:
    """The answers to a request the handlers refuse by raising: a malformed body, or a refusal from lib/."""
    async def bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    async def refused_by_the_library(_request: Request, exc: UserError) -> JSONResponse:
        """The Runs panel's and the Snapshots' refusals, each one line from lib/: an unknown run, the current one,
        one that trains now, a step that is not kept (400); the project held by a pipeline (ProjectLocked, 409)."""
        return JSONResponse({"error": str(exc)}, status_code=409 if isinstance(exc, ProjectLocked) else 400)

    return {BadRequest: bad_request, UserError: refused_by_the_library}
