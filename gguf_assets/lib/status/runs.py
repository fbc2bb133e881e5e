"""Training runs: list, compare, label, go back to and delete them (`gguf-trainer runs`, the studio's Runs panel).

Every training fingerprint is a run: its folder ``checkpoints/<fingerprint>/`` holds its checkpoints, best/ and
final/ (lib/training/checkpoints.py), how its last training session ended (session.json), the label a user gave
it (label.txt) and its own exported GGUF and report (export/, lib/output/kept.py). Everything here is derived
from those files and the settings snapshots they name (lib/project/settings_history.py): there is no list of
runs beside them.

- A run's **name** is its TensorBoard run's (lib/telemetry/curves_log.run_name): shape, steps, learning rate and
  the fingerprint's start, e.g. ``64x1-400steps-lr0.004-e82b5612``; stable, as it is made of what the run is.
- **current**: the run whose GGUF and report are in the output folder (checkpoints/final.json names it).
- **Use** (``use_run``) puts the settings that decide a run's result back into project.yaml (in place, comments
  kept, refused when the file changed since it was read), then makes its kept GGUF and report current again.
- **Delete** (``delete_run``) renames the run's folder aside, then removes it; never the current run's.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gguf_assets.lib.core import atomic, metrics
from gguf_assets.lib.core.commands import trainer
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.lock import ProjectLock
from gguf_assets.lib.core.metrics import VAL_CENTRED_COSINE
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.output.export_run import exported_files_unchanged, gguf_path
from gguf_assets.lib.output.kept import NotRestorable, keep_current, kept_gguf, read_kept, restore_kept
from gguf_assets.lib.precompute.shards import shard_fingerprints
from gguf_assets.lib.project import settings_file, settings_history
from gguf_assets.lib.project.layout import (
    DELETING_DIR,
    FINAL_DIR,
    LABEL_FILE,
    META_FILE,
    SPLITS,
    STEP_DIR,
    ProjectPaths,
)
from gguf_assets.lib.project.manifests import recorded_fingerprint
from gguf_assets.lib.project.presets import set_keys
from gguf_assets.lib.project.settings import (
    SECTIONS,
    Settings,
    SettingsError,
    replace,
    settings_from_text,
    shown_setting,
)
from gguf_assets.lib.status.stages import INPUT_STAGES, TRAINING_STAGES, expected_fingerprints, stage_settings
from gguf_assets.lib.status.states import State, project_status
from gguf_assets.lib.telemetry.curves_log import TENSORBOARD_DIR, run_name
from gguf_assets.lib.telemetry.render import compare_panels_svg, compare_svg
from gguf_assets.lib.training.training_run import (
    RunOutcome,
    ended_early,
    final_weights_intact,
    history_to_the_end,
    newest_meta,
    reached_step,
    read_lineage,
    read_session,
    record_finished_run,
    run_fingerprint,
    session_alive,
    standing_runs,
)
from gguf_assets.lib.training.verdict import validation_curve

LABEL_MAX_CHARS = 200
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


def _tensorboard_folders(paths: ProjectPaths, fingerprint: str, training: dict | None) -> list[Path]:
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
    used, _ = disk_usage([run_dir, *_tensorboard_folders(paths, fingerprint, training)])
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
    return _with(run, parent=parent, parent_step=parent_step, planned_steps=entry.get("planned_steps"),
                 lowered_to=lowered if isinstance(lowered, int) else None,
                 snapshots=len(read_snapshots(run_dir)), kept_steps=kept_steps(run_dir))


def _unique_names(runs: list[Run]) -> list[Run]:
    """Names end in the fingerprint's first 8 characters; two runs that share them get their whole fingerprint."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.name] = counts.get(run.name, 0) + 1
    return [run if counts[run.name] == 1 else _with(run, name=run.name[: -8] + run.fingerprint) for run in runs]


def _with(run: Run, **changes) -> Run:
    from dataclasses import replace as dc_replace

    return dc_replace(run, **changes)


def _made_by(paths: ProjectPaths, settings: Settings) -> tuple[str | None, list[str]]:
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
    settings_fp, standing = _made_by(paths, now) if now is not None else (None, [])
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


# -- changing them ------------------------------------------------------------------------

def label_run(paths: ProjectPaths, ref: str, text: str) -> Run:
    """Give a run a label (one line; empty removes it), stored atomically in its folder."""
    label = " ".join(str(text).split())
    if len(label) > LABEL_MAX_CHARS:
        raise RunsError(f"a run's label is one line of at most {LABEL_MAX_CHARS} characters; this one has "
                        f"{len(label)}")
    run = find_run(read_runs(paths), ref)
    file = paths.checkpoints_dir(run.fingerprint) / LABEL_FILE
    if label:
        atomic.write_text(file, label + "\n")
    else:
        file.unlink(missing_ok=True)
        atomic.fsync_dir(file.parent)
    return _with(run, label=label)


@dataclass(frozen=True)
class Deleted:
    name: str
    fingerprint: str
    freed_bytes: int


def _remove_aside(folder: Path) -> None:
    """Rename ``folder`` into its parent's .deleting/ (one atomic step: it is no run from then on), then remove it."""
    aside_root = folder.parent / DELETING_DIR
    aside = aside_root / folder.name
    aside_root.mkdir(exist_ok=True)
    if aside.exists():  # a deletion a kill cut off
        shutil.rmtree(aside)
    os.replace(folder, aside)
    atomic.fsync_dir(folder.parent)
    shutil.rmtree(aside)
    try:
        aside_root.rmdir()
    except OSError:
        pass


def delete_run(paths: ProjectPaths, ref: str) -> Deleted:
    """Remove a run's folder (and its TensorBoard events); never the current run's, nor one that trains now."""
    with ProjectLock(paths.lock_file, describe="gguf-trainer runs --delete"):
        view = read_runs(paths)
        run = find_run(view, ref)
        if run.current:
            raise RunsError(f"{run.name} is the current run: the output folder's GGUF and report are its, so it is "
                            f"not deleted. Make another run current first (`{trainer('runs', paths.root)} --use "
                            "RUN`), then delete this one.")
        if run.state == RunState.RUNNING:
            raise RunsError(f"{run.name} is training now ({run.detail}); stop it first, then delete it.")
        run_dir = paths.checkpoints_dir(run.fingerprint)
        meta = newest_meta(run_dir)
        folders = [run_dir, *_tensorboard_folders(paths, run.fingerprint, (meta or {}).get("training"))]
        _, freed = disk_usage(folders)
        for folder in folders:
            _remove_aside(folder)
    return Deleted(run.name, run.fingerprint, freed)


@dataclass(frozen=True)
class Used:
    run: Run
    changed: list[str]  # the project.yaml keys set, "key old → new"
    left: list[str]  # keys that differ but change no result (device, cadence): left as project.yaml has them
    restored: list[str]  # the files put back into the output folder (as stored)
    next_run: str  # what the next `gguf-trainer run` does for it
    settings_sha256: str  # project.yaml's sha256 now (the studio's next edit is made on it)
    stages: list[str]  # the stages whose results are the run's now, without a run (Dagster is told: the callers)
    settings: Settings  # project.yaml's settings now

    def to_json(self) -> dict:
        return {"run": self.run.to_json(), "changed": self.changed, "left": self.left, "restored": self.restored,
                "next_run": self.next_run, "settings_sha256": self.settings_sha256, "stages": self.stages}


def _training_only(run: Run, now: Settings, paths: ProjectPaths) -> Settings:
    """A run whose settings snapshot is gone: its training section (its checkpoints record it) on ``now``."""
    meta = newest_meta(paths.checkpoints_dir(run.fingerprint)) or {}
    if not meta.get("training"):
        raise RunsError(f"{run.name} recorded no settings (it has no checkpoint yet), so there is nothing to go back "
                        "to")
    return replace(now, training=meta["training"])


def use_run(paths: ProjectPaths, ref: str, *, base_sha256: str | None = None,
            seen: settings_file.SeenTexts | None = None) -> Used:
    """Go back to a run: set the project.yaml keys that decide its result to its values (in place, comments
    kept; refused with SettingsChanged when the file is no longer the text ``base_sha256`` names), then make
    its finished weights, its kept GGUF and its kept report current again, without training or exporting.

    The output folder's GGUF and report are kept with their own run first, so they stay listed and can come
    back the same way. A run that cannot be what its settings make now (its shards changed since) is refused
    before anything is written."""
    with ProjectLock(paths.lock_file, describe="gguf-trainer runs --use"):
        text = settings_file.read(paths.project_file)
        now = settings_from_text(paths.project_file, text.text)
        view = list_runs(paths, now)
        run = find_run(view, ref)
        if run.state == RunState.RUNNING:
            raise RunsError(f"{run.name} is training now ({run.detail}); wait for it, or stop it, then use it.")
        run_settings = settings_history.recall(paths.root, run.settings_hash) or _training_only(run, now, paths)
        diffs = settings_diff(run_settings, now)
        changes: dict[str, dict] = {}
        for d in diffs:
            if d.result:
                section, key = d.key.split(".", 1)
                changes.setdefault(section, {})[key] = d.run
        new_text = set_keys(text.text, changes) if changes else text.text
        new = settings_from_text(paths.project_file, new_text)
        now_stages, new_stages = stage_settings(now), stage_settings(new)
        # When "use" would change the inputs' settings, the next run makes the materials or the corpus again first,
        # and only then can it be known whether that reproduces the run.
        upstream_changes = [s for s in INPUT_STAGES if now_stages[s] != new_stages[s]]
        expected: dict[str, str] = {}
        if not upstream_changes:
            try:
                expected = expected_fingerprints(paths, new)
            except (OSError, ValueError, KeyError, TypeError, UserError):
                expected = {}
            if expected.get("adapter") not in (None, run.fingerprint) and run.fingerprint in _made_by(paths, new)[1]:
                # project.yaml stands for it and for the current run (a continuation lowered back to this run's
                # count): it becomes the current one, and the one the settings mean from then on.
                expected = expected_fingerprints(paths, new, adapter_fp=run.fingerprint)
            if expected.get("adapter") not in (None, run.fingerprint):
                why = ("its shards changed since it trained (the materials, the prompts or a shard)"
                       if run.settings_source.startswith("its") else
                       f"its settings were {run.settings_source}, and they do not make it, or its shards changed")
                raise RunsError(f"{run.name} cannot come back: its settings now make another training run "
                                f"({expected['adapter']}): {why}. Nothing was changed.")
        if not changes and run.current and all(s.state == State.CURRENT for s in project_status(paths, now)):
            return Used(run=run, changed=[], left=[d.key for d in diffs], restored=[],
                        next_run="nothing: it is the current run, and every stage is current",
                        settings_sha256=text.sha256, stages=[], settings=now)
        keep_current(paths, now)  # what the output folder holds now stays with its run, listed
        saved = settings_file.SettingsText(text.text, text.sha256)
        if changes:
            saved = settings_file.save_if_unchanged(paths.project_file, paths.dagster_home, new_text,
                                                    base_sha256 or text.sha256, seen)
        settings_hash = settings_history.remember(paths.root, new)
        restored, next_run, stages = _make_current(paths, new, run, expected, settings_hash, upstream_changes)
    return Used(run=_with(run, current=bool(stages) or run.current, made_by_settings=not upstream_changes),
                changed=[f"{d.key} {shown_value(d.now)} → {shown_value(d.run)}" for d in diffs if d.result],
                left=[d.key for d in diffs if not d.result], restored=restored, next_run=next_run,
                settings_sha256=saved.sha256, stages=stages, settings=new)


def _make_current(paths: ProjectPaths, settings: Settings, run: Run, expected: dict[str, str], settings_hash: str,
                  upstream_changes: list[str]) -> tuple[list[str], str, list[str]]:
    """Point checkpoints/final.json at the finished run and put its kept files back; (what was restored, what the
    next `gguf-trainer run` does, the stages whose results are this run's now)."""
    if upstream_changes:
        return [], (f"the next `gguf-trainer run` makes the {' and '.join(upstream_changes)} again (its settings for "
                    "them differ), then the shards; training is reused when they make this run again"), []
    if run.state != RunState.FINISHED:
        return [], (f"it is {run.state} at step {run.step}: the next `gguf-trainer run` continues its training from "
                    "there"), []
    if expected.get("adapter") != run.fingerprint:
        return [], "the next `gguf-trainer run` makes what it needs first (no corpus or shards yet)", []
    run_dir = paths.checkpoints_dir(run.fingerprint)
    if not final_weights_intact(run_dir):
        return [], ("its finished weights changed on disk since training wrote them: the next `gguf-trainer run` "
                    "trains its last steps again from its newest intact checkpoint"), []
    record_finished_run(paths, run.fingerprint, settings_hash=settings_hash,
                        val_centred_cosine=run.final_val_centred_cosine)
    sidecar = gguf_path(paths, settings).with_suffix(".json")
    if recorded_fingerprint(sidecar) == expected["gguf"] and exported_files_unchanged(paths, settings) and \
            recorded_fingerprint(paths.report_json(settings)) == expected.get("eval_report"):
        return [paths.stored(paths.adapter_manifest)], \
            "nothing: its GGUF and report were in the output folder already", list(TRAINING_STAGES)
    try:
        done = restore_kept(paths, settings, run.fingerprint, gguf_fp=expected["gguf"],
                            report_fp=expected.get("eval_report"))
    except NotRestorable as exc:
        return [paths.stored(paths.adapter_manifest)], (
            f"its GGUF was not restored ({exc}): the next `gguf-trainer run` exports and evaluates it again from its "
            "finished weights, without training"), ["adapter"]
    restored = [paths.stored(paths.adapter_manifest), paths.stored(done.gguf), *(paths.stored(c) for c in done.copies)]
    if done.report is None:
        return restored, "its report was not kept: the next `gguf-trainer run` evaluates its GGUF again", \
            ["adapter", "gguf"]
    return [*restored, paths.stored(done.report)], "nothing: its adapter, GGUF and report are current", \
        list(TRAINING_STAGES)


# -- comparing ----------------------------------------------------------------------------

def _compared(view: RunsView, refs: list[str]) -> list[Run]:
    runs = [find_run(view, ref) for ref in refs]
    if len({r.fingerprint for r in runs}) < len(runs):
        raise RunsError(f"{', '.join(refs)} name the same run twice; compare two different runs")
    return runs


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


def _shown_name(run: Run) -> str:
    return f"{run.name} ({run.label})" if run.label else run.name


# The charts of compared runs leave the untrained adapter's score (step 0) out: near 0 below validations near 0.9, it
# would flatten every difference between the runs. The table and the JSON keep it.
DRAWN_FROM = "from the first validation; the untrained step 0 is left out"


def _drawn(run: Run, runs: list[Run], points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The points of ``run``'s curve a comparison chart draws: none at step 0, and for a continuation compared with
    the run it continues, none before the step it went on from (that history is the parent's, drawn once, as the
    parent's line; the continuation's starts where it left it)."""
    shared_to = run.parent_step if run.parent and any(r.fingerprint == run.parent for r in runs) else None
    return [(x, y) for x, y in points if x > 0 and (shared_to is None or x >= shared_to)]


def compare_runs(view: RunsView, refs: list[str]) -> tuple[list[Run], str]:
    """The runs ``refs`` name and their val centred cosine curves overlaid (SVG; lib/telemetry/render.py)."""
    runs = _compared(view, refs)
    return runs, compare_svg({_shown_name(r): _drawn(r, runs, r.curve) for r in runs},
                             title=f"val centred cosine ({DRAWN_FROM})")


def score_curves(root: Path, run: Run) -> dict[str, list[tuple[int, float]]]:
    """Each of metrics.COMPARED's scores over the run's validations, (step, value) in step order, from its newest
    record (a run still training: its newest checkpoint's); val centred cosine starts at the untrained adapter's
    (step 0). A score a validation did not record (from before it existed) has no point there."""
    history = (newest_meta(ProjectPaths.of(root).checkpoints_dir(run.fingerprint)) or {}).get("history") or []
    curves = {score.key: sorted((int(e["step"]), float(e[score.key])) for e in history
                                if isinstance(e, dict) and "step" in e and isinstance(e.get(score.key), (int, float)))
              for score in metrics.COMPARED}
    curves[metrics.VAL_CENTRED_COSINE] = list(run.curve)
    return curves


@dataclass(frozen=True)
class Comparison:
    """Runs side by side: each run's score curves ({score key: {shown name: [(step, value)]}}), and the SVG of them,
    one chart per score."""

    runs: list[Run]
    curves: dict[str, dict[str, list[tuple[int, float]]]]
    svg: str

    def to_json(self) -> dict:
        return {"runs": [r.to_json() for r in self.runs], "svg": self.svg,
                "scores": {key: {name: [list(p) for p in points] for name, points in by_run.items()}
                           for key, by_run in self.curves.items()}}


def compare_scores(view: RunsView, refs: list[str]) -> Comparison:
    """The runs ``refs`` name (one or more), each compared score step by step (`gguf-trainer runs --compare`)."""
    runs = _compared(view, refs)
    per_run = [(_shown_name(r), score_curves(view.root, r)) for r in runs]
    curves = {score.key: {name: run_curves[score.key] for name, run_curves in per_run} for score in metrics.COMPARED}
    titles = {score.key: score.label + ("" if score.higher_is_better else " (lower is better)")
              for score in metrics.COMPARED}
    drawn = {titles[key]: {name: _drawn(run, runs, by_run[name]) for run, (name, _) in zip(runs, per_run)}
             for key, by_run in curves.items()}
    return Comparison(runs, curves, compare_panels_svg(drawn))
