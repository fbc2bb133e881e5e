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

from gguf_assets.lib.core.lock import HolderRecord
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.precompute.shards_run import (  # noqa: F401  plan_shards: where tests count the planning
    ShardPlan,
    SplitView,
    plan_shards,
    split_view,
)
from gguf_assets.lib.project.layout import SPLITS, ProjectPaths
from gguf_assets.lib.project.manifests import MaterialsManifest
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.stage import (  # noqa: F401  the states, as every reader imports them from here
    RESUMABLE,
    UNFINISHED,
    Chain,
    StageState,
    State,
)
from gguf_assets.lib.status.stages import STEPS, new_chain
from gguf_assets.lib.training.training_run import adapter_fingerprint, last_checkpoint_step, run_fingerprint


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
    # The status question's chain: every fingerprint it computed, which expected_fingerprints reuses.
    chain: Chain | None = None

    def learned(self) -> dict:
        """What this view knows, as a Chain keeps it (a view planned apart from a status question)."""
        known = {f"split:{split}": view for split, view in (self.splits or {}).items()}
        if self.materials is not None:
            known["materials"] = self.materials
        if self.adapter_fp is not None:
            known["fingerprint:adapter"] = self.adapter_fp
        return known

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


def status_view(paths: ProjectPaths, settings: Settings, chain: Chain | None = None) -> ProjectView:
    """project_status's stages, with the materials manifest, shard plans and half states and the adapter
    fingerprint it computed them from (each split's corpus is read once, each fingerprint computed once).
    ``chain``: a chain of these settings begun already (fingerprints asked first), whose answers it reuses."""
    chain = new_chain(paths, settings) if chain is None else chain
    stages = _stages(chain)
    splits = {split: chain.known[f"split:{split}"] for split in SPLITS} if "split:val" in chain.known else None
    return ProjectView(stages, chain.known.get("materials"), splits,
                       chain.fingerprint("adapter") if splits else None, chain=chain)


def _stages(chain: Chain) -> list[StageState]:
    """Each stage's state, step by step in pipeline order (lib/status/stages.py STEPS): the stages after an
    unfinished step, or after a setting that rules a stage out, are blocked."""
    out: list[StageState] = []
    waits = ""
    for step in STEPS:
        waits = waits or step[0].blocked_by(chain.settings)
        if waits:
            out += [StageState(stage.name, State.BLOCKED, waits) for stage in step]
            continue
        states = [stage.state_of(chain) for stage in step]
        out += states
        if any(state.state != State.CURRENT for state in states):
            waits = f"waits for {step[-1].name}"
    return out


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
