"""What is done and what is not: the fingerprints that chain the stages, and the project status.

Each stage's output records the fingerprint of everything it was made from. A stage is
current when its recorded fingerprint equals the one computed from the current settings
and upstream outputs; otherwise it is missing or stale and is recomputed, never reused.
`gguf-trainer run` and `--auto-resume` use this to launch only the work that is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.materials.materials import load_manifest, manifest_is_current
from gguf_assets.lib.precompute.half_state import HalfState
from gguf_assets.lib.project import formats, settings_history
from gguf_assets.lib.project.layout import SPLITS, ProjectPaths
from gguf_assets.lib.project.manifests import (
    CorpusManifest,
    DamagedRecord,
    ExportSidecar,
    MaterialsManifest,
    read_record,
)
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.teacher_choice import teacher_choice

STAGES = ("materials", "corpus", "train_shards", "val_shards", "adapter", "gguf", "eval_report")
GGUF_SUFFIX = ".gguf"


def corpus_settings(settings: Settings) -> dict:
    return {"corpus": settings.section_dict("corpus")}


def _recorded_source_hashes(paths: ProjectPaths) -> dict[Path, dict]:
    """The prompt files the last corpus build read: their sha256 and their stamp then."""
    try:
        sources = (read_record(paths.corpus_manifest) or {}).get("sources", [])
    except (OSError, DamagedRecord):
        return {}
    return {paths.located(s["file"]): {**s.get("stamp", {}), "sha256": s.get("sha256")} for s in sources}


def corpus_fingerprint(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest) -> str:
    local, recorded = [], _recorded_source_hashes(paths)
    for value in settings.corpus.local_prompt_files:
        file = paths.resolve_local(value)
        # A file read by the last build, with the same size, mtime and inode, is not read again.
        known = recorded.get(file)
        unchanged = known is not None and verify.stamp_matches(file, known) is True
        local.append([value, known["sha256"] if unchanged else atomic.sha256_file(file) if file.is_file() else None])
    datasets = [[d["source"], d["commit"], d.get("text_field")] for d in materials.datasets]
    return atomic.fingerprint({**corpus_settings(settings), "datasets": datasets, "local": local,
                               "format": formats.CORPUS})


def corpus_manifest(paths: ProjectPaths) -> CorpusManifest:
    """The corpus manifest; a clear error when there is none or it is damaged."""
    manifest = CorpusManifest.read(paths.corpus_manifest)
    if manifest is None:
        raise UserError(f"{paths.corpus_manifest} is missing: materialize the corpus asset first.")
    return manifest


def corpus_is_current(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest) -> bool:
    try:
        doc = read_record(paths.corpus_manifest)
        manifest = CorpusManifest.read(paths.corpus_manifest, doc)
    except DamagedRecord:  # status says so; the corpus is built again
        return False
    if manifest is None or manifest.fingerprint != corpus_fingerprint(paths, settings, materials):
        return False
    # By stamp (size, mtime, inode); the content only when those are unsure, then the new stamp is kept.
    if set(manifest.splits) != set(SPLITS):
        return False
    now = {s: verify.confirmed(paths.corpus_file(s), manifest.splits[s]) for s in SPLITS}
    if any(record is None for record in now.values()):
        return False
    verify.store_refreshed(paths.corpus_manifest, doc, {**doc, "splits": {**manifest.splits, **now}})
    return True


def shard_fingerprints(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str) -> list[str]:
    from gguf_assets.lib.precompute.shards import plan_shards

    return _planned_fingerprints(settings, plan_shards(paths, settings, materials, split))


def _planned_fingerprints(settings: Settings, plans: list) -> list[str]:
    """Per planned shard, the fingerprint of the halves the mode makes (what training and the report read)."""
    from gguf_assets.lib.precompute.shards import halves_for_mode

    halves = halves_for_mode(settings.precompute.mode)
    return [":".join(plan.fingerprints[h] for h in halves) for plan in plans]


def adapter_fingerprint(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest) -> str:
    from gguf_assets.lib.training.training_run import training_fingerprint

    return training_fingerprint(settings, shard_fingerprints(paths, settings, materials, "train"),
                                shard_fingerprints(paths, settings, materials, "val"))


def gguf_path(paths: ProjectPaths, settings: Settings) -> Path:
    return paths.output_dir(settings) / f"{settings.output.adapter_name}{GGUF_SUFFIX}"


def gguf_settings(settings: Settings) -> dict:
    # also_copy_to is here because the copy is part of the export: a new folder must get one.
    o = settings.output
    return {"name": o.adapter_name, "template": settings.precompute.prompt_template,
            "export_vision_encoder": o.export_vision_encoder, "also_copy_to": o.also_copy_to}


def gguf_fingerprint(settings: Settings, materials: MaterialsManifest, adapter_fp: str) -> str:
    s = gguf_settings(settings)
    return atomic.fingerprint({"adapter": adapter_fp, "name": s["name"], "template": s["template"],
                               "student": materials.pin("student"), "teacher": materials.pin("teacher"),
                               "vision": [materials.pin("vision_encoder"), s["export_vision_encoder"]],
                               "also_copy_to": s["also_copy_to"], "format": formats.GGUF_EXPORT})


def report_settings(settings: Settings) -> dict:
    # The report lists the exported files, so the settings that change that list count too.
    o = settings.output
    return {"evaluate": o.evaluate, "ggk_command": o.ggk_command, "vision": o.export_vision_encoder,
            "also_copy_to": o.also_copy_to}


def report_fingerprint(settings: Settings, gguf_fp: str, val_fps: list[str]) -> str:
    # The export's fingerprint covers what it was made from (vision source included), and the export is
    # deterministic, so it stands for the GGUF's bytes; it is known before the export runs (expected_fingerprints).
    return atomic.fingerprint({"gguf": gguf_fp, "val": val_fps, **report_settings(settings),
                               "format": formats.EVAL_REPORT})


def stage_settings(settings: Settings) -> dict[str, dict]:
    """Per stage, the settings its result is computed from: the same functions its fingerprint uses.

    Dagster sees them as the observable source assets settings/<stage> (defs/settings.py), so a
    settings edit marks exactly the stages whose fingerprints it changes, and everything after
    them, as stale in the UI. Settings that only place a file (output_dir, shard sizes) are here
    too: they make the recorded result missing rather than different.
    """
    from gguf_assets.lib.materials.materials import materials_settings_key
    from gguf_assets.lib.precompute.shards import half_settings, halves_for_mode
    from gguf_assets.lib.training.training_run import training_settings

    m, p = settings.materials, settings.precompute
    halves = {half: half_settings(half, settings) for half in halves_for_mode(p.mode)}
    # The fingerprints see a material through its pin (source and commit); a stage that reads a
    # material lists its source here, so a new source marks that stage, not every stage.
    choice = teacher_choice(settings)
    models = {"student": m.student if choice.loads_student_model else None,
              "teacher": m.teacher if choice.loads_teacher_model else None}
    return {
        "materials": materials_settings_key(settings),
        "corpus": {**corpus_settings(settings), "datasets": m.datasets},
        "train_shards": {"halves": halves, "models": models, "shard_size": p.shard_size},
        "val_shards": {"halves": halves, "models": models, "shard_size": p.val_shard_size},
        "adapter": {"training": training_settings(settings), "mode": p.mode},
        "gguf": {**gguf_settings(settings), "output_dir": settings.output.output_dir, "vision": m.vision_encoder},
        "eval_report": report_settings(settings),
    }


def stage_keys(settings: Settings, stage: str) -> list[str]:
    """The project.yaml keys (``section.key``) that enter ``stage``'s result: each one, changed alone, changes
    the stage's slice of ``stage_settings``. Derived from that function, so it can never drift from it."""
    from gguf_assets.lib.project.settings import SECTIONS

    base = stage_settings(settings)[stage]
    keys = []
    for section in SECTIONS:
        current = getattr(settings, section)
        for name, info in type(current).model_fields.items():
            altered = _another_value(getattr(current, name), info.annotation)
            # model_copy skips validation: a value that breaks a cross-check still shows what it would change.
            changed = settings.model_copy(update={section: current.model_copy(update={name: altered})})
            try:
                differs = stage_settings(changed)[stage] != base
            except Exception:  # noqa: BLE001  a stage that cannot even be described without this key reads it
                differs = True
            if differs:
                keys.append(f"{section}.{name}")
    return keys


def _another_value(value, annotation):
    """Some other value of a setting's type (another choice for a Literal)."""
    from typing import Literal, get_args, get_origin

    if get_origin(annotation) is Literal:
        return next(choice for choice in get_args(annotation) if choice != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        return [*value, "other"]
    if isinstance(value, dict):
        return {**value, "other": 1}
    return "other"


def recorded_fingerprint(sidecar: Path) -> str | None:
    return _recorded(sidecar, "fingerprint")


def _recorded(record: Path, key: str) -> str | None:
    """One field of a stage's JSON record; None when the record is missing or damaged."""
    try:
        return atomic.read_json(record).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def export_sidecar(paths: ProjectPaths, settings: Settings) -> ExportSidecar:
    """The export's sidecar (<adapter_name>.json beside the GGUF), with absolute paths."""
    return ExportSidecar.from_json(paths.located_doc(atomic.read_json(gguf_path(paths, settings).with_suffix(".json"))))


def _exported_files_unchanged(paths: ProjectPaths, settings: Settings) -> bool:
    """Every file the export wrote (GGUF, vision GGUF, copies) still holds what it wrote.

    Checked by size, mtime and inode; the content is read only when those are unsure, and the new stamps
    are then stored (a copied project is hashed once, not at every `status`). A copy in a folder that
    another project also exports to counts as changed once that project writes it.
    """
    record = gguf_path(paths, settings).with_suffix(".json")
    try:
        doc = read_record(record)
        sidecar = ExportSidecar.read(record, paths.located_doc(doc)) if doc is not None else None
    except DamagedRecord:
        return False
    if sidecar is None:
        return False
    files = sidecar.written_files()
    now = [verify.confirmed(Path(f["path"]), f) for f in files]
    if any(entry is None for entry in now):
        return False
    if sidecar.files:
        stamps = [{k: entry[k] for k in verify.STAMP_KEYS} for entry in now]
        verify.store_refreshed(record, doc, {**doc, "files": [{**f, **st} for f, st in zip(doc["files"], stamps)]})
    return True


def _adapter_is_current(paths: ProjectPaths, adapter_fp: str) -> bool:
    """The adapter manifest names this fingerprint, and the finished weights are still as written."""
    from gguf_assets.lib.project.layout import FINAL_DIR, WEIGHTS_FILE

    try:
        manifest = atomic.read_json(paths.adapter_manifest)
    except (OSError, ValueError):
        return False
    if manifest.get("fingerprint") != adapter_fp:
        return False
    weights = paths.root / manifest["run_dir"] / FINAL_DIR / WEIGHTS_FILE
    recorded = manifest.get("final_weights")
    return verify.unchanged(weights, recorded) if recorded else weights.is_file()


class State(StrEnum):
    """A stage's state, as `status`, the studio and the UI print it (a str: printed and in JSON as its value)."""

    CURRENT = "current"
    MISSING = "missing"  # never made
    PARTIAL = "partial"  # some of it made: shards, or training up to a checkpoint
    DAMAGED = "damaged"  # made, but its record or its files are broken
    STALE = "stale"  # made under other settings, or an input changed
    BLOCKED = "blocked"  # waits for an earlier stage
    RUNNING = "running"  # a run works on it now (with_running)


@dataclass(frozen=True)
class StageState:
    stage: str
    state: State
    # Why: for a stale stage, the project.yaml keys that changed (old → new) or what changed on disk;
    # for a damaged or partial one, what was found.
    detail: str = ""


# The states `run` and the daemon continue by themselves: nothing the user decided differs from what
# was asked. A stale stage waits for the user after a settings edit (defs/resume.py).
RESUMABLE = (State.MISSING, State.PARTIAL, State.DAMAGED)
UNFINISHED = (*RESUMABLE, State.STALE)


def _damage(paths: ProjectPaths, record: Path) -> str:
    """What is wrong with a stage's JSON record, or "" when it reads."""
    try:
        read_record(record)
    except DamagedRecord as exc:
        return f"{paths.stored(record)}: {exc.why}"
    except OSError as exc:
        return f"{paths.stored(record)}: {exc.strerror}"
    return ""


def why_stale(paths: ProjectPaths, settings: Settings, stage: str, recorded_hash: str | None, otherwise: str) -> str:
    """The settings keys whose change made ``stage`` stale, old → new, from the snapshot its record names
    (lib/project/settings_history.py); ``otherwise`` when none of its own settings changed (an input or a file did)."""
    old = settings_history.recall(paths.root, recorded_hash)
    if old is not None:
        keys = settings_history.changed_keys(old, settings, lambda s: stage_settings(s)[stage])
        if keys:
            return ", ".join(keys)
    return otherwise


def _recorded_hash(record: Path) -> str | None:
    return _recorded(record, "settings_hash")


def project_status(paths: ProjectPaths, settings: Settings) -> list[StageState]:
    """The state of every stage, in pipeline order. Later stages are 'blocked' behind unfinished ones."""
    from gguf_assets.lib.precompute.shards import plan_shards, shard_status

    out: list[StageState] = []

    def blocked_rest(after: str) -> list[StageState]:
        return [StageState(s, State.BLOCKED, f"waits for {after}") for s in STAGES[STAGES.index(after) + 1:]]

    if not manifest_is_current(paths, settings):
        if not paths.materials_manifest.is_file():
            return [StageState("materials", State.MISSING)] + blocked_rest("materials")
        if damage := _damage(paths, paths.materials_manifest):
            return [StageState("materials", State.DAMAGED, damage)] + blocked_rest("materials")
        why = why_stale(paths, settings, "materials", _recorded_hash(paths.materials_manifest),
                        "a material changed on disk since it was pinned")
        return [StageState("materials", State.STALE, why)] + blocked_rest("materials")
    out.append(StageState("materials", State.CURRENT))
    materials = load_manifest(paths)
    if not corpus_is_current(paths, settings, materials):
        if not paths.corpus_manifest.is_file():
            return out + [StageState("corpus", State.MISSING)] + blocked_rest("corpus")
        if damage := _damage(paths, paths.corpus_manifest):
            return out + [StageState("corpus", State.DAMAGED, damage)] + blocked_rest("corpus")
        why = why_stale(paths, settings, "corpus", _recorded_hash(paths.corpus_manifest),
                        "a prompt source changed (a local prompt file, or a dataset's pin) or the corpus files did")
        return out + [StageState("corpus", State.STALE, why)] + blocked_rest("corpus")
    out.append(StageState("corpus", State.CURRENT))
    unfinished, fingerprints = False, {}
    for split in SPLITS:
        plans = plan_shards(paths, settings, materials, split)
        fingerprints[split] = _planned_fingerprints(settings, plans)
        states = {p.key: set(shard_status(paths, settings, p).values()) for p in plans}
        todo = [key for key, st in states.items() if st != {HalfState.CURRENT}]
        state = _shards_state(states, todo)
        detail = f"{len(plans) - len(todo)}/{len(plans)} shards current"
        if state in (State.STALE, State.DAMAGED):
            detail += f"; {_why_shards_stale(paths, settings, split, [p for p in plans if p.key in todo])}"
        out.append(StageState(f"{split}_shards", state, detail))
        unfinished |= bool(todo)
    if unfinished:
        return out + blocked_rest("val_shards")
    if settings.precompute.mode != "teacher+student":
        return out + [StageState(s, State.BLOCKED, f"precompute.mode is {settings.precompute.mode!r}; training needs "
                                 "teacher+student") for s in STAGES[STAGES.index("adapter"):]]
    from gguf_assets.lib.training.training_run import training_fingerprint

    # From the plans above: the corpus is read once (adapter_fingerprint would plan the shards again).
    adapter_fp = training_fingerprint(settings, fingerprints["train"], fingerprints["val"])
    if not _adapter_is_current(paths, adapter_fp):
        return out + [_adapter_state(paths, settings, adapter_fp)] + blocked_rest("adapter")
    out.append(StageState("adapter", State.CURRENT))
    gguf = gguf_path(paths, settings)
    sidecar = gguf.with_suffix(".json")
    same_export = recorded_fingerprint(sidecar) == gguf_fingerprint(settings, materials, adapter_fp)
    if not same_export or not _exported_files_unchanged(paths, settings):
        if not sidecar.is_file():
            return out + [StageState("gguf", State.MISSING)] + blocked_rest("gguf")
        if damage := _damage(paths, sidecar):
            return out + [StageState("gguf", State.DAMAGED, damage)] + blocked_rest("gguf")
        if same_export:
            return out + [StageState("gguf", State.DAMAGED, "an exported file changed on disk or is gone "
                                     "(`gguf-trainer run` exports again)")] + blocked_rest("gguf")
        why = why_stale(paths, settings, "gguf", _recorded_hash(sidecar), "the adapter was retrained since the export")
        return out + [StageState("gguf", State.STALE, why)] + blocked_rest("gguf")
    out.append(StageState("gguf", State.CURRENT))
    report = paths.report_json(settings)
    expected = report_fingerprint(settings, recorded_fingerprint(sidecar), fingerprints["val"])
    if recorded_fingerprint(report) == expected:
        out.append(StageState("eval_report", State.CURRENT))
    elif not report.is_file():
        out.append(StageState("eval_report", State.MISSING))
    elif damage := _damage(paths, report):
        out.append(StageState("eval_report", State.DAMAGED, damage))
    else:
        out.append(StageState("eval_report", State.STALE, why_stale(
            paths, settings, "eval_report", _recorded_hash(report),
            "the GGUF was exported again, or the val shards changed, since it was evaluated")))
    return out


def _shards_state(states: dict[str, set[HalfState]], todo: list[str]) -> State:
    """A split's state from its shards' half states: damaged when a half's bytes changed on disk; stale when
    one was made under other settings; partial when some shards are done and only unwritten halves are left
    (a run cut off); missing when none is done."""
    if not todo:
        return State.CURRENT
    left = set().union(*(states[key] for key in todo))
    if HalfState.CORRUPT in left:
        return State.DAMAGED
    if HalfState.STALE in left:
        return State.STALE
    return State.PARTIAL if len(todo) < len(states) or HalfState.CURRENT in left else State.MISSING


def _adapter_state(paths: ProjectPaths, settings: Settings, adapter_fp: str) -> StageState:
    """Why the adapter is not current: never trained, trained part way (a checkpoint of this run is kept),
    its record or final weights damaged, or trained under other settings or shards."""
    step = last_checkpoint_step(paths, adapter_fp)
    partial = StageState("adapter", State.PARTIAL, f"trained to step {step} of {settings.training.steps} "
                         "(checkpoint kept; `gguf-trainer run` resumes from it)") if step else None
    if not paths.adapter_manifest.is_file():
        return partial or StageState("adapter", State.MISSING)
    if damage := _damage(paths, paths.adapter_manifest):
        return StageState("adapter", State.DAMAGED, damage)
    if recorded_fingerprint(paths.adapter_manifest) == adapter_fp:
        return StageState("adapter", State.DAMAGED, f"{_final_weights_stored(paths)} changed on disk since training "
                          "wrote it (`gguf-trainer run` trains again)")
    return partial or StageState("adapter", State.STALE, why_stale(
        paths, settings, "adapter", _recorded_hash(paths.adapter_manifest),
        "its train or val shards changed since it was trained"))


def last_checkpoint_step(paths: ProjectPaths, adapter_fp: str) -> int:
    """The step of the newest checkpoint of the training run ``adapter_fp`` (0: none)."""
    from gguf_assets.lib.project.layout import STEP_DIR

    run_dir = paths.checkpoints_dir(adapter_fp)
    steps = [int(m.group(1)) for d in (run_dir.iterdir() if run_dir.is_dir() else []) if (m := STEP_DIR.match(d.name))]
    return max(steps, default=0)


def _final_weights_stored(paths: ProjectPaths) -> str:
    from gguf_assets.lib.project.layout import FINAL_DIR, WEIGHTS_FILE

    run_dir = _recorded(paths.adapter_manifest, "run_dir") or "checkpoints/<run>"
    return f"{run_dir}/{FINAL_DIR}/{WEIGHTS_FILE}"


def _why_shards_stale(paths: ProjectPaths, settings: Settings, split: str, todo: list) -> str:
    """Why the first stale shard is stale: the settings its half was made under, or a changed file."""
    from gguf_assets.lib.precompute.shards import half_status, halves_for_mode

    for plan in todo:
        folder = plan.folder(paths)
        for half in halves_for_mode(settings.precompute.mode):
            state = half_status(folder, half, plan.fingerprints[half])
            if state == HalfState.CORRUPT:
                return f"shard {split}/{plan.key}: its {half} half changed on disk"
            if state == HalfState.STALE:
                return why_stale(paths, settings, f"{split}_shards", _recorded_hash(folder / f"{half}.json"),
                                 f"shard {split}/{plan.key}: its {half} half was made from other prompts or models")
    return "some shards were made under other settings"


def where_stopped(paths: ProjectPaths, settings: Settings) -> str:
    """Where an unfinished pipeline stands, for the "stopped" line: the first unfinished stage, with its
    shards or the training step its newest checkpoint holds."""
    unfinished = next((s for s in project_status(paths, settings) if s.state in UNFINISHED), None)
    if unfinished is None:
        return "with every stage finished"
    if unfinished.stage.endswith("_shards"):
        return f"during {unfinished.stage} ({unfinished.detail.split(';')[0]})"
    if unfinished.stage == "adapter":
        step = last_checkpoint_step(paths, adapter_fingerprint(paths, settings, load_manifest(paths)))
        if step:
            return (f"during adapter training, at the checkpoint of step {step} of {settings.training.steps} "
                    "(kept; training resumes from it)")
        return "during adapter training, before its first checkpoint"
    return f"at {unfinished.stage}"


def with_running(status: list[StageState], holder: dict | None) -> list[StageState]:
    """``status`` with the stage that the project's running Dagster run works on now shown as running
    (its run id and job; what it was before), from the lock's holder record (lib/core/lock.py ``holder``)."""
    running = (holder or {}).get("running") or {}
    assets = set(running.get("assets", ()))
    now = next((s for s in status if s.stage in assets and s.state != State.CURRENT), None)
    if now is None:
        return status
    was = f"; was {now.state}" + (f": {now.detail}" if now.detail else "")
    shown = StageState(now.stage, State.RUNNING, f"run {running['run_id'][:8]} of {running['job']}{was}")
    return [shown if s is now else s for s in status]


def expected_fingerprints(paths: ProjectPaths, settings: Settings) -> dict[str, str]:
    """Per stage, the fingerprint its result has when made now from these settings and the inputs on disk;
    a stage is missing here while what it is computed from does not exist yet (no materials manifest,
    no corpus).

    These are the data versions Dagster sees for settings/<stage> (defs/settings.py): each fingerprint
    chains the fingerprints of what its stage reads, so a change anywhere marks exactly the stages whose
    results it changes, in the UI as in `status`, with no second copy of the graph. Every one is known
    before its stage runs (the adapter's from the settings and the shards, not from training).
    """
    from gguf_assets.lib.materials.materials import materials_settings_key

    out = {"materials": atomic.fingerprint(materials_settings_key(settings))}
    if not paths.materials_manifest.is_file():
        return out
    try:
        materials = load_manifest(paths)
    except (OSError, ValueError, TypeError, UserError):  # damaged: status says so, materials is redone
        return out
    out["corpus"] = corpus_fingerprint(paths, settings, materials)
    if not all(paths.corpus_file(split).is_file() for split in SPLITS):
        return out
    shard_fps = {split: shard_fingerprints(paths, settings, materials, split) for split in SPLITS}
    for split in SPLITS:
        out[f"{split}_shards"] = atomic.fingerprint(shard_fps[split])
    from gguf_assets.lib.training.training_run import training_fingerprint

    out["adapter"] = training_fingerprint(settings, shard_fps["train"], shard_fps["val"])
    out["gguf"] = gguf_fingerprint(settings, materials, out["adapter"])
    out["eval_report"] = report_fingerprint(settings, out["gguf"], shard_fps["val"])
    return out
