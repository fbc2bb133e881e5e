"""Training runs read from disk: each run's name, state, scores, settings and their diff against project.yaml,
lineage and disk use (`gguf-trainer runs`, the studio's Runs panel); the package's docstring says what a run is."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gguf_assets.lib.core import atomic, metrics
from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.metrics import VAL_CENTRED_COSINE
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.precompute.shards_run import shard_fingerprints
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import FINAL_DIR, LABEL_FILE, META_FILE, SPLITS, STEP_DIR, ProjectPaths
from gguf_assets.lib.project.settings import SECTIONS, Settings, SettingsError, replace, shown_setting
from gguf_assets.lib.status.stages import stage_settings
from gguf_assets.lib.telemetry.curves_log import TENSORBOARD_DIR, run_name
from gguf_assets.lib.training.training_run import (
    RunOutcome,
    ended_early,
    history_to_the_end,
    kept_gguf,
    newest_meta,
    reached_step,
    read_kept,
    read_lineage,
    read_session,
    run_fingerprint,
    session_alive,
    standing_runs,
)
from gguf_assets.lib.training.verdict import validation_curve

# A run's last validation as the list and --compare show it: the compared scores and the worst row's index.
LAST_SCORE_KEYS = (*(score.key for score in metrics.COMPARED), metrics.WORST_ROW)


# A run's state in the list: lib/training/training_run.py's RunOutcome, the one vocabulary of how a run ended.
RunState = RunOutcome


class RunsError(UserError):
    """A runs request that cannot be done as asked; the message says why and what to do."""


@dataclass(frozen=True)
class KeyDiff:
    """One project.yaml key whose value differs between a run's settings and the file now. ``result``: setting
    it changes a result (it enters a stage's settings); cadence, device and the like do not."""

    key: str
    run: Any
    now: Any
    result: bool

    def text(self) -> str:
        run, now = (shown_value(shown_setting(self.key, value)) for value in (self.run, self.now))
        return f"{self.key}: {run} in the run, {now} now" + ("" if self.result else " (changes no result)")


@dataclass(frozen=True)
class Run:
    fingerprint: str
    name: str
    label: str
    state: RunState
    detail: str  # why it is in that state, and what `run` would do with it
    step: int  # the steps done: the finished run's, else its newest checkpoint's
    steps: int | None  # the steps it was set to train
    best_step: int | None
    best_val_centred_cosine: float | None
    final_val_centred_cosine: float | None  # the torch checkpoint's, at the end
    gguf_val_centred_cosine: float | None  # its kept report's (the GGUF, read back by numpy)
    train_seconds: float | None  # wall time of its training sessions, up to its newest checkpoint
    seconds_estimated: bool  # from its log's steps/s: a run from before the time was recorded
    disk_bytes: int  # its folder and its TensorBoard events
    current: bool  # its GGUF and report are the output folder's
    made_by_settings: bool  # project.yaml makes this run now
    settings_hash: str | None
    settings_source: str  # where its settings come from: its export, its training, or matched by its training
    kept_gguf: str | None  # its own copy of its GGUF, as stored (relative to the project)
    kept_report: bool
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, val centred cosine), 0: untrained
    diff: list[KeyDiff] | None = None  # against project.yaml now; None when its settings are unknown
    # Its lineage (checkpoints/lineage.json; lib/training/training_run.py): the run it continues (training.steps
    # raised after that one ended) and the step it started from; the steps it was planned to, and the count
    # training.steps was lowered to when it ended early (at ``step``). Its snapshot GGUFs (snapshots.json) and the
    # steps kept on disk (steps/; lib/output/snapshots.py, lib/training/kept_steps.py).
    parent: str | None = None
    parent_step: int | None = None
    planned_steps: int | None = None
    lowered_to: int | None = None
    snapshots: int = 0
    kept_steps: list[int] = field(default_factory=list)
    started_at: float | None = None
    # Its last validation: {step, and each of metrics.COMPARED and the worst row's index} (None: a score it did not
    # record, from before the score existed); {} before its first validation.
    last_scores: dict[str, float | int | None] = field(default_factory=dict)
    # Its kept report's prompt retrieval (metrics.RETRIEVAL_KEYS: the GGUF's, measured by the evaluation only); {}
    # without a kept report, None where the report is older than retrieval.
    gguf_retrieval: dict[str, float | int | None] = field(default_factory=dict)
    # A snapshot of this run, compared as a run (lib/runs/compare.py): {file, step, weights, run (the run's name),
    # validated (its torch scores at that step), evaluated (its GGUF was scored)}. None: the run itself.
    snapshot: dict | None = None

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["curve"] = [list(point) for point in self.curve]
        return doc


@dataclass(frozen=True)
class RunsView:
    root: Path
    runs: list[Run]
    current: str | None  # the fingerprint checkpoints/final.json names
    settings_fingerprint: str | None  # the run project.yaml makes now (it may not exist yet)
    settings_error: str | None = None

    def to_json(self) -> dict:
        made = next((r.name for r in self.runs if r.made_by_settings), None)
        return {"project": str(self.root), "current": self.current, "settings_fingerprint": self.settings_fingerprint,
                "settings_run": made, "settings_error": self.settings_error,
                "runs": [{**r.to_json(), "lineage": lineage_lines(r, self)} for r in self.runs],
                "compare_default": [r.fingerprint for r in default_compared(self)]}


def lineage_lines(run: Run, view: RunsView) -> list[str]:
    """What a run's row does not say: the run it continues, an early end, its snapshots and kept steps (#57); as
    `gguf-trainer runs` prints them under its table and the studio's Runs table shows them."""
    names = {r.fingerprint: r.name for r in view.runs}
    lines = []
    if run.parent:
        lines.append(f"continues {names.get(run.parent, run.parent)} from step {run.parent_step or '?'} "
                     f"(training.steps raised to {run.planned_steps or run.steps or '?'})")
    if run.lowered_to is not None:
        lines.append(f"ended at step {run.step}: training.steps lowered to {run.lowered_to} (it was planned to "
                     f"{run.planned_steps or run.steps or '?'})")
    if run.snapshots or run.kept_steps:
        kept = len(run.kept_steps)
        lines.append(f"{run.snapshots} snapshot{'' if run.snapshots == 1 else 's'}, {kept} kept step"
                     f"{'' if kept == 1 else 's'}" + (f" ({', '.join(map(str, run.kept_steps))})" if kept else ""))
    return lines


def shown_value(value: Any) -> str:
    """A setting's value as project.yaml writes it, cut short when long."""
    from gguf_assets.lib.project.settings import yaml_value

    text = yaml_value(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- reading the runs ---------------------------------------------------------------------

def run_dirs(paths: ProjectPaths) -> list[Path]:
    """The runs' folders (hidden ones are none: a deletion in progress, a temp folder)."""
    root = paths.root / "checkpoints"
    return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")) if root.is_dir() else []


def disk_usage(folders: list[Path]) -> tuple[int, int]:
    """(bytes the files under ``folders`` take on the disk, bytes deleting them would free): a file linked from
    elsewhere too is counted once and frees nothing."""
    seen: dict[tuple[int, int], list] = {}
    for folder in folders:
        for dirpath, _, files in os.walk(folder):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                seen.setdefault((st.st_dev, st.st_ino), [st, 0])[1] += 1
    used = sum(st.st_blocks * 512 for st, _ in seen.values())
    freed = sum(st.st_blocks * 512 for st, links in seen.values() if links >= st.st_nlink)
    return used, freed


def tensorboard_folders(paths: ProjectPaths, fingerprint: str, training: dict | None) -> list[Path]:
    folders = [paths.root / TENSORBOARD_DIR / fingerprint]  # a run's from before runs had names
    if training:
        folders.append(paths.root / TENSORBOARD_DIR / _base_name(training, fingerprint))
    return [f for f in folders if f.is_dir()]


def _base_name(training: dict | None, fingerprint: str) -> str:
    try:
        return run_name(SimpleNamespace(**training), fingerprint)
    except (TypeError, AttributeError, ValueError):
        return f"run-{fingerprint[:8]}"


def _label(run_dir: Path) -> str:
    try:
        return (run_dir / LABEL_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _checkpoint_step(run_dir: Path) -> int:
    return max((int(m.group(1)) for d in run_dir.iterdir() if (m := STEP_DIR.match(d.name))), default=0)


def _estimated_seconds(history: list[dict]) -> float | None:
    """A run's training time from its log lines (steps since the previous line / steps per second)."""
    total, previous, any_line = 0.0, 0, False
    for entry in history:
        if isinstance(entry.get("steps_per_s"), (int, float)) and entry["steps_per_s"] > 0:
            total += (entry["step"] - previous) / entry["steps_per_s"]
            previous, any_line = entry["step"], True
    return round(total, 1) if any_line else None


def _run_settings(paths: ProjectPaths, fingerprint: str, meta: dict | None, kept: dict | None,
                  session: dict | None, manifest: dict) -> tuple[Settings | None, str | None, str]:
    """The settings snapshot a run was made under, its hash and where that comes from. The kept export's (and
    its report's) comes first: its files were made under it. A run from before runs recorded their settings is
    matched to the snapshot whose training section is the one its checkpoints record."""
    candidates = []
    if kept:
        candidates += [((kept.get("report") or {}).get("settings_hash"), "its report"),
                       (kept["sidecar"].get("settings_hash"), "its export")]
    candidates += [((meta or {}).get("settings_hash"), "its training"),
                   ((session or {}).get("settings_hash"), "its training")]
    if manifest.get("fingerprint") == fingerprint:
        candidates.append((manifest.get("settings_hash"), "its adapter record"))
    for digest, source in candidates:
        settings = settings_history.recall(paths.root, digest)
        if settings is not None:
            return settings, digest, source
    training = (meta or {}).get("training")
    folder = paths.root / settings_history.SETTINGS_DIR
    if not training or not folder.is_dir():
        return None, None, ""
    matches = []
    for snapshot in folder.glob("*.json"):
        settings = settings_history.recall(paths.root, snapshot.stem)
        if settings is not None and settings.section_dict("training") == training:
            matches.append((snapshot.stat().st_mtime, snapshot.stem, settings))
    if not matches:
        return None, None, ""
    _, digest, settings = max(matches, key=lambda m: m[:2])
    return settings, digest, "matched by its training settings (it ran before runs recorded theirs)"


def settings_diff(run: Settings, now: Settings) -> list[KeyDiff]:
    """The keys whose values differ between a run's settings and ``now``, in project.yaml's order; each marked
    with whether setting it alone to the run's value changes a result (lib/status/stages.stage_settings)."""
    base = stage_settings(now)
    out = []
    for section in SECTIONS:
        theirs, ours = run.section_dict(section), now.section_dict(section)
        for key, value in theirs.items():
            if ours.get(key) == value:
                continue
            try:
                result = stage_settings(replace(now, **{section: {key: getattr(getattr(run, section), key)}})) != base
            except Exception:  # noqa: BLE001  a stage that cannot be described without this key reads it
                result = True
            out.append(KeyDiff(f"{section}.{key}", value, ours.get(key), result))
    return out


def _state(run_dir: Path, final: bool, session: dict | None, step: int, steps: int | None) -> tuple[RunState, str]:
    of = f" of {steps}" if steps else ""
    if final:
        return RunState.FINISHED, ""
    state = (session or {}).get("state")
    if state == RunOutcome.RUNNING:
        alive = session_alive(session)
        if alive:
            return RunState.RUNNING, f"training now (pid {session['pid']}), at its checkpoint of step {step}{of}"
        if alive is None:
            return RunState.PARTIAL, (f"trained to step {step}{of} on another machine (a cluster worker), which may "
                                      "still train it or was cut off; this machine cannot tell")
        return RunState.PARTIAL, (f"cut off at step {step}{of}: its training process is gone (a kill or a reboot); "
                                  "its checkpoint is kept")
    if state == RunOutcome.STOPPED:
        return RunState.STOPPED, f"{session.get('message') or 'stopped'}; its checkpoint of step {step} is kept"
    if state == RunOutcome.FAILED:
        return RunState.FAILED, f"failed at step {session.get('step', step)}: {session.get('message', '')}"
    damaged = " (its finished weights were damaged and set aside)" if (run_dir / "final.damaged").is_dir() else ""
    return RunState.PARTIAL, f"trained to step {step}{of}{damaged}"


def _read_run(paths: ProjectPaths, run_dir: Path, *, now: Settings | None, manifest: dict,
              settings_fp: str | None, standing: list[str]) -> Run:
    fingerprint = run_dir.name
    meta = newest_meta(run_dir)
    final = (run_dir / FINAL_DIR / META_FILE).is_file() and meta is not None and meta.get("finished") is True
    session = read_session(run_dir)
    kept = read_kept(paths, fingerprint)
    settings, digest, source = _run_settings(paths, fingerprint, meta, kept, session, manifest)
    training = (meta or {}).get("training") or (settings.section_dict("training") if settings else None)
    steps = (training or {}).get("steps")
    step = int(meta["step"]) if final else _checkpoint_step(run_dir)
    state, detail = _state(run_dir, final, session, step, steps)
    if final:  # a run a lowered training.steps ended says so, not "finished" at a count it never reached
        detail = ended_early(meta) or detail
    best = (meta or {}).get("best") or {}
    history = history_to_the_end(meta)
    seconds = (meta or {}).get("train_seconds")
    estimated = seconds is None
    if estimated:
        seconds = _estimated_seconds(history)
    untrained = (meta or {}).get("untrained_val_centred_cosine", (meta or {}).get("untrained"))
    curve = ([(0, float(untrained))] if isinstance(untrained, (int, float)) else []) + validation_curve(history)
    last = next((e for e in reversed(history) if isinstance(e, dict) and metrics.VAL_CENTRED_COSINE in e), None)
    last_scores = {} if last is None else {"step": last.get("step"), **{k: last.get(k) for k in LAST_SCORE_KEYS}}
    report = (kept or {}).get("report") or {}
    used, _ = disk_usage([run_dir, *tensorboard_folders(paths, fingerprint, training)])
    return Run(
        fingerprint=fingerprint, name=_base_name(training, fingerprint), label=_label(run_dir), state=state,
        detail=detail, step=step, steps=steps, best_step=best.get("step"),
        best_val_centred_cosine=best.get(VAL_CENTRED_COSINE),
        final_val_centred_cosine=meta.get(VAL_CENTRED_COSINE) if final else None,
        gguf_val_centred_cosine=report.get(VAL_CENTRED_COSINE), train_seconds=seconds,
        seconds_estimated=estimated and seconds is not None, disk_bytes=used,
        current=manifest.get("fingerprint") == fingerprint,
        made_by_settings=fingerprint == settings_fp or fingerprint in standing,
        settings_hash=digest, settings_source=source,
        kept_gguf=paths.stored(kept_gguf(paths, fingerprint, kept)) if kept else None,
        kept_report=bool(kept and kept.get("report")), curve=curve,
        diff=settings_diff(settings, now) if settings is not None and now is not None else None,
        started_at=(meta or {}).get("started_at"), last_scores=last_scores,
        gguf_retrieval={key: report.get(key) for key in metrics.RETRIEVAL_KEYS} if report else {})


def _with_lineage(paths: ProjectPaths, run: Run, lineage: dict[str, dict]) -> Run:
    """``run`` with its lineage entry, and its snapshots and kept steps counted (Run's fields say which)."""
    from gguf_assets.lib.output.snapshots import read_snapshots
    from gguf_assets.lib.training.kept_steps import kept_steps

    run_dir = paths.checkpoints_dir(run.fingerprint)
    entry = lineage.get(run.fingerprint, {})
    parent, parent_step = entry.get("parent"), None
    if parent:  # the step its first session restored: recorded by the trainer, else how far the parent got
        started = (newest_meta(run_dir) or {}).get("started") or {}
        parent_step = started.get("from_step") if isinstance(started.get("from_step"), int) else (
            reached_step(paths.checkpoints_dir(parent)) or None)
    lowered = entry.get("lowered_to")
    return run_with(run, parent=parent, parent_step=parent_step, planned_steps=entry.get("planned_steps"),
                 lowered_to=lowered if isinstance(lowered, int) else None,
                 snapshots=len(read_snapshots(run_dir)), kept_steps=kept_steps(run_dir))


def _unique_names(runs: list[Run]) -> list[Run]:
    """Names end in the fingerprint's first 8 characters; two runs that share them get their whole fingerprint."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.name] = counts.get(run.name, 0) + 1
    return [run if counts[run.name] == 1 else run_with(run, name=run.name[: -8] + run.fingerprint) for run in runs]


def run_with(run: Run, **changes) -> Run:
    from dataclasses import replace as dc_replace

    return dc_replace(run, **changes)


def made_by(paths: ProjectPaths, settings: Settings) -> tuple[str | None, list[str]]:
    """(the training run ``settings`` make now, every run they stand for: training_run.standing_runs, which holds
    more than one where a continuation was lowered back to its parent's count); (None, []) before there are shards
    to plan, or with a damaged record (status says which)."""
    try:
        materials = load_manifest(paths)
        fps = [shard_fingerprints(paths, settings, materials, split) for split in SPLITS]
        return run_fingerprint(paths, settings, *fps), [r.fingerprint for r in standing_runs(paths, settings, *fps)]
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None, []


def list_runs(paths: ProjectPaths, now: Settings | None, *, settings_error: str | None = None) -> RunsView:
    """Every run of the project, oldest first. ``now``: project.yaml's settings (None when it does not load: the
    runs are listed without a diff)."""
    try:
        manifest = atomic.read_json(paths.adapter_manifest)
    except (OSError, ValueError):
        manifest = {}
    manifest = manifest if isinstance(manifest, dict) else {}
    settings_fp, standing = made_by(paths, now) if now is not None else (None, [])
    lineage = {entry["run"]: entry for entry in read_lineage(paths)}
    started = list(lineage)  # the order runs started in: a continuation made before runs recorded its own start
    runs = [_with_lineage(paths, _read_run(paths, d, now=now, manifest=manifest, settings_fp=settings_fp,
                                           standing=standing), lineage)
            for d in run_dirs(paths)]
    # (time stamped with its parent's) still comes after its parent
    runs.sort(key=lambda r: (r.started_at is None, r.started_at or 0.0,
                             started.index(r.fingerprint) if r.fingerprint in started else len(started), r.name))
    return RunsView(paths.root, _unique_names(runs), manifest.get("fingerprint"), settings_fp, settings_error)


def read_runs(paths: ProjectPaths) -> RunsView:
    """``list_runs`` under project.yaml as it is now (listed without a diff, and saying why, when it does not load)."""
    from gguf_assets.lib.project.settings import load_settings

    try:
        return list_runs(paths, load_settings(paths.root))
    except SettingsError as exc:
        return list_runs(paths, None, settings_error=str(exc))


def find_run(view: RunsView, ref: str) -> Run:
    """The run ``ref`` names: its name, its fingerprint, its label, or the start of its name or fingerprint."""
    ref = (ref or "").strip()
    names = ", ".join(r.name for r in view.runs) or "none yet"
    for candidates in ([r for r in view.runs if ref in (r.name, r.fingerprint)],
                       [r for r in view.runs if r.label and r.label == ref],
                       [r for r in view.runs if len(ref) >= 4 and (r.name.startswith(ref)
                                                                    or r.fingerprint.startswith(ref))]):
        if len(candidates) == 1:
            return candidates[0]
        if len(candidates) > 1:
            raise RunsError(f"{ref!r} names several runs ({', '.join(r.name for r in candidates)}); give a whole name "
                            "or fingerprint")
    raise RunsError(f"no run {ref!r} in {view.root / 'checkpoints'}; its runs: {names} "
                    f"(`{trainer('runs', view.root)}` lists them)")


def default_compared(view: RunsView) -> list[Run]:
    """The runs Compare starts with, two different ones: the newest and the run it continues, else the newest and
    the other run with the best validation; the newest alone when it is the only run."""
    if not view.runs:
        return []
    newest = view.runs[-1]
    others = [r for r in view.runs if r.fingerprint != newest.fingerprint]
    partner = next((r for r in others if r.fingerprint == newest.parent), None) or max(
        others, key=lambda r: (r.best_val_centred_cosine is not None, r.best_val_centred_cosine or 0.0), default=None)
    return [partner, newest] if partner is not None else [newest]
