"""The stages in pipeline order, each one's settings and the fingerprint its result has when made now: composed
from the stages' own modules, never defined here.

Each stage owns, in one torch-free module, the settings its result is computed from, its fingerprint and
its "is it current" check: lib/materials/materials_run.py, lib/corpus/corpus_run.py, lib/precompute/shards.py,
lib/training/training_run.py, lib/output/export_run.py and lib/output/report_run.py. A stage's fingerprint
chains the fingerprints of what it reads, so a change anywhere marks exactly the stages whose results it
changes, in `status` (lib/status/states.py) as in the Dagster UI (defs/settings.py).
"""

from __future__ import annotations

from typing import Literal, get_args, get_origin

from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.corpus.corpus_run import corpus_fingerprint, corpus_stage_settings
from gguf_assets.lib.materials.materials_run import load_manifest, materials_fingerprint, materials_settings_key
from gguf_assets.lib.output.export_run import gguf_fingerprint, gguf_stage_settings
from gguf_assets.lib.output.report_run import report_fingerprint, report_settings
from gguf_assets.lib.precompute.shards import shard_fingerprints, shards_stage_settings
from gguf_assets.lib.project.layout import SPLITS, ProjectPaths
from gguf_assets.lib.project.settings import SECTIONS, Settings
from gguf_assets.lib.training.training_run import adapter_stage_settings, run_fingerprint

# The stages in pipeline order, the one list of them; each group is what one named job runs (defs/jobs.py,
# pipeline/plan.py): the inputs (on CPU), the shards of each split, then training, export and evaluation.
INPUT_STAGES = ("materials", "corpus")
SHARD_STAGES = tuple(f"{split}_shards" for split in SPLITS)
TRAINING_STAGES = ("adapter", "gguf", "eval_report")
STAGES = (*INPUT_STAGES, *SHARD_STAGES, *TRAINING_STAGES)
# Each stage's name as people read it (the studio's stage table, its Run preview and outdated-result line): the
# one list of them, in STAGES' order.
STAGE_TITLES = {"materials": "Materials", "corpus": "Corpus", "train_shards": "Train shards",
                "val_shards": "Val shards", "adapter": "Adapter (training)", "gguf": "GGUF export",
                "eval_report": "Evaluation"}


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
    return {
        "materials": materials_settings_key(settings),
        "corpus": corpus_stage_settings(settings),
        "train_shards": shards_stage_settings(settings, "train"),
        "val_shards": shards_stage_settings(settings, "val"),
        "adapter": adapter_stage_settings(settings),
        "gguf": gguf_stage_settings(settings),
        "eval_report": report_settings(settings),
    }


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


def expected_fingerprints(paths: ProjectPaths, settings: Settings, view=None) -> dict[str, str]:
    """Per stage, the fingerprint its result has when made now from these settings and the inputs on disk;
    a stage is missing here while what it is computed from does not exist yet (no materials manifest,
    no corpus).

    These are the data versions Dagster sees for settings/<stage> (defs/settings.py): each fingerprint
    chains the fingerprints of what its stage reads, so a change anywhere marks exactly the stages whose
    results it changes, in the UI as in `status`, with no second copy of the graph. Every one is known
    before its stage runs (the adapter's from the settings and the shards, not from training).

    ``view``: this question's states.ProjectView, when it was asked already: its manifest, shard plans and
    adapter fingerprint are used as they are, not computed again (one question, one computation of each).
    """
    out = {"materials": materials_fingerprint(settings)}
    if not paths.materials_manifest.is_file():
        return out
    if view is not None and view.materials is not None:
        materials = view.materials
    else:
        try:
            materials = load_manifest(paths)
        except (OSError, ValueError, TypeError, UserError):  # damaged: status says so, materials is redone
            return out
    out["corpus"] = corpus_fingerprint(paths, settings, materials)
    if not all(paths.corpus_file(split).is_file() for split in SPLITS):
        return out
    planned = view is not None and view.splits is not None and view.adapter_fp is not None
    shard_fps = {split: view.splits[split].fingerprints if planned else
                 shard_fingerprints(paths, settings, materials, split) for split in SPLITS}
    for split in SPLITS:
        out[f"{split}_shards"] = atomic.fingerprint(shard_fps[split])
    out["adapter"] = view.adapter_fp if planned else run_fingerprint(paths, settings, shard_fps["train"],
                                                                     shard_fps["val"])
    out["gguf"] = gguf_fingerprint(settings, materials, out["adapter"])
    out["eval_report"] = report_fingerprint(settings, out["gguf"], shard_fps["val"])
    return out
