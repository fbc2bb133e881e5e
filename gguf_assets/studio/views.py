"""The studio's views: the functions that build each panel's data, as the page (page.py's PageView) and its JSON
routes (routes.py) show it.

They read the same truths the CLI prints: the stages from lib/status/states.py's one staleness engine, the verdict
from the report, what runs now from the project lock's holder record, the live figures from the observations the
pipeline's assets record in the project's Dagster instance. Nothing here changes the project.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.lock import holder
from gguf_assets.lib.core.metrics import EMPTY_PROMPT_COSINE, VAL_CENTRED_COSINE
from gguf_assets.lib.core.units import bytes_text
from gguf_assets.lib.materials.hub import token_from_env
from gguf_assets.lib.materials.hub_shapes import quick_options
from gguf_assets.lib.output import snapshots
from gguf_assets.lib.output.report import ggk_line, read_report, score_rows, shown_advice, verdict_rule
from gguf_assets.lib.project import settings_file
from gguf_assets.lib.project.layout import FINAL_DIR, META_FILE, ProjectPaths
from gguf_assets.lib.project.settings import SettingsError, load_settings, settings_from_text
from gguf_assets.lib.runs.compare import snapshot_choices
from gguf_assets.lib.runs.listing import list_runs
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
from gguf_assets.lib.telemetry.hardware import environment_report, gpu_snapshot, hardware_report, host_snapshot
from gguf_assets.lib.telemetry.live import merged_history, precompute_progress, training_progress
from gguf_assets.lib.telemetry.render import curves_svg, sparkline_svg
from gguf_assets.lib.training.training_run import (
    ended_early,
    finished_meta,
    history_to_the_end,
    last_checkpoint_step,
    parent_of,
)
from gguf_assets.studio.last_run import last_run_view
from gguf_assets.studio.page import PageView
from gguf_assets.studio.page_signal import page_signal

# What loads torch or dagster is imported where it is used: the page starts without either.


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
    report = report_view(paths, settings)
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
                    "eval": file.evaluation(paths).get(VAL_CENTRED_COSINE), "file": str(file.path),
                    "name": file.name,
                    "size": bytes_text(entry["bytes"]) if isinstance(entry.get("bytes"), int) else None,
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


def report_view(paths: ProjectPaths, settings) -> dict | None:
    report = read_report(paths, settings)
    if report is None:
        return None
    report_doc = paths.located_doc(report.to_json())
    score = report_score(report)
    # Read from the report as the export recorded them (sizes, sha256): nothing is hashed again per page load.
    # The advice's commands (better weights: lib/training/better.py) for this project's folder, to paste anywhere.
    return {"verdict": report.verdict, "advice": shown_advice(report, trainer, paths.root), "score": score,
            "score_source": report.score_source,
            "gguf_path": report_doc["gguf_path"], "ggk_command": report.ggk_command,
            "report_json": str(paths.report_json(settings)), "report_md": str(paths.report_md(settings)),
            "files": [{"path": f["path"], "role": f["role"], "is_copy": bool(f.get("copy_of")), "bytes": f["bytes"],
                       "size": bytes_text(f["bytes"]), "sha256": f["sha256"]} for f in report_doc["files"]],
            "score_torch": report.val_centred_cosine_torch, "gguf_vs_torch": report.gguf_vs_torch,
            EMPTY_PROMPT_COSINE: report.empty_prompt_cosine, "n_prompts": report.n_prompts,
            "per_shard": report.per_shard, "worst": report.worst[:10], "student": report.student,
            "ggk_files": report_doc["ggk_files"],
            # The Evaluation panel's table: every score, as report.md lists them (lib/output/report.py).
            "scores": [{"measure": measure, "value": value} for measure, value in score_rows(report)],
            "verdict_rule": verdict_rule(report)}



def refused_until_it_loads(what: str, exc: SettingsError) -> str:
    return f"{what} is refused until project.yaml loads: {exc}"



def runs_view(paths: ProjectPaths, served: settings_file.SettingsText) -> dict:
    """The runs, diffed against the project.yaml text ``served`` (listed without a diff when it does not load)."""
    try:
        view = list_runs(paths, settings_from_text(paths.project_file, served.text))
    except SettingsError as exc:
        view = list_runs(paths, None, settings_error=str(exc))
    doc = view.to_json()
    for run in doc["runs"]:
        run["disk"] = bytes_text(run["disk_bytes"])
    doc["compare_snapshots"] = snapshot_choices(view)  # Compare offers them beside the runs
    return doc
