"""Output: the f16 GGUF export (adapter, optional vision encoder) and its evaluation report."""


import dagster as dg

from gguf_assets.defs.materials import materials
from gguf_assets.defs.precompute import val_shards
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.defs.training import adapter
from gguf_assets.lib import atomic
from gguf_assets.lib.export import export_adapter
from gguf_assets.lib.gguf_eval import evaluate_gguf
from gguf_assets.lib.layout import REPORT_JSON
from gguf_assets.lib.materials import load_manifest
from gguf_assets.lib.pipeline import gguf_path, report_fingerprint, shard_fingerprints
from gguf_assets.lib.report import build_report, render_evaluation, render_files, render_markdown, render_use_in_ggk
from gguf_assets.lib.shards import require_current


@dg.asset(group_name="output", deps=[adapter, materials], description="The adapter as an f16 GGUF: "
          "matrices f16; norms, biases and target statistics f32; self-describing metadata (docs/gguf_layout.md). "
          "Plus the paired vision encoder as a clip/mmproj GGUF when one was downloaded (docs/vision_gguf.md).")
def gguf(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    paths, settings = project.paths(), project.settings()
    summary = export_adapter(paths, settings, load_manifest(paths), atomic.read_json(paths.adapter_manifest))
    metadata = {
        "path": dg.MetadataValue.path(summary["path"]), "bytes": summary["bytes"], "sha256": summary["sha256"],
        "tensors": summary["tensor_count"], "f16_tensors": summary["f16_count"], "f32_tensors": summary["f32_count"],
        "kept_f32": ", ".join(summary["kept_f32"]) or "none",
        "exported_files": dg.MetadataValue.md(render_files(summary["files"], kept_f32=summary["kept_f32"])),
        "provenance": dg.MetadataValue.json(summary["provenance"]),
    }
    if summary["vision"]:
        vision = summary["vision"]
        metadata["vision_gguf"] = dg.MetadataValue.path(vision["path"])
        metadata["vision_bytes"] = vision["bytes"]
        metadata["vision_unmapped_tensors"] = ", ".join(vision["unmapped"]) or "none"
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(group_name="output", deps=[gguf, val_shards], description="Evaluation of the exported GGUF on the "
          "val shards by an independent numpy reader, with the verdict, advice and how to use it in ggk.")
def eval_report(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    paths, settings = project.paths(), project.settings()
    materials_manifest = load_manifest(paths)
    target = gguf_path(paths, settings)
    sidecar = atomic.read_json(target.with_suffix(".json"))
    folders = require_current(paths, settings, materials_manifest, "val")
    evaluation = evaluate_gguf(target, folders) if settings.output.evaluate else None
    fingerprint = report_fingerprint(settings, sidecar,
                                     shard_fingerprints(paths, settings, materials_manifest, "val"))
    report = build_report(paths, settings, materials_manifest, sidecar, evaluation, fingerprint=fingerprint)
    metadata = {"report_json": dg.MetadataValue.path(str(paths.output_dir(settings) / REPORT_JSON)),
                "report": dg.MetadataValue.md(render_markdown(report)),
                "evaluation": dg.MetadataValue.md(render_evaluation(report)),
                "exported_files": dg.MetadataValue.md(render_files(report["files"], kept_f32=report["kept_f32"])),
                "use_it_in_ggk": dg.MetadataValue.md(render_use_in_ggk(report)),
                "ggk_command": dg.MetadataValue.text(report["ggk_command"]),
                "verdict": report["verdict"], "gguf_sha256": report["gguf_sha256"]}
    # Numeric entries are plotted over time in the UI.
    for key in ("val_centred_cosine", "val_centred_cosine_torch", "gguf_vs_torch", "empty_prompt_cosine",
                "n_prompts", "eval_seconds"):
        if report[key] is not None:
            metadata[key] = float(report[key]) if key != "n_prompts" else int(report[key])
    return dg.MaterializeResult(metadata=metadata)
