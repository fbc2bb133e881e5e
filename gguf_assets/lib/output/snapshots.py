"""Snapshots: a usable GGUF of the adapter at any step, while training runs or after it stopped or finished.

`gguf-trainer snapshot DIR [--step N | --best] [--eval]` (and the studio's Snapshot button) take:
- **newest** (the default): while the run trains, the trainer keeps its current step at once (validated and
  checkpointed, a few seconds; the run goes on unchanged, lib/training/kept_steps.py); after a stop, the newest
  checkpoint; after the end, the final weights;
- **best**: the best validated weights so far (best/);
- **step N**: a kept step (training.keep_steps_*), a checkpoint still on disk or the final step, of this run or of a
  run it continues; anything else is refused with the steps that can be taken (``lineage_snapshots``, below, which
  the lists read too).

Every source but best goes through a kept step (the judged weights, validated at that step) and is exported from
it, so a GGUF made later from a kept step is byte-identical to the snapshot taken at that step. The file is
``<output>/<adapter name>-step<N>.gguf`` (``-best-step<N>`` for best) in ggk's format, its provenance naming the
trained and planned steps, the weights it holds (``step<N>`` or ``best``) and their val scores; ``--eval`` scores it
on the val shards as the export's evaluation does (on the CPU: the torch-free evaluator). The run's snapshots are
listed in ``checkpoints/<run>/snapshots.json`` (`runs` and the studio show them).

Best at the run's final step holds the final weights, which the run's own GGUF holds already: its file is a hard
link to that GGUF (no second copy; deleting either name leaves the other), recorded as ``same_file_as``.

The lists (`gguf-trainer snapshot --list`, the studio's Snapshots list), a refused ``--step`` and a delete all read
``lineage_snapshots``: the steps a snapshot can take and the snapshot GGUFs, of the run the settings make and every
run it continues (#65). They once disagreed: the list printed one run's kept steps, the refusal its checkpoints and
final step too, and neither the parent's of a continuation (training.steps raised, lib/training/training_run.py's
lineage), whose steps and GGUFs stay in the parent's folder. A snapshot GGUF is named by its file, unique in the
output folder: a delete removes exactly the file it names, and every record of it (``delete_snapshot``).
"""

from __future__ import annotations

import io
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.core.metrics import (
    EMPTY_PROMPT_COSINE,
    RETRIEVAL_KEYS,
    VAL_CENTRED_COSINE,
    VAL_LOSS,
    VAL_REL_MSE,
    VAL_RMS_COSINE,
)
from gguf_assets.lib.output.snapshot_names import remove_dead_snapshot_temps, snapshot_path  # noqa: F401
from gguf_assets.lib.project.layout import (
    BEST_DIR,
    FINAL_DIR,
    META_FILE,
    STATE_FILE,
    STEP_DIR,
    WEIGHTS_FILE,
    ProjectPaths,
    RecordPathError,
)
from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.training import kept_steps as kept
from gguf_assets.lib.training.training_run import (
    RunOutcome,
    parent_of,
    read_kept,
    read_lineage,
    read_session,
    session_alive,
)

log = logging.getLogger(__name__)

SNAPSHOTS_FILE = "snapshots.json"
NEWEST, BEST = "newest", "best"
# How long a snapshot waits for the running trainer to reach the end of its step (a step of a big adapter on a
# small GPU takes seconds; validation of a large val set, a minute).
ANSWER_TIMEOUT_S = 600.0
# What holds a step's weights, as the lists name it.
KEPT_FOR_SNAPSHOT, KEPT_ON_SCHEDULE, FINAL, CHECKPOINT = ("kept for a snapshot", "kept on the schedule",
                                                          "final weights", "checkpoint")
_PLURAL = {CHECKPOINT: "checkpoints"}


class SnapshotError(UserError, RuntimeError):
    """A snapshot that cannot be taken or deleted; the message says why and what to do."""


@dataclass(frozen=True)
class Source:
    """Where a snapshot's weights come from: a kept step, or best/."""

    folder: Path
    run_dir: Path  # the run of the lineage whose weights they are (its snapshots.json lists the GGUF)
    step: int
    weights_name: str  # what the GGUF's provenance calls them: step<N> or best
    asked: str  # what the user asked for: newest, best, step<N>


def read_snapshots(run_dir: Path) -> list[dict]:
    try:
        doc = atomic.read_json(run_dir / SNAPSHOTS_FILE)
    except (OSError, ValueError):
        return []
    entries = doc.get("snapshots", []) if isinstance(doc, dict) else []
    return [e for e in entries if isinstance(e, dict)]


def _write_snapshots(run_dir: Path, entries: list[dict]) -> None:
    def by_step(entry: dict) -> tuple[int, str]:  # an edited entry's step may be anything
        return (entry["step"] if isinstance(entry.get("step"), int) else -1, str(entry.get("file")))

    atomic.write_json(run_dir / SNAPSHOTS_FILE, {"snapshots": sorted(entries, key=by_step)})


def training_is_running(run_dir: Path) -> bool:
    session = read_session(run_dir)
    return bool(session) and session.get("state") == RunOutcome.RUNNING and session_alive(session) is not False


@dataclass(frozen=True)
class TakeableStep:
    """A step a snapshot can take: its weights are on disk in ``run``."""

    run: str
    step: int
    held_by: str  # KEPT_FOR_SNAPSHOT, KEPT_ON_SCHEDULE, FINAL or CHECKPOINT
    planned_steps: int | None
    scores: dict  # the val scores measured at that step (a kept step's meta), else empty


@dataclass(frozen=True)
class SnapshotFile:
    """A snapshot GGUF a run of the lineage lists, its path confined to the output folder."""

    run: str
    path: Path
    entry: dict

    @property
    def name(self) -> str:
        return self.path.name

    def same_file_as(self, paths: ProjectPaths) -> str | None:
        """The file this one is a hard link to (best at the final step: the run's own GGUF), while both names
        still lead to the same file; None otherwise."""
        other = self.entry.get("same_file_as")
        try:
            return other if other and os.path.samefile(self.path, paths.located(str(other))) else None
        except OSError:
            return None

    def evaluation(self, paths: ProjectPaths) -> dict:
        return snapshot_evaluation(paths, self.run, self.entry)


# The scores of an evaluation that a snapshot entry's "eval" holds (evaluate_snapshot's scalars).
_EVALUATION_KEYS = (VAL_CENTRED_COSINE, EMPTY_PROMPT_COSINE, VAL_REL_MSE, VAL_RMS_COSINE, *RETRIEVAL_KEYS)


def snapshot_evaluation(paths: ProjectPaths, run: str, entry: dict) -> dict:
    """The GGUF evaluation of the snapshot ``entry`` (in run ``run``'s snapshots.json): its own (``--eval``), or,
    for best at the final step (a hard link to the run's GGUF), the report the run kept, when it evaluated those
    very bytes (its GGUF's sha256 is the entry's); {} when nothing scored it."""
    if isinstance(entry.get("eval"), dict):
        return entry["eval"]
    if not entry.get("same_file_as") or not isinstance(entry.get("sha256"), str):
        return {}
    report = (read_kept(paths, run) or {}).get("report")
    if not isinstance(report, dict) or not report.get("evaluated") or report.get("gguf_sha256") != entry["sha256"]:
        return {}
    return {key: report.get(key) for key in _EVALUATION_KEYS} | {"by": "the run's report (the same file)"}


@dataclass(frozen=True)
class RefusedEntry:
    """A snapshots.json entry naming a file outside the output folder: never listed, opened or deleted."""

    run: str
    entry: dict
    error: RecordPathError


@dataclass(frozen=True)
class LineageSnapshots:
    runs: tuple[str, ...]  # the run the settings make, then the run it continues, and so on
    steps: tuple[TakeableStep, ...]  # by run (in ``runs`` order), then step
    files: tuple[SnapshotFile, ...]  # by step, then name
    refused: tuple[RefusedEntry, ...]

    def source(self, step: int) -> TakeableStep | None:
        """Where a snapshot of ``step`` takes its weights: this run's, else the nearest run it continues."""
        return next((s for s in self.steps if s.step == step), None)

    def newest(self) -> TakeableStep | None:
        """The newest step of the newest run that has one (a continuation not started yet: its parent's)."""
        for run in self.runs:
            own = [s for s in self.steps if s.run == run]
            if own:
                return own[-1]
        return None

    def steps_text(self) -> str:
        """The steps a snapshot can take, grouped by run and by what holds them, in one line:
        ``30, 35 (checkpoints), 40 (kept for a snapshot); of run <parent>, which this run continues: …``."""
        parts = []
        for i, run in enumerate(self.runs):
            described = _described([s for s in self.steps if s.run == run])
            if i == 0:
                parts.append(described or ("none of its own yet" if len(self.runs) > 1 else "none"))
            elif described:
                which = "this run" if i == 1 else f"run {self.runs[i - 1]}"
                parts.append(f"of run {run}, which {which} continues: {described}")
        return "; ".join(parts)

    def named(self, which: str | int) -> list[SnapshotFile]:
        """The snapshot files ``which`` names: a file name (a path's last part is enough), or a step (every file of
        it). A refused entry it names raises its RecordPathError: nothing is deleted when any is outside."""
        by_step = isinstance(which, int)
        name = None if by_step else Path(str(which)).name

        def matches(entry: dict, file_name: str) -> bool:
            return entry.get("step") == which if by_step else file_name == name

        for refused in self.refused:
            if matches(refused.entry, Path(str(refused.entry.get("file"))).name):
                raise refused.error
        return [f for f in self.files if matches(f.entry, f.name)]


def _described(steps: list[TakeableStep]) -> str:
    """``30, 35 (checkpoints), 40 (kept for a snapshot)``: each run of steps held alike, then what holds them."""
    groups: list[tuple[str, list[int]]] = []
    for s in steps:
        if groups and groups[-1][0] == s.held_by:
            groups[-1][1].append(s.step)
        else:
            groups.append((s.held_by, [s.step]))
    return ", ".join(f"{', '.join(map(str, numbers))} ({_PLURAL.get(held, held) if len(numbers) > 1 else held})"
                     for held, numbers in groups)


def run_chain(paths: ProjectPaths, run: str) -> list[str]:
    """``run``, then the run it continues, and so on (lineage.json; a loop in an edited file ends the chain)."""
    chain = [run]
    while (parent := parent_of(paths, chain[-1])) and parent not in chain:
        chain.append(parent)
    return chain


def _final_step(run_dir: Path) -> int | None:
    try:
        return int(atomic.read_json(run_dir / FINAL_DIR / META_FILE)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the run's checkpoints on disk (whole: their meta written last), from their folders' names."""
    folders = run_dir.iterdir() if run_dir.is_dir() else []
    return sorted(int(m.group(1)) for p in folders if (m := STEP_DIR.match(p.name)) and (p / META_FILE).is_file())


def takeable_steps(run_dir: Path, *, planned_steps: int | None = None) -> list[TakeableStep]:
    """The steps a snapshot can take in one run: its kept steps, its checkpoints on disk and its final step. A step
    held twice is named by what lasts: a kept step (checkpoints are pruned as training goes on), then final/."""
    held: dict[int, tuple[str, int | None, dict]] = {}
    for step in checkpoint_steps(run_dir):
        held[step] = (CHECKPOINT, planned_steps, {})
    if (final := _final_step(run_dir)) is not None:
        held[final] = (FINAL, planned_steps, {})
    for step in kept.kept_steps(run_dir):
        try:
            meta = kept.kept_step_meta(run_dir, step)
        except (OSError, ValueError):
            continue  # being removed (keep_steps_last) as it is read
        by = KEPT_ON_SCHEDULE if meta.get("kept_by") == kept.BY_SCHEDULE else KEPT_FOR_SNAPSHOT
        held[step] = (by, meta.get("planned_steps", planned_steps),
                      {k: meta.get(k) for k in (VAL_CENTRED_COSINE, EMPTY_PROMPT_COSINE, VAL_LOSS)})
    return [TakeableStep(run_dir.name, step, by, planned, scores)
            for step, (by, planned, scores) in sorted(held.items())]


def has_started(paths: ProjectPaths, run_dir: Path) -> bool:
    """Whether the run ``run_dir``, or a run it continues, has a folder (a snapshot may take its steps)."""
    return any(paths.checkpoints_dir(run).is_dir() for run in run_chain(paths, run_dir.name))


def lineage_snapshots(paths: ProjectPaths, run_dir: Path, output_dir: Path) -> LineageSnapshots:
    """The steps a snapshot can take and the snapshot GGUFs, of the run ``run_dir`` and every run it continues."""
    runs = run_chain(paths, run_dir.name)
    planned = {r["run"]: r.get("planned_steps") for r in read_lineage(paths)}
    steps: list[TakeableStep] = []
    files: list[SnapshotFile] = []
    refused: list[RefusedEntry] = []
    for each in runs:
        each_dir = paths.checkpoints_dir(each)
        steps += takeable_steps(each_dir, planned_steps=planned.get(each))
        for entry in read_snapshots(each_dir):
            if not isinstance(entry.get("step"), int):
                continue  # not a record this product wrote
            try:
                files.append(SnapshotFile(each, snapshot_file(paths, each_dir, entry, output_dir), entry))
            except RecordPathError as error:
                refused.append(RefusedEntry(each, entry, error))
    files.sort(key=lambda f: (f.entry["step"], f.name))
    return LineageSnapshots(tuple(runs), tuple(steps), tuple(files), tuple(refused))


def forget_file(paths: ProjectPaths, lineage: LineageSnapshots, path: Path) -> None:
    """Remove every lineage record of the snapshot GGUF ``path`` (deleted, or written again)."""
    for run in lineage.runs:
        records = [f.entry for f in lineage.files if f.run == run and f.path == path]
        if records:
            run_dir = paths.checkpoints_dir(run)
            _write_snapshots(run_dir, [e for e in read_snapshots(run_dir) if e not in records])


def record_snapshot(paths: ProjectPaths, run_dir: Path, entry: dict, *, source_run: Path, output_dir: Path) -> None:
    """List a snapshot GGUF just written in the snapshots.json of ``source_run`` (the run whose weights it holds),
    as its file's only record in the lineage of ``run_dir``: a file written again holds only its new weights."""
    forget_file(paths, lineage_snapshots(paths, run_dir, output_dir), paths.located(entry["file"]))
    _write_snapshots(source_run, [*read_snapshots(source_run), entry])


def _keep_from(run_dir: Path, step: int, settings: Settings, val_folders: list[Path], *, final: bool) -> None:
    """Make a kept step of ``step`` from its checkpoint, or final/ (``final``): its judged weights, validated as the
    trainer validates (the same figures, so the GGUF is the one a snapshot at that step gives)."""
    import torch
    from safetensors.torch import load as safetensors_load

    from gguf_assets.lib.output.export import peaks_device
    from gguf_assets.lib.training.adapter import Adapter, AdapterShape
    from gguf_assets.lib.training.checkpoints import read_recorded, save_weights
    from gguf_assets.lib.training.input_peaks import INPUT_PEAKS
    from gguf_assets.lib.training.train import evaluate

    folder = run_dir / FINAL_DIR if final else run_dir / f"step-{step:08d}"
    meta = atomic.read_json(folder / META_FILE)
    weights = safetensors_load(read_recorded(folder, WEIGHTS_FILE, meta))
    if folder.name != FINAL_DIR and meta.get("training", {}).get("ema_decay"):
        # A checkpoint holds the raw weights; the judged ones (the average) travel in its trainer state.
        state = torch.load(io.BytesIO(read_recorded(folder, STATE_FILE, meta)), weights_only=True, map_location="cpu")
        weights = state["ema"]
    model = Adapter(AdapterShape(**meta["shape"]))
    model.load_state_dict(weights)
    t = settings.training
    # On the training device where it is here (an adapter of the seed's shape takes about 1 s a val prompt on the
    # CPU: 18 minutes for 1,000); its memory is the adapter's and one val batch, beside a training run.
    device = peaks_device(settings)
    scores = evaluate(model.to(device), val_folders, device=device, cosine_weight=t.cosine_weight,
                      relational_weight=t.relational_weight)
    model.to("cpu")
    base = {k: v for k, v in meta.items() if k not in ("history", "sha256", "best", "per_shard", "verdict", "advice")}
    save_weights(kept.kept_step_dir(run_dir, step), model=model, step=step,
                 meta={**base, "step": step, "planned_steps": meta.get("planned_steps", t.steps),
                       "kept_by": kept.BY_REQUEST, VAL_CENTRED_COSINE: scores[VAL_CENTRED_COSINE],
                       EMPTY_PROMPT_COSINE: scores[EMPTY_PROMPT_COSINE], VAL_LOSS: scores[VAL_LOSS],
                       INPUT_PEAKS: scores[INPUT_PEAKS]})


def _best_dir(paths: ProjectPaths, lineage) -> Path:
    """best/ of the lineage: this run's, else the nearest run it continues (a continuation writes its own only
    when it beats the best it started with)."""
    for run in lineage.runs:
        if (paths.checkpoints_dir(run) / BEST_DIR / META_FILE).is_file():
            return paths.checkpoints_dir(run) / BEST_DIR
    raise SnapshotError("no validated weights yet (best/ is written at the first validation): take the newest step "
                        "instead, or wait for training.validate_every")


def resolve_source(paths: ProjectPaths, run_dir: Path, settings: Settings, val_folders: list[Path], *,
                   step: int | None = None, best: bool = False, wait_s: float = ANSWER_TIMEOUT_S,
                   say=log.info) -> Source:
    """The weights a snapshot takes (the module's docstring), kept first where they are not yet."""
    lineage = lineage_snapshots(paths, run_dir, paths.output_dir(settings))
    if best:
        folder = _best_dir(paths, lineage)
        return Source(folder, folder.parent, int(atomic.read_json(folder / META_FILE)["step"]), BEST, BEST)
    asked = NEWEST if step is None else f"step{step}"
    if step is None and training_is_running(run_dir):
        request = kept.ask(run_dir)
        say("asked the running trainer to keep its current step (it validates and checkpoints, then goes on)")
        step = kept.wait_for_answer(run_dir, request, still_training=lambda: training_is_running(run_dir),
                                    timeout_s=wait_s)
        if step is None:
            if training_is_running(run_dir):
                raise SnapshotError(f"the trainer did not answer within {wait_s:.0f} s (a step or a validation "
                                    "takes that long?); try again, or take --best")
            return resolve_source(paths, run_dir, settings, val_folders, step=None, wait_s=wait_s, say=say)
        return Source(kept.kept_step_dir(run_dir, step), run_dir, step, f"step{step}", asked)
    source = lineage.newest() if step is None else lineage.source(step)
    if source is None and step is None:
        raise SnapshotError("this training run has no checkpoint yet: wait for training.checkpoint_every, or for "
                            "the run to start")
    if source is None:
        raise SnapshotError(f"step {step} is not kept: the steps a snapshot can take are {lineage.steps_text()}. "
                            "Keep more with training.keep_steps_every (and _from, _to, _last) before the run")
    source_dir = paths.checkpoints_dir(source.run)
    if source.held_by not in (KEPT_FOR_SNAPSHOT, KEPT_ON_SCHEDULE):
        _keep_from(source_dir, source.step, settings, val_folders, final=source.held_by == FINAL)
    return Source(kept.kept_step_dir(source_dir, source.step), source_dir, source.step, f"step{source.step}", asked)


def _delivered_gguf_holding(paths: ProjectPaths, settings: Settings, source: Source) -> tuple[Path, str] | None:
    """The run's own exported GGUF and its sha256, when it holds exactly the weights of ``source`` (best/ at the
    final step: the same weights file, by sha256) and is unchanged since its export; else None."""
    from gguf_assets.lib.output.export_run import export_sidecar, gguf_path

    try:
        sidecar = export_sidecar(paths, settings)
        final_weights = atomic.read_json(source.run_dir / FINAL_DIR / META_FILE)["sha256"][WEIGHTS_FILE]
        these_weights = atomic.read_json(source.folder / META_FILE)["sha256"][WEIGHTS_FILE]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    delivered = gguf_path(paths, settings)
    written = next((f for f in sidecar.written_files() if f.get("role") == "adapter"), None)
    if sidecar.adapter_fingerprint != source.run_dir.name or Path(sidecar.path) != delivered or written is None \
            or final_weights != these_weights or not verify.unchanged(delivered, written):
        return None
    return delivered, written["sha256"]


def _link(existing: Path, target: Path) -> bool:
    """``target`` as a hard link to ``existing``, put in place atomically; False where links are not possible
    (another file system, or one without them): the caller writes the file instead."""
    if target.exists() and os.path.samefile(existing, target):
        return True  # linked before (renaming a link over its twin would leave the temp name behind)
    try:
        with atomic.atomic_path(target) as tmp:
            tmp.unlink()
            os.link(existing, tmp)
    except OSError:
        return False
    return True


def take_snapshot(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, run_dir: Path, *,
                  val_folders: list[Path], step: int | None = None, best: bool = False, evaluate: bool = False,
                  wait_s: float = ANSWER_TIMEOUT_S, say=log.info) -> dict:
    """Export a snapshot GGUF (and score it with ``evaluate``); returns its entry in the snapshots.json of the run
    whose weights it holds (``run_dir``'s, or a run it continues)."""
    from gguf_assets.lib.output.export import check_file_name, peaks_device, provenance, write_adapter_file
    from gguf_assets.lib.training.adapter import Adapter, AdapterShape
    from gguf_assets.lib.training.checkpoints import read_recorded

    name = check_file_name(settings.output.adapter_name)
    source = resolve_source(paths, run_dir, settings, val_folders, step=step, best=best, wait_s=wait_s, say=say)
    meta = atomic.read_json(source.folder / META_FILE)
    output_dir = paths.output_dir(settings)
    target = snapshot_path(output_dir, name, source.step, best=source.weights_name == BEST)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(target.parent, of=[target.name])
    same = _delivered_gguf_holding(paths, settings, source) if source.weights_name == BEST else None
    if same is not None and _link(same[0], target):
        sha256, same_file = same[1], {"same_file_as": paths.stored(same[0])}
    else:
        from safetensors.torch import load as safetensors_load

        model = Adapter(AdapterShape(**meta["shape"]))
        model.load_state_dict(safetensors_load(read_recorded(source.folder, WEIGHTS_FILE, meta)))
        model.eval()
        sha256, same_file = write_adapter_file(
            target, model, meta, name=f"{name}-step{source.step}", val_folders=val_folders,
            provenance=provenance(settings, materials, meta, checkpoint=source.weights_name),
            device=peaks_device(settings)).sha256, {}
    entry = {"file": paths.stored(target), "step": source.step,
             "planned_steps": meta.get("planned_steps", settings.training.steps), "weights": source.weights_name,
             "asked": source.asked, VAL_CENTRED_COSINE: meta.get(VAL_CENTRED_COSINE),
             EMPTY_PROMPT_COSINE: meta.get(EMPTY_PROMPT_COSINE), VAL_LOSS: meta.get(VAL_LOSS),
             **verify.record(target, sha256), **same_file, "at": round(time.time(), 1)}
    if evaluate:  # best at the final step: the run's report scored this very file already
        entry["eval"] = snapshot_evaluation(paths, source.run_dir.name, entry) or evaluate_snapshot(
            target, val_folders, source.folder / WEIGHTS_FILE)
    record_snapshot(paths, run_dir, entry, source_run=source.run_dir, output_dir=output_dir)
    return entry


def evaluate_snapshot(gguf: Path, val_folders: list[Path], weights: Path) -> dict:
    """The GGUF scored on the val shards as the export's evaluation scores it (torch-free, on the CPU), centred on
    the run's target centre (``weights``: any of the run's weights files carries it)."""
    from gguf_assets.lib.output.gguf_eval import evaluate_gguf, training_centre

    result = evaluate_gguf(gguf, val_folders, training_centre(weights))
    return {k: v for k, v in result.items() if isinstance(v, int | float) or v is None}


def snapshot_file(paths: ProjectPaths, run_dir: Path, entry: dict, output_dir: Path) -> Path:
    """The GGUF a snapshots.json entry names, confined to the output folder (RecordPathError otherwise: the record
    may come with a received project)."""
    return paths.inside(entry.get("file"), record=run_dir / SNAPSHOTS_FILE, under=output_dir)


def delete_snapshot(paths: ProjectPaths, run_dir: Path, which: str | int, *, output_dir: Path) -> list[str]:
    """Delete the snapshot GGUF ``which`` names (a file name; or a step that has exactly one) and its records, in
    any run of the lineage; returns the file removed, as recorded. Refused, deleting nothing: a name no run lists, a
    step with several files (they are named), an entry naming a file outside ``output_dir``."""
    lineage = lineage_snapshots(paths, run_dir, output_dir)
    chosen = lineage.named(which)
    listed = ", ".join(f.name for f in lineage.files) or "none"
    if not chosen:
        what = f"of step {which}" if isinstance(which, int) else f"named {which}"
        raise SnapshotError(f"no snapshot {what} in this run or the runs it continues (snapshot GGUFs: {listed})")
    if len({f.path for f in chosen}) > 1:
        raise SnapshotError(f"step {which} has {len(chosen)} snapshot GGUFs: {', '.join(f.name for f in chosen)}; "
                            "name the file to delete")
    path = chosen[0].path
    path.unlink(missing_ok=True)
    forget_file(paths, lineage, path)
    return [chosen[0].entry["file"]]
