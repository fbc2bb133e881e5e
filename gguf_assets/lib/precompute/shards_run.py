"""What a split's shards are: each half's settings and fingerprint, the plan (which prompts go in which shard),
each half's state on disk and the train/val shards' stage records. No torch here: `status`, the planner, training's
and the report's fingerprints and every reader that checks the shards are current import this module; the builder
(lib/precompute/shards.py) computes and writes the halves.

    shards/<split>/<key>/teacher.json          fingerprint, sha256, bytes, timings, the device that computed it
    shards/<split>/<key>/student.json          also dim (Ds) and the shard format

A half is current only if its fingerprint (everything it depends on) matches and its file still has the recorded
size and sha256. The teacher half's fingerprint has nothing of the student in it, so a student change never
touches targets.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.corpus.corpus import read_split, shard_prompts
from gguf_assets.lib.materials.materials_run import chain_materials
from gguf_assets.lib.materials.teacher.layout import LLADA_IMAGE_PIPELINE, TEACHER_FORWARDS
from gguf_assets.lib.precompute.half_state import HalfState
from gguf_assets.lib.project import formats
from gguf_assets.lib.project.layout import STUDENT_FILE, TEACHER_FILE, ProjectPaths, shard_key
from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.stage import Chain, Stage, StageState, State, older_format, why_stale
from gguf_assets.lib.project.teacher_choice import teacher_choice

HALVES = ("teacher", "student")


class ShardError(UserError, RuntimeError):
    pass


def prompts_hash(prompts: list[str]) -> str:
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()


def half_settings(half: str, settings: Settings) -> dict:
    """The settings a shard half is computed from. Batch sizes and devices are left out: they
    change speed, not results. Part of the half's fingerprint, and what Dagster observes."""
    p = settings.precompute
    if half == "teacher":
        return {**teacher_choice(settings).targets_settings(settings), "dtype": p.target_dtype,
                "template": p.prompt_template}
    return {"conditioning": p.conditioning, "dtype": p.student_dtype}


def half_fingerprint(half: str, settings: Settings, materials: MaterialsManifest, shard_prompts_hash: str) -> str:
    """Everything a half depends on: its settings, the pinned models it runs, and its prompts."""
    model = "student" if half == "student" else teacher_choice(settings).targets_model
    extra = {}
    kind = (materials.teacher or {}).get("kind") if half == "teacher" and model == "teacher" else None
    if kind == LLADA_IMAGE_PIPELINE:
        # The pipeline's own forward: its version, and the modeling code it ran (a changed file recomputes).
        # Query rows, their layer and the template are the kind's own, so those settings do not enter.
        p = settings.precompute
        return atomic.fingerprint({"half": half, "prompts": shard_prompts_hash, "kind": kind,
                                   "forward": TEACHER_FORWARDS[kind], "remote_code": materials.teacher["remote_code"],
                                   "dtype": p.target_dtype, model: materials.pin(model), "format": formats.SHARD_HALF})
    if half == "teacher" and model == "teacher" and settings.materials.query_rows:
        # The rows' content (the tensor's sha256): a moved branch of their repo makes the targets stale.
        extra["query_rows_sha256"] = (materials.query_rows or {}).get("tensor_sha256")
    return atomic.fingerprint({"half": half, "prompts": shard_prompts_hash, **half_settings(half, settings),
                               model: materials.pin(model), "format": formats.SHARD_HALF, **extra})


def halves_for_mode(mode: str) -> tuple[str, ...]:
    return {"teacher+student": HALVES, "teacher": ("teacher",), "student": ("student",)}[mode]


def half_status(folder: Path, half: str, fingerprint: str) -> HalfState:
    """Current, missing, stale (settings changed) or corrupt (bytes changed).

    The data file is checked by its recorded size, mtime and inode (lib/core/verify.py): no byte is
    read unless its stamp is unsure; then its content decides, and the new stamp is stored.
    Readers check the content as they read it (lib/core/safetensors_io.py: read_torch).
    """
    meta_path, data_path = folder / f"{half}.json", data_file(folder, half)
    if not meta_path.is_file() or not data_path.is_file():
        return HalfState.MISSING
    try:
        meta = atomic.read_json(meta_path)
    except (OSError, json.JSONDecodeError):
        return HalfState.CORRUPT
    if meta.get("fingerprint") != fingerprint:
        return HalfState.STALE
    now = verify.confirmed(data_path, meta)
    if now is None:
        return HalfState.CORRUPT
    verify.store_refreshed(meta_path, meta, now)
    return HalfState.CURRENT


def forget_half(folder: Path, half: str) -> None:
    """Drop a half's record (its sidecar), so the planner computes the half again."""
    (folder / f"{half}.json").unlink(missing_ok=True)


@dataclass
class ShardPlan:
    split: str
    key: str
    prompts: list[str]
    fingerprints: dict[str, str]

    def folder(self, paths: ProjectPaths) -> Path:
        return paths.shard_dir(self.split, self.key)


def shard_size(settings: Settings, split: str) -> int:
    return settings.precompute.shard_size if split == "train" else settings.precompute.val_shard_size


def shards_stage_settings(settings: Settings, split: str) -> dict:
    """What a split's shards are computed from, as settings/<split>_shards shows it: each half's settings, the
    models the mode loads and the shard size (it places prompts in shards: a new one makes them missing).

    The fingerprints see a model through its pin (source and commit); the shards list the sources they
    load, so a new source marks them, and not the stages that never load it."""
    choice = teacher_choice(settings)
    m = settings.materials
    return {"halves": {half: half_settings(half, settings) for half in halves_for_mode(settings.precompute.mode)},
            "models": {"student": m.student if choice.loads_student_model else None,
                       "teacher": m.teacher if choice.loads_teacher_model else None},
            "shard_size": shard_size(settings, split)}


def plan_shards(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str) -> list[ShardPlan]:
    size = shard_size(settings, split)
    plans = []
    for index, prompts in enumerate(shard_prompts(read_split(paths, split), size)):
        h = prompts_hash(prompts)
        plans.append(ShardPlan(split, shard_key(index), prompts,
                               {half: half_fingerprint(half, settings, materials, h) for half in HALVES}))
    return plans


def shard_status(paths: ProjectPaths, settings: Settings, plan: ShardPlan) -> dict[str, HalfState]:
    return {half: half_status(plan.folder(paths), half, plan.fingerprints[half])
            for half in halves_for_mode(settings.precompute.mode)}


def planned_fingerprints(settings: Settings, plans: list[ShardPlan]) -> list[str]:
    """Per planned shard, the fingerprint of the halves the mode makes (what training and the report read)."""
    halves = halves_for_mode(settings.precompute.mode)
    return [":".join(plan.fingerprints[h] for h in halves) for plan in plans]


def shard_fingerprints(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str) -> list[str]:
    """A split's shard fingerprints, as they are when made now: what the adapter's and the report's fingerprints
    chain."""
    return planned_fingerprints(settings, plan_shards(paths, settings, materials, split))


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


def chain_split(chain: Chain, split: str) -> SplitView:
    """``split``'s view, planned once per status question."""
    return chain.once(f"split:{split}", lambda: split_view(chain.paths, chain.settings, chain_materials(chain), split))


def chain_shard_fingerprints(chain: Chain, split: str) -> list[str]:
    """``split``'s planned shard fingerprints: the question's split view's when it has one, else planned alone,
    once (their halves are not checked)."""
    if (view := chain.known.get(f"split:{split}")) is not None:
        return view.fingerprints
    return chain.once(f"shard_fingerprints:{split}", lambda: shard_fingerprints(chain.paths, chain.settings,
                                                                                chain_materials(chain), split))


def _split_state(stage: Stage, chain: Chain) -> StageState:
    """A split's state from its shards' half states, with how many are current and why the rest are not."""
    split = stage.name.removesuffix("_shards")
    view = chain_split(chain, split)
    states = {key: set(halves.values()) for key, halves in view.halves.items()}
    todo = [key for key, st in states.items() if st != {HalfState.CURRENT}]
    state = _shards_state(states, todo)
    detail = f"{len(view.plans) - len(todo)}/{len(view.plans)} shards current"
    if state in (State.STALE, State.DAMAGED):
        detail += f"; {_why_shards_stale(stage, chain, [p for p in view.plans if p.key in todo])}"
    return StageState(stage.name, state, detail)


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


def _why_shards_stale(stage: Stage, chain: Chain, todo: list[ShardPlan]) -> str:
    """Why the first stale shard is stale: the settings its half was made under, or a changed file."""
    split = stage.name.removesuffix("_shards")
    for plan in todo:
        folder = plan.folder(chain.paths)
        for half in halves_for_mode(chain.settings.precompute.mode):
            state = half_status(folder, half, plan.fingerprints[half])
            if state == HalfState.CORRUPT:
                return f"shard {split}/{plan.key}: its {half} half changed on disk"
            if state == HalfState.STALE:
                if older := older_format(folder / f"{half}.json", "shard"):
                    return f"shard {split}/{plan.key}: its {half} half was {older}"
                return why_stale(chain, stage, folder / f"{half}.json",
                                 f"shard {split}/{plan.key}: its {half} half was made from other prompts or models")
    return "some shards were made under other settings"


def _shards_stage(split: str) -> Stage:
    """A split's shards as a stage: no one record (each half has its own), so its state is _split_state's."""
    return Stage(f"{split}_shards", f"{split.capitalize()} shards",
                 record=lambda paths, settings: paths.root / "shards" / split,
                 settings=lambda settings: shards_stage_settings(settings, split),
                 fingerprint=lambda chain: atomic.fingerprint(chain_shard_fingerprints(chain, split)),
                 state=_split_state)


TRAIN_SHARDS_STAGE, VAL_SHARDS_STAGE = _shards_stage("train"), _shards_stage("val")


def data_file(folder: Path, half: str) -> Path:
    return folder / (TEACHER_FILE if half == "teacher" else STUDENT_FILE)


def require_current(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, split: str) -> list[Path]:
    """The split's shard folders, after checking every half the mode needs is current.

    Readers (training, evaluation) call this so a stale or changed half is never used; they check
    each file's content against its recorded sha256 as they read it.
    """
    plans = plan_shards(paths, settings, materials, split)
    bad = [f"{plan.key} {half} half is {state}" for plan in plans
           for half, state in shard_status(paths, settings, plan).items() if state != HalfState.CURRENT]
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ShardError(f"{split} shards are not current ({shown}). Materialize {split}_shards again: "
                         "exactly those halves are recomputed.")
    return [plan.folder(paths) for plan in plans]
