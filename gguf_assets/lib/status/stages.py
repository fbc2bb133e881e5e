"""The stages in pipeline order: the list of their records (lib/project/stage.py ``Stage``), each defined in the
torch-free module of its stage, never here.

Each stage owns, in one module, its title, the record of its result, the settings its result is computed from,
its fingerprint and its state: lib/materials/materials_run.py, lib/corpus/corpus_run.py,
lib/precompute/shards_run.py, lib/training/training_run.py, lib/output/export_run.py and lib/output/report_run.py.
A stage's fingerprint chains the fingerprints of what it reads, so a change anywhere marks exactly the stages
whose results it changes, in `status` (lib/status/states.py) as in the Dagster UI (defs/settings.py).
docs/code_layout.md shows how to add one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args, get_origin

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.corpus.corpus_run import CORPUS_STAGE
from gguf_assets.lib.materials.materials_run import MATERIALS_STAGE, chain_materials
from gguf_assets.lib.output.export_run import GGUF_STAGE, gguf_fingerprint
from gguf_assets.lib.output.report_run import REPORT_STAGE, report_fingerprint
from gguf_assets.lib.precompute.shards_run import TRAIN_SHARDS_STAGE, VAL_SHARDS_STAGE, chain_shard_fingerprints
from gguf_assets.lib.project.layout import SPLITS, ProjectPaths
from gguf_assets.lib.project.settings import SECTIONS, Settings
from gguf_assets.lib.project.stage import Chain, Stage
from gguf_assets.lib.training.training_run import ADAPTER_STAGE

# The stages in pipeline order, in steps: a step's stages are asked together, and every stage after an
# unfinished step waits for it (the shards of both splits are planned before either blocks training).
STEPS: tuple[tuple[Stage, ...], ...] = ((MATERIALS_STAGE,), (CORPUS_STAGE,), (TRAIN_SHARDS_STAGE, VAL_SHARDS_STAGE),
                                        (ADAPTER_STAGE,), (GGUF_STAGE,), (REPORT_STAGE,))
RECORDS = {stage.name: stage for step in STEPS for stage in step}
# Each group is what one named job runs (defs/jobs.py, pipeline/plan.py): the inputs (on CPU), the shards of each
# split, then training, export and evaluation.
INPUT_STAGES = ("materials", "corpus")
SHARD_STAGES = tuple(f"{split}_shards" for split in SPLITS)
TRAINING_STAGES = ("adapter", "gguf", "eval_report")
STAGES = tuple(RECORDS)
assert STAGES == (*INPUT_STAGES, *SHARD_STAGES, *TRAINING_STAGES)
# Each stage's name as people read it (the studio's stage table, its Run preview and outdated-result line).
STAGE_TITLES = {name: stage.title for name, stage in RECORDS.items()}


def new_chain(paths: ProjectPaths, settings: Settings) -> Chain:
    """A status question's chain over every stage."""
    return Chain(paths, settings, RECORDS)


def stage_title(stage: str) -> str:
    """``stage``'s title (its own name for a stage not in STAGES)."""
    return STAGE_TITLES.get(stage, stage)


def stage_settings(settings: Settings) -> dict[str, dict]:
    """Per stage, the settings its result is computed from: each stage's own slice, the same settings its
    fingerprint reads.

    Dagster sees them as the observable source assets settings/<stage> (defs/settings.py), so a
    settings edit marks exactly the stages whose fingerprints it changes, and everything after
    them, as stale in the UI. Settings that only place a file (output_dir, shard sizes) are here
    too: they make the recorded result missing rather than different.
    """
    return {name: stage.settings(settings) for name, stage in RECORDS.items()}


def stage_keys(settings: Settings, stage: str) -> list[str]:
    """The project.yaml keys (``section.key``) that enter ``stage``'s result: each one, changed alone, changes
    the stage's slice of ``stage_settings``. Derived from that function, so it can never drift from it."""
    base = stage_settings(settings)[stage]
    keys = []
    for key, changed in each_key_changed(settings):
        try:
            differs = stage_settings(changed)[stage] != base
        except Exception:  # noqa: BLE001  a stage that cannot even be described without this key reads it
            differs = True
        if differs:
            keys.append(key)
    return keys


def each_key_changed(settings: Settings):
    """(``section.key``, ``settings`` with only that key set to another value of its type), for every key."""
    for section in SECTIONS:
        current = getattr(settings, section)
        for name, info in type(current).model_fields.items():
            altered = another_value(getattr(current, name), info.annotation)
            # model_copy skips validation: a value that breaks a cross-check still shows what it would change.
            yield f"{section}.{name}", settings.model_copy(update={section: current.model_copy(update={name: altered})})


def another_value(value, annotation):
    """Some other value of a setting's type (another choice for a Literal)."""
    if get_origin(annotation) is Literal:
        # A one-choice Literal (precompute.conditioning until ggk's next contract) still names what it feeds.
        return next((choice for choice in get_args(annotation) if choice != value), f"{value}-other")
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, list):
        numbers = value and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return [*value, max(value) + 1 if numbers else "other"]  # a list of layers stays one
    if isinstance(value, dict):
        return {**value, "other": 1}
    return "other"


def expected_fingerprints(paths: ProjectPaths, settings: Settings, view=None, *, adapter_fp: str | None = None,
                          chain: Chain | None = None, stages: Sequence[str] = STAGES) -> dict[str, str]:
    """Per stage, the fingerprint its result has when made now from these settings and the inputs on disk;
    a stage is missing here while what it is computed from does not exist yet (no materials manifest,
    no corpus).

    These are the data versions Dagster sees for settings/<stage> (defs/settings.py): each fingerprint
    chains the fingerprints of what its stage reads, so a change anywhere marks exactly the stages whose
    results it changes, in the UI as in `status`, with no second copy of the graph. Every one is known
    before its stage runs (the adapter's from the settings and the shards, not from training).

    ``view``: this question's states.ProjectView, when it was asked already: its manifest, shard plans and
    adapter fingerprint are used as they are, not computed again (one question, one computation of each).
    ``adapter_fp``: the training run to count as the adapter, one of those the settings stand for
    (training_run.standing_runs) though they prefer another now (`gguf-trainer runs --use` makes it current).
    ``chain``: the question's chain when there is no view yet. ``stages``: only these stages' fingerprints (and
    what they chain) are computed.
    """
    if chain is None:
        chain = view.chain if view is not None and view.chain is not None else new_chain(paths, settings)
    if view is not None and view.chain is None:  # a view planned apart from a status question: its manifest and plans
        chain.known.update(view.learned())
    out: dict[str, str] = {}

    def add(*names: str) -> None:
        out.update({name: chain.fingerprint(name) for name in names if name in stages})

    add("materials")
    if not paths.materials_manifest.is_file():
        return out
    try:
        materials = chain_materials(chain)
    except (OSError, ValueError, TypeError, UserError):  # damaged: status says so, materials is redone
        return out
    add("corpus")
    if not all(paths.corpus_file(split).is_file() for split in SPLITS):
        return out
    add(*SHARD_STAGES, *TRAINING_STAGES)
    if adapter_fp is not None:  # another run than the one the settings prefer: the stages after it chain its own
        out["adapter"] = adapter_fp
        out["gguf"] = gguf_fingerprint(settings, materials, adapter_fp)
        out["eval_report"] = report_fingerprint(settings, out["gguf"], chain_shard_fingerprints(chain, "val"))
    return out
