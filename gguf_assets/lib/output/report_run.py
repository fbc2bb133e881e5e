"""What an evaluation report is: the settings it depends on, its fingerprint and whether the report on disk is
current. No torch or numpy here: `status` and the planner read it (lib/status/), and so does the report asset
to record the fingerprint it is made under.
"""

from __future__ import annotations

from gguf_assets.lib.core import atomic
from gguf_assets.lib.precompute.shards_run import chain_shard_fingerprints
from gguf_assets.lib.project import formats
from gguf_assets.lib.project.layout import ProjectPaths
from gguf_assets.lib.project.manifests import recorded_fingerprint
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.project.stage import Stage


def report_settings(settings: Settings) -> dict:
    """The settings the report's fingerprint holds; settings/eval_report shows the same."""
    # The report lists the exported files, so the settings that change that list count too.
    o = settings.output
    return {"evaluate": o.evaluate, "ggk_command": o.ggk_command, "vision": o.export_vision_encoder,
            "also_copy_to": o.also_copy_to}


def report_fingerprint(settings: Settings, gguf_fp: str, val_fps: list[str]) -> str:
    # The export's fingerprint covers what it was made from (vision source included), and the export is
    # deterministic, so it stands for the GGUF's bytes; it is known before the export runs (expected_fingerprints).
    return atomic.fingerprint({"gguf": gguf_fp, "val": val_fps, **report_settings(settings),
                               "format": formats.EVAL_REPORT})


def report_is_current(paths: ProjectPaths, settings: Settings, gguf_fp: str | None, val_fps: list[str]) -> bool:
    """The report names the fingerprint it has when made now from the export ``gguf_fp`` and these val shards."""
    return recorded_fingerprint(paths.report_json(settings)) == report_fingerprint(settings, gguf_fp, val_fps)


REPORT_STAGE = Stage(
    "eval_report", "Evaluation", record=lambda paths, settings: paths.report_json(settings), settings=report_settings,
    fingerprint=lambda chain: report_fingerprint(chain.settings, chain.fingerprint("gguf"),
                                                 chain_shard_fingerprints(chain, "val")),
    is_current=lambda chain: recorded_fingerprint(chain.paths.report_json(chain.settings))
    == chain.fingerprint("eval_report"),
    stale_because="the GGUF was exported again, or the val shards changed, since it was evaluated")
