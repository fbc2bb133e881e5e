"""Training: the adapter, with checkpoints; metrics are logged as observations so the UI plots them."""


import dagster as dg

from gguf_assets.defs.precompute import GPU_POOL, train_shards, val_shards
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.lib import atomic
from gguf_assets.lib.materials import load_manifest
from gguf_assets.lib.pipeline import adapter_fingerprint
from gguf_assets.lib.shards import plan_shards
from gguf_assets.lib.train import train_adapter
from gguf_assets.lib.verdict import verdict


@dg.asset(group_name="training", deps=[train_shards, val_shards], pool=GPU_POOL,
          description="The adapter (learned query rows attending to the student's states), trained with the "
                      "trainer8 recipe; resumes exactly from the last checkpoint of the same settings.")
def adapter(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    paths, settings = project.paths(), project.settings()
    materials = load_manifest(paths)
    folders = {split: [plan.folder(paths) for plan in plan_shards(paths, settings, materials, split)]
               for split in ("train", "val")}
    fingerprint = adapter_fingerprint(paths, settings, materials)

    def on_event(kind: str, data: dict) -> None:
        if kind in ("log", "validate"):
            numbers = {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}
            context.log_event(dg.AssetObservation(asset_key=context.asset_key, metadata=numbers))

    summary = train_adapter(paths, settings, train_folders=folders["train"], val_folders=folders["val"],
                            fingerprint=fingerprint, on_event=on_event)
    run_dir = paths.checkpoints_dir(fingerprint)
    atomic.write_json(paths.adapter_manifest, {"fingerprint": fingerprint, "run_dir": str(run_dir.relative_to(paths.root)),
                                               "val_centred_cosine": summary["val_centred_cosine"]})
    text, advice = verdict(summary["val_centred_cosine"])
    curve = ["| step | loss | val centred cosine |", "|---|---|---|"]
    for entry in summary["history"]:
        curve.append(f"| {entry['step']} | {entry.get('loss', ''):{'.4f' if 'loss' in entry else ''}} | "
                     f"{entry.get('val_centred_cosine', ''):{'.4f' if 'val_centred_cosine' in entry else ''}} |")
    return dg.MaterializeResult(metadata={
        "fingerprint": fingerprint, "steps": summary["step"],
        "val_centred_cosine": summary["val_centred_cosine"],
        "empty_prompt_cosine": summary["empty_prompt_cosine"] if summary["empty_prompt_cosine"] is not None else float("nan"),
        "untrained_val_centred_cosine": summary["untrained_val_centred_cosine"] if summary["untrained_val_centred_cosine"] is not None else float("nan"),
        "val_loss": summary["val_loss"],
        "checkpoints": dg.MetadataValue.path(str(run_dir)),
        "verdict": dg.MetadataValue.md(f"**{text}**\n\n{advice}"),
        "training_metrics": dg.MetadataValue.md("\n".join(curve)),
    })
