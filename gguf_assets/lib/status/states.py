"""What is done and what is not: the state of every stage, with why, for `status`, the studio, the planner
(pipeline/plan.py) and `gguf-trainer run`.

Each stage's output records the fingerprint of everything it was made from. A stage is
current when its recorded fingerprint equals the one computed from the current settings
and upstream outputs (each stage's own module says how: lib/status/stages.py lists them);
otherwise it is missing or stale and is recomputed, never reused. `gguf-trainer run` and
`auto-resume` use this to launch only the work that is left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.console import fill
from gguf_assets.lib.core.lock import HolderRecord
from gguf_assets.lib.corpus.corpus_run import corpus_is_current
from gguf_assets.lib.materials.materials_run import load_manifest, manifest_is_current
from gguf_assets.lib.output.export_run import gguf_fingerprint, gguf_is_current, gguf_path
from gguf_assets.lib.output.report_run import report_is_current
from gguf_assets.lib.precompute.half_state import HalfState
from gguf_assets.lib.precompute.shards import (
    ShardPlan,
    half_status,
    halves_for_mode,
    plan_shards,
    planned_fingerprints,
    shard_status,
)
from gguf_assets.lib.project import formats, settings_history
from gguf_assets.lib.project.layout import SPLITS, ProjectPaths
from gguf_assets.lib.project.manifests import (
    DamagedRecord,
    MaterialsManifest,
    read_record,
    recorded,
    recorded_fingerprint,
)
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.status.stages import STAGES, stage_settings
from gguf_assets.lib.training.training_run import (
    adapter_fingerprint,
    adapter_is_current,
    ended_early,
    final_run_dir,
    final_weights_stored,
    finished_meta,
    last_checkpoint_step,
    parent_of,
    run_fingerprint,
)


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
    # Unfinished because project.yaml was edited, though no result is replaced (training.steps raised after a
    # finished run): new work, which waits for Run like a stale stage does.
    by_edit: bool = False
    # ``detail`` without what `gguf-trainer run` would do: what with_running shows while a run does it ("" when
    # detail says nothing of the kind).
    fact: str = ""

    @property
    def resumable(self) -> bool:
        """Whether `run` and the daemon's resume sensor continue it by themselves (see RESUMABLE)."""
        return self.state in RESUMABLE and not self.by_edit

    def console_text(self) -> str:
        """The stage as `status` prints it: name, state and why, the why wrapped under its own column."""
        return fill(f"  {self.stage:<12} {self.state:<8} {self.detail}".rstrip(), hanging=22)


# The states `run` and the daemon continue by themselves: nothing the user decided differs from what
# was asked. A stale stage waits for the user after a settings edit (pipeline/resume.py).
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


def _older_format(record: Path, kind: str) -> str | None:
    try:
        return formats.older_format(kind, atomic.read_json(record))
    except (OSError, ValueError, AttributeError):
        return None


def _recorded_hash(record: Path) -> str | None:
    return recorded(record, "settings_hash")


@dataclass(frozen=True)
class SplitView:
    """One split's shards as planned from the corpus, each plan's half states (checked once) and the planned
    fingerprints (what training and the report chain)."""

    plans: list[ShardPlan]
    halves: Mapping[str, Mapping[str, HalfState]]  # shard key -> half -> state
    fingerprints: list[str]


def split_view(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str,
               plans: list[ShardPlan] | None = None) -> SplitView:
    """``split`` planned now (it reads the corpus split), or ``plans`` made earlier with their halves checked again."""
    plans = plan_shards(paths, settings, materials, split) if plans is None else plans
    return SplitView(plans, {p.key: shard_status(paths, settings, p) for p in plans},
                     planned_fingerprints(settings, plans))


@dataclass(frozen=True)
class ProjectView:
    """One status question's answer: the stages, and what computing them learned on the way, so the pace lines,
    the studio and `estimate` reuse it instead of reading the corpus again. A field is None where the stages
    stopped before it (blocked)."""

    stages: list[StageState]
    materials: MaterialsManifest | None = None
    splits: Mapping[str, SplitView] | None = None  # every split, or None
    # adapter_fingerprint's answer, from the plans above: the training run these settings and shards make.
    adapter_fp: str | None = None

    def rechecked(self, paths: ProjectPaths, settings: Settings) -> ProjectView:
        """The same plans with their half states checked again, the corpus not read (the stages are kept as they
        were): for one who asks again while the corpus and settings stay as they were (the shard step, during its
        run, holding the project). Planned now when this view has no plans."""
        if self.splits is None or self.materials is None:
            return planned_view(paths, settings, self.stages)
        return planned_view(paths, settings, self.stages, materials=self.materials,
                            plans={split: v.plans for split, v in self.splits.items()})


def planned_view(paths: ProjectPaths, settings: Settings, stages: Sequence[StageState] = (), *,
                 materials: MaterialsManifest | None = None,
                 plans: Mapping[str, list[ShardPlan]] | None = None) -> ProjectView:
    """A view with every split planned as the corpus is now, whatever the stages say (the pace of a project
    blocked before its shards). Raises as load_manifest and plan_shards do when there are no materials or corpus."""
    materials = load_manifest(paths) if materials is None else materials
    splits = {split: split_view(paths, settings, materials, split, (plans or {}).get(split)) for split in SPLITS}
    return ProjectView(list(stages), materials, splits,
                       run_fingerprint(paths, settings, splits["train"].fingerprints, splits["val"].fingerprints))


def adapter_fingerprint_of(paths: ProjectPaths, settings: Settings, view: ProjectView | None = None) -> str:
    """The adapter fingerprint: the view's when it planned the shards, else adapter_fingerprint's (which plans
    them, and raises as it does)."""
    if view is not None and view.adapter_fp is not None:
        return view.adapter_fp
    return adapter_fingerprint(paths, settings, load_manifest(paths))


def project_status(paths: ProjectPaths, settings: Settings) -> list[StageState]:
    """The state of every stage, in pipeline order. Later stages are 'blocked' behind unfinished ones."""
    return status_view(paths, settings).stages


def status_view(paths: ProjectPaths, settings: Settings) -> ProjectView:
    """project_status's stages, with the materials manifest, shard plans and half states and the adapter
    fingerprint it computed them from (each split's corpus is read once)."""
    learned: dict = {}
    stages = _stages(paths, settings, learned)
    return ProjectView(stages, **learned)


def _stages(paths: ProjectPaths, settings: Settings, learned: dict) -> list[StageState]:
    """The stages; ``learned`` gets ProjectView's other fields as they are computed."""
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
    materials = learned["materials"] = load_manifest(paths)
    if not corpus_is_current(paths, settings, materials):
        if not paths.corpus_manifest.is_file():
            return out + [StageState("corpus", State.MISSING)] + blocked_rest("corpus")
        if damage := _damage(paths, paths.corpus_manifest):
            return out + [StageState("corpus", State.DAMAGED, damage)] + blocked_rest("corpus")
        why = why_stale(paths, settings, "corpus", _recorded_hash(paths.corpus_manifest),
                        "a prompt source changed (a local prompt file, or a dataset's pin) or the corpus files did")
        return out + [StageState("corpus", State.STALE, why)] + blocked_rest("corpus")
    out.append(StageState("corpus", State.CURRENT))
    unfinished, splits = False, {}
    for split in SPLITS:
        splits[split] = split_view(paths, settings, materials, split)
        plans = splits[split].plans
        states = {key: set(halves.values()) for key, halves in splits[split].halves.items()}
        todo = [key for key, st in states.items() if st != {HalfState.CURRENT}]
        state = _shards_state(states, todo)
        detail = f"{len(plans) - len(todo)}/{len(plans)} shards current"
        if state in (State.STALE, State.DAMAGED):
            detail += f"; {_why_shards_stale(paths, settings, split, [p for p in plans if p.key in todo])}"
        out.append(StageState(f"{split}_shards", state, detail))
        unfinished |= bool(todo)
    # From the plans above: the corpus is read once (adapter_fingerprint would plan the shards again).
    adapter_fp = run_fingerprint(paths, settings, splits["train"].fingerprints, splits["val"].fingerprints)
    learned.update(splits=splits, adapter_fp=adapter_fp)
    if unfinished:
        return out + blocked_rest("val_shards")
    if settings.precompute.mode != "teacher+student":
        return out + [StageState(s, State.BLOCKED, f"precompute.mode is {settings.precompute.mode!r}; training needs "
                                 "teacher+student") for s in STAGES[STAGES.index("adapter"):]]
    if not adapter_is_current(paths, adapter_fp):
        return out + [_adapter_state(paths, settings, adapter_fp)] + blocked_rest("adapter")
    out.append(StageState("adapter", State.CURRENT, _how_it_ended(paths)))
    sidecar = gguf_path(paths, settings).with_suffix(".json")
    if not gguf_is_current(paths, settings, materials, adapter_fp):
        if not sidecar.is_file():
            return out + [StageState("gguf", State.MISSING)] + blocked_rest("gguf")
        if damage := _damage(paths, sidecar):
            return out + [StageState("gguf", State.DAMAGED, damage)] + blocked_rest("gguf")
        if recorded_fingerprint(sidecar) == gguf_fingerprint(settings, materials, adapter_fp):
            return out + [StageState("gguf", State.DAMAGED, "an exported file changed on disk or is gone "
                                     "(`gguf-trainer run` exports again)")] + blocked_rest("gguf")
        why = why_stale(paths, settings, "gguf", _recorded_hash(sidecar), "the adapter was retrained since the export")
        return out + [StageState("gguf", State.STALE, why)] + blocked_rest("gguf")
    out.append(StageState("gguf", State.CURRENT))
    report = paths.report_json(settings)
    if report_is_current(paths, settings, recorded_fingerprint(sidecar), splits["val"].fingerprints):
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
    if step and parent_of(paths, adapter_fp) and not paths.checkpoints_dir(adapter_fp).is_dir():
        # training.steps raised after a finished or stopped run: it goes on from that run's newest checkpoint
        why = why_stale(paths, settings, "adapter", _recorded_hash(paths.adapter_manifest),
                        "training.steps changed") if paths.adapter_manifest.is_file() else "training.steps changed"
        fact = f"{why}: goes on from step {step} to {settings.training.steps}"
        return StageState("adapter", State.PARTIAL, f"{fact} (`gguf-trainer run` continues the run from its newest "
                          "checkpoint)", by_edit=True, fact=fact)
    trained = f"trained to step {step} of {settings.training.steps}"
    partial = StageState("adapter", State.PARTIAL, f"{trained} (checkpoint kept; `gguf-trainer run` resumes from it)",
                         fact=trained) if step else None
    if not paths.adapter_manifest.is_file():
        return partial or StageState("adapter", State.MISSING)
    if damage := _damage(paths, paths.adapter_manifest):
        return StageState("adapter", State.DAMAGED, damage)
    if recorded_fingerprint(paths.adapter_manifest) == adapter_fp:
        return StageState("adapter", State.DAMAGED, f"{final_weights_stored(paths)} changed on disk since training "
                          "wrote it (`gguf-trainer run` trains again)")
    if older := _older_format(paths.adapter_manifest, "adapter"):
        return partial or StageState("adapter", State.STALE, f"the finished adapter was {older}")
    return partial or StageState("adapter", State.STALE, why_stale(
        paths, settings, "adapter", _recorded_hash(paths.adapter_manifest),
        "its train or val shards changed since it was trained"))


def _how_it_ended(paths: ProjectPaths) -> str:
    """The current adapter's end when a lowered training.steps ended it ("ended at step 1740 (training.steps
    lowered to 1600)"), else ""."""
    try:
        return ended_early(finished_meta(final_run_dir(paths))) or ""
    except (OSError, ValueError, KeyError, TypeError):  # RecordPathError included: adapter_is_current read it
        return ""


def _why_shards_stale(paths: ProjectPaths, settings: Settings, split: str, todo: list) -> str:
    """Why the first stale shard is stale: the settings its half was made under, or a changed file."""
    for plan in todo:
        folder = plan.folder(paths)
        for half in halves_for_mode(settings.precompute.mode):
            state = half_status(folder, half, plan.fingerprints[half])
            if state == HalfState.CORRUPT:
                return f"shard {split}/{plan.key}: its {half} half changed on disk"
            if state == HalfState.STALE:
                if older := _older_format(folder / f"{half}.json", "shard"):
                    return f"shard {split}/{plan.key}: its {half} half was {older}"
                return why_stale(paths, settings, f"{split}_shards", _recorded_hash(folder / f"{half}.json"),
                                 f"shard {split}/{plan.key}: its {half} half was made from other prompts or models")
    return "some shards were made under other settings"


def where_stopped(paths: ProjectPaths, settings: Settings, view: ProjectView | None = None) -> str:
    """Where an unfinished pipeline stands, for the "stopped" line: the first unfinished stage, with its
    shards or the training step its newest checkpoint holds. ``view``: this question's status_view, if made."""
    view = status_view(paths, settings) if view is None else view
    unfinished = next((s for s in view.stages if s.state in UNFINISHED), None)
    if unfinished is None:
        return "with every stage finished"
    if unfinished.stage.endswith("_shards"):
        return f"during {unfinished.stage} ({unfinished.detail.split(';')[0]})"
    if unfinished.stage == "adapter":
        step = last_checkpoint_step(paths, adapter_fingerprint_of(paths, settings, view))
        if step:
            return (f"during adapter training, at the checkpoint of step {step} of {settings.training.steps} "
                    "(kept; training resumes from it)")
        return "during adapter training, before its first checkpoint"
    return f"at {unfinished.stage}"


def with_running(status: list[StageState], holder: HolderRecord | None) -> list[StageState]:
    """``status`` with the stage that the project's running Dagster run works on now shown as running
    (its run id and job; what it was before), from the lock's holder record (lib/core/lock.py ``holder``)."""
    running = holder.running if holder is not None else None
    if running is None:
        return status
    now = next((s for s in status if s.stage in running.assets and s.state != State.CURRENT), None)
    if now is None:
        return status
    # What it was, not what `run` would do with it: the run does it now.
    detail = now.fact or now.detail
    was = f"; was {now.state}" + (f": {detail}" if detail else "")
    shown = StageState(now.stage, State.RUNNING, f"run {running.run_id[:8]} of {running.job}{was}")
    return [shown if s is now else s for s in status]
