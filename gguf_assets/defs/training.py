"""Training: the adapter, with checkpoints; metrics are logged as observations so the UI plots them."""


import dagster as dg

from gguf_assets.defs.panels import panel_metadata
from gguf_assets.defs.precompute import GPU_POOL, train_shards, val_shards
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.defs.settings import settings_key
from gguf_assets.lib import atomic, verify
from gguf_assets.lib.hardware import HardwareSampler
from gguf_assets.lib.materials import load_manifest
from gguf_assets.lib.pipeline import adapter_fingerprint
from gguf_assets.lib.shards import require_current
from gguf_assets.lib.train import (
    CURVES_FILE,
    FINAL_DIR,
    META_FILE,
    WEIGHTS_FILE,
    curves_markdown,
    curves_svg,
    train_adapter,
)
from gguf_assets.lib.verdict import verdict

# Rows of the metrics table in the Markdown metadata; the full history is in final/meta.json.
TABLE_ROWS = 40


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else float("nan")


def _metrics_table(history: list[dict]) -> str:
    rows = ["| step | loss | lr | grad norm | samples/s | val centred cosine | empty prompt | val loss |",
            "|---|---|---|---|---|---|---|---|"]
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

    for step in steps:
        e = merged[step]
        rows.append(f"| {step} | {cell(e, 'loss', '.4f')} | {cell(e, 'lr', '.2e')} | {cell(e, 'grad_norm', '.3f')} | "
                    f"{cell(e, 'samples_per_s', '.1f')} | {cell(e, 'val_centred_cosine', '.4f')} | "
                    f"{cell(e, 'empty_prompt_cosine', '.4f')} | {cell(e, 'val_loss', '.4f')} |")
    return "\n".join(rows)


@dg.asset(group_name="training", deps=[train_shards, val_shards, settings_key("adapter")], pool=GPU_POOL,
          description="The adapter (learned query rows attending to the student's states), trained with the "
                      "trainer8 recipe; resumes exactly from the last checkpoint of the same settings.")
def adapter(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    paths, settings = project.paths(), project.settings()
    materials = load_manifest(paths)
    # Checked first (stamps), then each half's sha256 as training reads it: nothing changed is trained on.
    folders = {split: require_current(paths, settings, materials, split)
               for split in ("train", "val")}
    fingerprint = adapter_fingerprint(paths, settings, materials)

    hardware = HardwareSampler()

    def on_event(kind: str, data: dict) -> None:
        # Notes are logged by the library itself (the event log captures gguf_assets' loggers).
        if kind in ("log", "validate"):
            # One observation per log/validate step: Dagster plots each numeric key over time.
            numbers = {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}
            if kind == "log":  # the live hardware panel: GPU/CPU/RAM beside the loss, plotted as it runs
                numbers.update(hardware.sample())
            context.log_event(dg.AssetObservation(asset_key=context.asset_key, metadata=numbers))

    with hardware:  # samples GPU/CPU/RAM in the background for the run's summary
        summary = train_adapter(paths, settings, train_folders=folders["train"], val_folders=folders["val"],
                                fingerprint=fingerprint, on_event=on_event)
    run_dir = paths.checkpoints_dir(fingerprint)
    weights = run_dir / FINAL_DIR / WEIGHTS_FILE
    recorded_sha256 = (atomic.read_json(run_dir / FINAL_DIR / META_FILE).get("sha256") or {}).get(WEIGHTS_FILE)
    atomic.write_json(paths.adapter_manifest, {"fingerprint": fingerprint,
                                               "run_dir": str(run_dir.relative_to(paths.root)),
                                               "final_weights": verify.record(weights, recorded_sha256),
                                               "val_centred_cosine": summary["val_centred_cosine"]})
    text, advice = verdict(summary["val_centred_cosine"])
    curves = run_dir / FINAL_DIR / CURVES_FILE
    svg = curves.read_text(encoding="utf-8") if curves.is_file() else curves_svg(summary["history"])
    best = summary.get("best") or {}
    started = (summary.get("started") or {}).get("message", "")
    return dg.MaterializeResult(metadata={
        **panel_metadata(), **hardware.summary(),
        "fingerprint": fingerprint, "steps": summary["step"],
        "val_centred_cosine": summary["val_centred_cosine"],
        "empty_prompt_cosine": _number(summary["empty_prompt_cosine"]),
        "untrained_val_centred_cosine": _number(summary["untrained_val_centred_cosine"]),
        "val_loss": summary["val_loss"],
        "best_step": _number(best.get("step")),
        "best_val_centred_cosine": _number(best.get("val_centred_cosine")),
        "read_mb_per_s": _number(summary.get("read_mb_per_s")),
        "checkpoints": dg.MetadataValue.path(str(run_dir)),
        "curves_svg": dg.MetadataValue.path(str(curves)),
        "verdict": dg.MetadataValue.md(f"**{text}**\n\n{advice}"),
        "training_curves": dg.MetadataValue.md(f"{curves_markdown(svg)}\n\n{started}"),
        "training_metrics": dg.MetadataValue.md(_metrics_table(summary["history"])),
    })
