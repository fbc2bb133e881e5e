"""Output: the f16 GGUF export (adapter, optional vision encoder) and its evaluation report."""


from pathlib import Path

import dagster as dg

from gguf_assets.defs.materials import materials
from gguf_assets.defs.precompute import val_shards
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.defs.training import adapter
from gguf_assets.lib.core import atomic
from gguf_assets.lib.core import metrics as m
from gguf_assets.lib.materials.materials_run import load_manifest
from gguf_assets.lib.output.export_run import export_sidecar, gguf_path
from gguf_assets.lib.output.report import (
    build_report,
    render_evaluation,
    render_files,
    render_markdown,
    render_use_in_ggk,
)
from gguf_assets.lib.output.report_run import report_fingerprint
from gguf_assets.lib.precompute.shards_run import require_current, shard_fingerprints
from gguf_assets.lib.project.manifests import Report
from gguf_assets.lib.training.verdict import GOOD, LISTENS_TOP1, retrieval_bar, retrieval_passes
from gguf_assets.pipeline import groups
from gguf_assets.pipeline.settings_observation import settings_key


@dg.asset(group_name=groups.OUTPUT, deps=[adapter, materials, settings_key("gguf")],
          description="The files ggk loads: the adapter GGUF (--llm-adapter, ggk's resampler: matrices f16; query, "
          "norms and biases f32; docs/gguf_layout.md), the student GGUF (--llm) with its tokenizer pack "
          "(--tokenizer-pack), and the paired SigVQ vision encoder GGUF (--llm_vision) when one was downloaded "
          "(docs/vision_gguf.md).")
def gguf(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    # numpy and torch come with it: imported by the run that exports, not by every process that loads definitions
    from gguf_assets.lib.output.export import export_adapter

    paths, settings = project.paths(), project.settings()
    materials_manifest = load_manifest(paths)
    summary = export_adapter(paths, settings, materials_manifest, atomic.read_json(paths.adapter_manifest),
                             val_folders=require_current(paths, settings, materials_manifest, "val"))
    metadata = {
        "path": dg.MetadataValue.path(summary.path), "bytes": summary.bytes, "sha256": summary.sha256,
        "tensors": summary.tensor_count, "f16_tensors": summary.f16_count, "f32_tensors": summary.f32_count,
        "kept_f32": ", ".join(summary.kept_f32) or "none",
        "exported_files": dg.MetadataValue.md(render_files(summary.files, kept_f32=summary.kept_f32)),
        "provenance": dg.MetadataValue.json(summary.provenance),
    }
    if summary.vision:
        vision = summary.vision
        metadata["vision_gguf"] = dg.MetadataValue.path(vision["path"])
        metadata["vision_bytes"] = vision["bytes"]
        metadata["vision_skipped_tensors"] = ", ".join(vision["skipped"]) or "none"
    metadata.update(project.stage_metadata("gguf", settings))
    project.result_written(context)
    return dg.MaterializeResult(data_version=dg.DataVersion(summary.fingerprint), metadata=metadata)


# The numpy reader of the f16 GGUF and the f32 torch checkpoint must agree this closely.
GGUF_TORCH_TOLERANCE = 1e-3


@dg.asset_check(asset=gguf, description="Every exported file (the GGUF, the vision GGUF, the copies in "
                "output.also_copy_to) is still there with the size and sha256 the export recorded.")
def exported_files_unchanged(project: ProjectResource) -> dg.AssetCheckResult:
    files = export_sidecar(project.paths(), project.settings()).written_files()
    return _check_result(files, _delivered_problems(files))


def _delivered_problems(files: list[dict]) -> list[str]:
    """What differs between exported files and their records ({path, bytes, sha256}): every byte is read."""
    problems = []
    for entry in files:
        file = Path(entry["path"])
        if not file.is_file():
            problems.append(f"{file}: missing")
        elif file.stat().st_size != entry["bytes"]:
            problems.append(f"{file}: {file.stat().st_size} bytes, the export wrote {entry['bytes']}")
        elif atomic.sha256_file(file) != entry["sha256"]:
            problems.append(f"{file}: its sha256 changed since the export")
    return problems


def _check_result(files: list[dict], problems: list[str]) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=not problems, metadata={
        "files": len(files), **({"problems": dg.MetadataValue.md("\n".join(f"- `{p}`" for p in problems))}
                                if problems else {})})


@dg.asset(group_name=groups.OUTPUT, deps=[gguf, val_shards, settings_key("eval_report")],
          check_specs=[
              dg.AssetCheckSpec("gguf_agrees_with_torch", asset="eval_report",
                                description=f"The exported GGUF, read back by numpy, scores within "
                                            f"{GGUF_TORCH_TOLERANCE} of the torch checkpoint on the val shards."),
              dg.AssetCheckSpec("val_centred_cosine_threshold", asset="eval_report",
                                description=f"Val centred cosine reaches {GOOD} (the advice in the report says what "
                                            "to change when it does not)."),
              dg.AssetCheckSpec("prompt_retrieval_above_chance", asset="eval_report",
                                description=f"The GGUF tells the val prompts apart: for at least {LISTENS_TOP1:.0%} "
                                            "of them its output is nearer their own target than any other prompt's, "
                                            "a count chance gives less than once in 1,000 (the verdict's \"Good\" "
                                            "needs it)."),
          ],
          description="Evaluation of the exported GGUF on the "
          "val shards by an independent numpy reader, with the verdict, advice and how to use it in ggk.")
def eval_report(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    from gguf_assets.lib.output.checkpoint_outputs import checkpoint_outputs
    from gguf_assets.lib.output.export import ExportError  # torch comes with these: imported where they run
    from gguf_assets.lib.output.gguf_eval import evaluate_gguf, training_centre
    from gguf_assets.lib.training.training_run import final_weights

    paths, settings = project.paths(), project.settings()
    materials_manifest = load_manifest(paths)
    target = gguf_path(paths, settings)
    sidecar = export_sidecar(paths, settings)
    folders = require_current(paths, settings, materials_manifest, "val")
    # The report vouches for the delivered bytes: a GGUF changed since its export is never scored.
    if atomic.sha256_file(target) != sidecar.sha256:
        raise ExportError(f"{target} changed since it was exported (its sha256 differs from the one in "
                          f"{target.with_suffix('.json')}). `gguf-trainer run` exports it again; `gguf-trainer "
                          "verify` checks every file.")
    weights = final_weights(paths)
    # The GGUF's outputs are compared with the torch checkpoint's own on the same val prompts (gguf_vs_checkpoint).
    evaluation = evaluate_gguf(target, folders, training_centre(weights),
                               checkpoint=checkpoint_outputs(weights.parent.parent)) \
        if settings.output.evaluate else None
    fingerprint = report_fingerprint(settings, sidecar.fingerprint,
                                     shard_fingerprints(paths, settings, materials_manifest, "val"))
    report = build_report(paths, settings, materials_manifest, sidecar, evaluation, fingerprint=fingerprint)
    metadata = {"report_json": dg.MetadataValue.path(paths.stored(paths.report_json(settings))),  # no absolute path
                "report": dg.MetadataValue.md(render_markdown(report)),
                "evaluation": dg.MetadataValue.md(render_evaluation(report)),
                "exported_files": dg.MetadataValue.md(render_files(report.files, kept_f32=report.kept_f32)),
                "use_it_in_ggk": dg.MetadataValue.md(render_use_in_ggk(report)),
                # A code block, not text: the UI shows a long text entry clipped to its column.
                "ggk_command": dg.MetadataValue.md(f"```\n{report.ggk_command}\n```"),
                "verdict": report.verdict, "gguf_sha256": report.gguf_sha256}
    # Numeric entries are plotted over time in the UI.
    counts = ("n_prompts", m.WORST_ROW, m.VAL_RETRIEVAL_PROMPTS)
    for key in (m.VAL_CENTRED_COSINE, "val_centred_cosine_torch", "gguf_vs_torch", m.EMPTY_PROMPT_COSINE,
                m.VAL_REL_MSE, m.VAL_RMS_COSINE, m.WORST_ROW_COSINE, *m.RETRIEVAL_KEYS, *counts, "eval_seconds"):
        value = getattr(report, key)
        if value is not None:
            metadata[key] = int(value) if key in counts else m.shown(value)
    for key, value in (report.gguf_vs_checkpoint or {}).items():
        metadata[f"{m.GGUF_VS_CHECKPOINT}_{key}"] = m.shown(value)
    score = report.val_centred_cosine if report.evaluated else report.val_centred_cosine_torch
    checks = [
        dg.AssetCheckResult(check_name="gguf_agrees_with_torch",
                            passed=not report.evaluated or report.gguf_vs_torch < GGUF_TORCH_TOLERANCE,
                            metadata={"difference": m.shown(report.gguf_vs_torch or 0.0),
                                      "evaluated": report.evaluated,
                                      **{key: m.shown(value) for key, value in
                                         (report.gguf_vs_checkpoint or {}).items()}}),
        dg.AssetCheckResult(check_name="val_centred_cosine_threshold", passed=score >= GOOD,
                            severity=dg.AssetCheckSeverity.WARN,
                            metadata={m.VAL_CENTRED_COSINE: m.shown(score), "threshold": GOOD,
                                      "advice": report.advice}),
        _retrieval_check(report),
    ]
    metadata.update(project.stage_metadata("eval_report", settings))
    project.result_written(context)
    return dg.MaterializeResult(data_version=dg.DataVersion(fingerprint), metadata=metadata, check_results=checks)


def _retrieval_check(report: Report) -> dg.AssetCheckResult:
    """Passes where prompt retrieval reaches the verdict's bar; not measured (output.evaluate off) passes, as the
    GGUF-vs-torch check does, saying so."""
    prompts = report.val_retrieval_prompts
    if not report.evaluated or prompts is None:
        return dg.AssetCheckResult(check_name="prompt_retrieval_above_chance", passed=True,
                                   severity=dg.AssetCheckSeverity.WARN, metadata={"evaluated": False})
    bar = retrieval_bar(prompts)
    return dg.AssetCheckResult(
        check_name="prompt_retrieval_above_chance", passed=retrieval_passes(report.val_retrieval_top1, prompts),
        severity=dg.AssetCheckSeverity.WARN,
        metadata={**{key: m.shown(value) if isinstance(value, float) else value for key in m.RETRIEVAL_KEYS
                     if (value := getattr(report, key)) is not None},
                  "chance_top1": m.shown(m.retrieval_chance(prompts)), "advice": report.advice,
                  **({"needed_top1": m.shown(bar.top1)} if bar.top1 is not None else {})})


@dg.asset_check(asset=eval_report, description="The files the report names (the GGUF that was scored, the vision "
                "GGUF, the copies) still hold the sha256 the report lists: what it vouches for is what ggk loads.")
def reported_files_unchanged(project: ProjectResource) -> dg.AssetCheckResult:
    paths, settings = project.paths(), project.settings()
    report = Report.from_json(paths.located_doc(atomic.read_json(paths.report_json(settings))))
    return _check_result(report.files, _delivered_problems(report.files))
