"""Training: the adapter, with checkpoints; metrics are logged as observations so the UI plots them."""


import os

import dagster as dg

from gguf_assets.defs.panels import panel_metadata
from gguf_assets.defs.precompute import train_shards, val_shards
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.lib.core.commands import shell_line
from gguf_assets.lib.core.markdown import markdown_table
from gguf_assets.lib.core.metrics import EMPTY_PROMPT_COSINE, VAL_CENTRED_COSINE, VAL_LOSS, shown
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.precompute.shards_run import require_current
from gguf_assets.lib.project.layout import CURVES_FILE, FINAL_DIR
from gguf_assets.lib.telemetry.curves_log import TENSORBOARD_URL_ENV, run_folder, run_name, tensorboard_timeseries_url
from gguf_assets.lib.telemetry.hardware import HardwareSampler
from gguf_assets.lib.telemetry.render import curves_markdown, curves_svg
from gguf_assets.lib.training.events import LogStep, TrainingEvent, Validation
from gguf_assets.lib.training.training_run import planned_adapter_run
from gguf_assets.lib.training.verdict import verdict
from gguf_assets.pipeline import groups
from gguf_assets.pipeline.names import GPU_POOL
from gguf_assets.pipeline.settings_observation import settings_key

# Rows of the metrics table in the Markdown metadata; the full history is in final/meta.json.
TABLE_ROWS = 40


def _number(value) -> float:
    """A figure as metadata: a score to five significant digits (metrics.shown), a count whole, else NaN."""
    if isinstance(value, float):
        return shown(value)
    return float(value) if isinstance(value, int) else float("nan")


def _metrics_table(history: list[dict]) -> str:
    merged: dict[int, dict] = {}
    for entry in history:
        merged.setdefault(entry["step"], {}).update(entry)
    steps = sorted(merged)
    if len(steps) > TABLE_ROWS:
        stride = -(-len(steps) // TABLE_ROWS)
        steps = steps[::stride] + ([steps[-1]] if steps[-1] not in steps[::stride] else [])

    def cell(entry: dict, key: str, fmt: str) -> str:
        value = entry.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else ""

    columns = [("loss", ".4f"), ("lr", ".2e"), ("grad_norm", ".3f"), ("samples_per_s", ".1f"),
               (VAL_CENTRED_COSINE, ".4f"), (EMPTY_PROMPT_COSINE, ".4f"), (VAL_LOSS, ".4f")]
    return markdown_table(["step", "loss", "lr", "grad norm", "samples/s", "val centred cosine", "empty prompt",
                           "val loss"], ([step, *(cell(merged[step], key, fmt) for key, fmt in columns)]
                                         for step in steps), right=range(8))


@dg.asset(group_name=groups.TRAINING, deps=[train_shards, val_shards, settings_key("adapter")], pool=GPU_POOL,
          description="The adapter (learned query rows attending to the student's states), trained with the "
                      "trainer8 recipe; resumes exactly from the last checkpoint of the same settings.")
def adapter(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    # torch comes with it: imported by the run that trains, not by every process that loads the definitions
    from gguf_assets.lib.training.train import train_adapter

    paths, settings = project.paths(), project.settings()
    materials = load_manifest(paths)
    # Checked first (stamps), then each half's sha256 as training reads it: nothing changed is trained on.
    folders = {split: require_current(paths, settings, materials, split)
               for split in ("train", "val")}
    planned = planned_adapter_run(paths, settings, materials)  # a continuation or a run ended early included
    fingerprint = planned.fingerprint

    hardware = HardwareSampler()

    def on_event(event: TrainingEvent) -> None:
        # Notes are logged by the library itself (the event log captures gguf_assets' loggers).
        if isinstance(event, (LogStep, Validation)):
            # One observation per log/validate step: Dagster plots each numeric key over time. A LogStep
            # carries the live hardware sample (GPU/CPU/RAM) taken at that step.
            numbers = {k: _number(v) for k, v in event.figures().items() if isinstance(v, (int, float))}
            context.log_event(dg.AssetObservation(asset_key=context.asset_key, metadata=numbers))

    with hardware:  # samples GPU/CPU/RAM in the background for the run's summary
        summary = train_adapter(paths, settings, train_folders=folders["train"], val_folders=folders["val"],
                                fingerprint=fingerprint, on_event=on_event, sample_hardware=hardware.sample,
                                planned=planned)
    run_dir = paths.checkpoints_dir(fingerprint)
    # What training said, from its validation curve (a run finished by an earlier version may lack it).
    text, advice = (summary.verdict, summary.advice) if summary.verdict else verdict(summary.val_centred_cosine)
    curves = run_dir / FINAL_DIR / CURVES_FILE
    svg = curves.read_text(encoding="utf-8") if curves.is_file() else curves_svg(summary.history)
    best = summary.best
    started = summary.started.get("message", "")
    # Numbers are plotted across materializations: only those that mean something run after run.
    # The figures of this run alone go in a table (a one-point chart each was noise).
    once = {"best step": best.get("step"), "best val centred cosine": best.get(VAL_CENTRED_COSINE),
            "shard read MB/s": summary.read_mb_per_s, **hardware.summary()}
    panels = panel_metadata()
    project.result_written(context)
    return dg.MaterializeResult(data_version=dg.DataVersion(fingerprint), metadata={
        **project.stage_metadata("adapter", settings),
        "verdict": dg.MetadataValue.md(f"**{text}**\n\n{advice}"),
        VAL_CENTRED_COSINE: summary.val_centred_cosine,
        "untrained_val_centred_cosine": _number(summary.untrained_val_centred_cosine),
        EMPTY_PROMPT_COSINE: _number(summary.empty_prompt_cosine),
        VAL_LOSS: summary.val_loss, "steps": summary.step,
        "tensorboard": dg.MetadataValue.md(tensorboard_link(paths, settings, fingerprint)),
        "training_curves": dg.MetadataValue.md(f"{curves_markdown(svg)}\n\n{started}"),
        "training_metrics": dg.MetadataValue.md(_metrics_table(summary.history)),
        "this_run": dg.MetadataValue.md(markdown_table(["figure", "value"], [
            [k, _format(v)] for k, v in once.items() if v is not None])),
        "hardware": panels["hardware"], "environment": panels["environment"],
        "fingerprint": dg.MetadataValue.text(fingerprint),
        "checkpoints": dg.MetadataValue.path(str(run_dir)),
        "curves_svg": dg.MetadataValue.path(str(curves)),
    })


def _format(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def tensorboard_link(paths, settings, fingerprint: str) -> str:
    """Where this run's curves are in TensorBoard, which `gguf-trainer ui` serves beside Dagster."""
    url = os.environ.get(TENSORBOARD_URL_ENV)
    name = run_name(settings.training, fingerprint)
    link = tensorboard_timeseries_url(url, run=name) if url else ""
    where = (f"[{link}]({link}) (run `{name}`, unsmoothed)" if url else
             f"`{shell_line('gguf-trainer', 'ui', paths.root)}` serves them (run `{name}`)")
    return (f"Loss, learning rate, gradient norm, val centred cosine, empty-prompt cosine, throughput and "
            f"hardware against the step, one run per training fingerprint: {where}. The event files are in "
            f"`{run_folder(paths.root, settings.training, fingerprint)}`.")
