"""What is left to do for a project, as the next named job to run: one function for `gguf-trainer run`
and for the daemon's resume sensor.

The decision comes from the project status (lib/status/states.py, from each stage's own fingerprint).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf_assets.lib.corpus.corpus_run import corpus_manifest
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import SPLITS, ProjectPaths
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.status.stages import INPUT_STAGES, TRAINING_STAGES
from gguf_assets.lib.status.states import UNFINISHED, ProjectView, StageState, State, status_view
from gguf_assets.pipeline.names import MATERIALS_AND_CORPUS, SHARDS_JOB, TRAIN_AND_EXPORT
from gguf_assets.pipeline.partitions import BY_SPLIT, expected_shard_keys, partitions_match
from gguf_assets.pipeline.run_tags import PIPELINE_TAG, RANGE_END_TAG, RANGE_START_TAG


@dataclass(frozen=True)
class Work:
    """One run's worth of work: a named job, the assets it materializes, and its shard partitions."""
    job: str
    assets: tuple[str, ...]
    partitions: tuple[str, ...] = ()
    # True when it continues or repairs work asked for under these settings (missing, partial, damaged:
    # a first run, one cut off part-way, a broken file); False when it is new work a settings edit made (a stale
    # result replaced, training.steps raised after a finished run), which waits for the user.
    missing: bool = True
    why: str = ""  # its first stage's state, with why (status' words): what a waiting daemon says

    def describe(self) -> str:
        shards = f" (shards {self.partitions[0]}..{self.partitions[-1]})" if self.partitions else ""
        return f"{self.job}: {', '.join(self.assets)}{shards}"

    def tags(self, settings: Settings, partitions: tuple[str, ...] | None = None) -> dict[str, str]:
        keys = self.partitions if partitions is None else partitions
        tags = {PIPELINE_TAG: settings_history.settings_hash(settings)}
        if keys:
            tags.update({RANGE_START_TAG: keys[0], RANGE_END_TAG: keys[-1]})
        return tags


def next_work(paths: ProjectPaths, settings: Settings, instance, view: ProjectView | None = None) -> Work | None:
    """The next job to run for this project, or None when everything is current (or blocked). ``view``: the status
    question the caller asked already (observe_settings'), else asked here."""
    status = {s.stage: s for s in (status_view(paths, settings) if view is None else view).stages}
    if status["materials"].state != State.CURRENT:
        # New materials come with the corpus: it reads them, and when it finds itself current it
        # only records that (same data version), so Dagster does not show it stale.
        return Work(MATERIALS_AND_CORPUS, INPUT_STAGES, missing=status["materials"].resumable,
                    why=_said(status["materials"]))
    if status["corpus"].state != State.CURRENT or not partitions_match(
            instance, expected_shard_keys(corpus_manifest(paths), settings)):
        return Work(MATERIALS_AND_CORPUS, ("corpus",), missing=status["corpus"].resumable,
                    why=_said(status["corpus"]))
    for split in SPLITS:
        shards = status[f"{split}_shards"]
        if shards.state != State.CURRENT:
            keys = tuple(instance.get_dynamic_partitions(BY_SPLIT[split].name))
            return Work(SHARDS_JOB[split], (f"{split}_shards",), keys, missing=shards.resumable,
                        why=_said(shards))
    todo = [s for s in TRAINING_STAGES if status[s].state in UNFINISHED]
    if not todo:
        return None
    # Once one stage is redone, everything after it is redone too.
    return Work(TRAIN_AND_EXPORT, TRAINING_STAGES[TRAINING_STAGES.index(todo[0]):],
                missing=status[todo[0]].resumable, why=_said(status[todo[0]]))


def _said(stage: StageState) -> str:
    return f"{stage.stage} {stage.state}" + (f": {stage.detail}" if stage.detail else "")


def split_range(keys: list[str] | tuple[str, ...], parts: int) -> list[tuple[str, ...]]:
    """Contiguous key ranges, as even as possible, at most ``parts`` of them."""
    keys = tuple(keys)
    parts = max(1, min(parts, len(keys)))
    bounds = [round(i * len(keys) / parts) for i in range(parts + 1)]
    return [keys[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
