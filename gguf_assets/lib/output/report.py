"""The evaluation report: report.json (for tools) and report.md (shown in the UI).

It carries both scores (``val_centred_cosine`` from the GGUF via the numpy evaluator,
``val_centred_cosine_torch`` from the checkpoint), the verdict and advice, the other scores in the
raw target space (relative MSE, cosine after RMSNorm, the worst query row, prompt retrieval:
lib/core/metrics.py) and the GGUF's outputs against the checkpoint's (``gguf_vs_checkpoint``), the worst val prompts,
per-shard scores, every exported file with size and sha256, and the "use it in ggk" section: which
file goes where and the command line (``output.ggk_command``).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path

from gguf_assets.lib.core import atomic, verify
from gguf_assets.lib.core import metrics as m
from gguf_assets.lib.core.commands import shell_line
from gguf_assets.lib.core.ggk_contract import ESCAPE_HINT, USER_FILES
from gguf_assets.lib.core.markdown import markdown_table, user_text
from gguf_assets.lib.output.kept import keep_report
from gguf_assets.lib.project import settings_history
from gguf_assets.lib.project.layout import REPORT_JSON, REPORT_MD, ProjectPaths
from gguf_assets.lib.project.manifests import DamagedRecord, ExportSidecar, MaterialsManifest, Report
from gguf_assets.lib.project.settings import Settings
from gguf_assets.lib.training.better import better_advice, better_weights, with_better_weights
from gguf_assets.lib.training.training_run import final_run_dir, finished_meta
from gguf_assets.lib.training.verdict import (
    GOOD,
    LISTENS_TOP1,
    retrieval_bar,
    training_start,
    validation_curve,
    verdict,
)

# ggk's flags (gk-diffuser.cpp), for the "use it in ggk" table.
VISION_FLAG = "--llm_vision"
ADAPTER_FLAG = "--llm-adapter"
STUDENT_FLAG = "--llm"
TOKENIZER_PACK_FLAG = "--tokenizer-pack"
# output.ggk_command's placeholders; {student} is the name earlier versions used for the student.
PLACEHOLDERS = ("{dit_gguf}", "{vae_gguf}", "{student_gguf}", "{student}", "{adapter_gguf}", "{vision_gguf}",
                "{tokenizer_pack}")


def _optional_arg(placeholder: str) -> re.Pattern:
    """"--flag {x}" or "--flag={x}": dropped whole when the project made no such file."""
    return re.compile(r"\s*(?:--?[A-Za-z0-9_-]+(?:=|\s+))?" + re.escape(placeholder))


def ggk_command(template: str, *, student_gguf: str, adapter_gguf: str, vision_gguf: str | None,
                tokenizer_pack: str | None) -> str:
    """The command line: the project's files filled in as shell-quoted paths, the image model's files (the DiT and
    the VAE, which the user brings) as ``<your ...>`` placeholders to replace."""
    optional = {"{vision_gguf}": vision_gguf, "{tokenizer_pack}": tokenizer_pack}
    for placeholder, value in optional.items():
        if value is None:
            template = _optional_arg(placeholder).sub("", template)
    values = {"{dit_gguf}": USER_FILES["dit_gguf"], "{vae_gguf}": USER_FILES["vae_gguf"],
              "{student_gguf}": student_gguf, "{student}": student_gguf, "{adapter_gguf}": adapter_gguf,
              **{k: v or "" for k, v in optional.items()}}
    # One pass, so a path that happens to contain "{adapter_gguf}" is not substituted again.
    return re.sub("|".join(re.escape(p) for p in PLACEHOLDERS), lambda m: shlex.quote(values[m.group(0)]), template)


def ggk_line(template: str, ggk_files: dict, student_path: str, *, adapter_gguf: str | None = None) -> str:
    """``template`` (output.ggk_command) filled with a report's ggk files (stored paths: relative to the project
    folder inside it), the student's own path when the export made no student GGUF; ``adapter_gguf`` in place of
    the report's adapter (a snapshot's GGUF: the same student, vision encoder and tokenizer pack)."""
    return ggk_command(template, student_gguf=ggk_files.get("student") or student_path,
                       adapter_gguf=adapter_gguf or ggk_files["adapter"], vision_gguf=ggk_files.get("vision_encoder"),
                       tokenizer_pack=ggk_files.get("tokenizer_pack"))


def read_report(paths: ProjectPaths, settings: Settings) -> Report | None:
    """The adapter's report, as stored (paths relative to the project); None when there is none or it cannot be read:
    what shows a result (the studio, a run-end notice) shows none rather than fail."""
    try:
        return Report.read(paths.report_json(settings))
    except (DamagedRecord, OSError):
        return None


def _for_ggk(files: list[dict], role: str) -> dict | None:
    """The file ggk should load for ``role``: the copy in also_copy_to if any, else the original."""
    entries = [f for f in files if f["role"] == role]
    copies = [f for f in entries if f.get("copy_of")]
    return (copies or entries or [None])[0]


def _per_shard(evaluation: dict | None, torch_rows: list[dict]) -> list[dict]:
    torch_by_name = {Path(r["shard"]).name: r[m.VAL_CENTRED_COSINE] for r in torch_rows}
    if evaluation is None:
        return [{"shard": name, "n": r["n"], m.VAL_CENTRED_COSINE: None, "val_centred_cosine_torch": cos}
                for r, (name, cos) in zip(torch_rows, torch_by_name.items())]
    return [{"shard": Path(r["shard"]).name, "n": r["n"], m.VAL_CENTRED_COSINE: r[m.VAL_CENTRED_COSINE],
             "val_centred_cosine_torch": torch_by_name.get(Path(r["shard"]).name)} for r in evaluation["per_shard"]]


def _final_meta(paths: ProjectPaths) -> dict:
    """The finished training run's final/meta.json, or {} when it cannot be read."""
    try:
        return finished_meta(final_run_dir(paths)) or {}
    except (OSError, ValueError, KeyError, TypeError):  # RecordPathError included: no meta from outside
        return {}


def _last_validation(meta: dict) -> dict:
    """The torch checkpoint's scores at its last step: its history's validation of that step, or {}."""
    history = meta.get("history") if isinstance(meta.get("history"), list) else []
    return next((h for h in reversed(history) if isinstance(h, dict) and m.VAL_CENTRED_COSINE in h
                 and h.get("step") == meta.get("step")), {})


# The scores beside the verdict, copied into the report from the evaluation (or the checkpoint's last validation).
OTHER_SCORES = (m.VAL_REL_MSE, m.VAL_RMS_COSINE, m.WORST_ROW, m.WORST_ROW_COSINE)


def build_report(paths: ProjectPaths, settings: Settings, materials: MaterialsManifest, gguf: ExportSidecar,
                 evaluation: dict | None, *, fingerprint: str) -> Report:
    """Write report.json and report.md into the output folder; returns the report.

    ``gguf`` is the export's sidecar, ``evaluation`` the numpy evaluator's result
    (gguf_eval.evaluate_gguf) or None when output.evaluate is off.
    """
    files = gguf.written_files()
    adapter_file, vision_file = _for_ggk(files, "adapter"), _for_ggk(files, "vision_encoder")
    student_file, pack_file = _for_ggk(files, "student"), _for_ggk(files, "tokenizer_pack")
    # The pack is the folder that holds qwen2/merges.txt: --tokenizer-pack takes the folder.
    pack_dir = str(Path(pack_file["path"]).parent.parent) if pack_file else None
    torch_score = gguf.val_centred_cosine_torch
    score = evaluation[m.VAL_CENTRED_COSINE] if evaluation else torch_score
    final_meta = _final_meta(paths)
    # Prompt retrieval is the GGUF evaluation's only: without it the verdict reads the cosine alone.
    retrieval = {key: evaluation.get(key) for key in m.RETRIEVAL_KEYS} if evaluation else None
    text, advice = verdict(score, validation_curve(final_meta.get("history") or []), width=settings.training.width,
                           steps=settings.training.steps, retrieval=retrieval,
                           start=training_start(settings.training))
    better = better_weights(paths, final_meta, torch_score=torch_score,
                            gguf_score=evaluation[m.VAL_CENTRED_COSINE] if evaluation else None)
    text, advice = with_better_weights(text, advice, better, stored_command, STORED_PROJECT)
    others = evaluation if evaluation else _last_validation(final_meta)
    student = materials.student
    ggk_files = {"adapter": adapter_file["path"], "vision_encoder": vision_file["path"] if vision_file else None,
                 "student": student_file["path"] if student_file else None, "tokenizer_pack": pack_dir}
    report = Report(
        fingerprint=fingerprint,
        evaluated=evaluation is not None,
        val_centred_cosine=evaluation[m.VAL_CENTRED_COSINE] if evaluation else None,
        val_centred_cosine_torch=torch_score,
        gguf_vs_torch=abs(evaluation[m.VAL_CENTRED_COSINE] - torch_score) if evaluation else None,
        empty_prompt_cosine=evaluation[m.EMPTY_PROMPT_COSINE] if evaluation else gguf.empty_prompt_cosine_torch,
        empty_prompt_cosine_torch=gguf.empty_prompt_cosine_torch,
        score_source="gguf" if evaluation else "torch",
        gguf_path=gguf.path, gguf_sha256=gguf.sha256, gguf_bytes=gguf.bytes,
        vision_gguf=next((f["path"] for f in files if f["role"] == "vision_encoder" and not f.get("copy_of")), None),
        ggk_files=ggk_files,
        n_prompts=evaluation["n_prompts"] if evaluation else None,
        eval_seconds=evaluation["seconds"] if evaluation else None,
        per_shard=_per_shard(evaluation, gguf.per_shard_torch),
        worst=[{**w, "shard": paths.stored(w["shard"])} for w in evaluation["worst"]] if evaluation else [],
        verdict=text, advice=advice, better_weights=better,
        # The report lists what a user checks (size, sha256), not the stamps status uses.
        files=[verify.without_stamp(f) for f in files],
        student={"repo": student["source"], "commit": student["commit"], "path": student["path"],
                 "layer": settings.materials.student_layer},  # report.json's field: always -1, the final norm
        # Paths inside the project are relative to the project folder (run it from there).
        ggk_command=ggk_line(settings.output.ggk_command, paths.stored_doc({"ggk_files": ggk_files})["ggk_files"],
                             paths.stored(student["path"])),
        kept_f32=gguf.kept_f32,
        settings_hash=settings_history.remember(paths.root, settings),
        **{key: others.get(key) for key in OTHER_SCORES},
        gguf_vs_checkpoint=evaluation.get(m.GGUF_VS_CHECKPOINT) if evaluation else None,
        **(retrieval or {}),
    )
    out = paths.output_dir(settings)
    # No absolute path into the project: a copied project's report points at its own files.
    stored = paths.stored_doc(report.to_json())
    markdown = render_markdown(Report.from_json(stored))
    # Beside the run's kept GGUF (lib/output/kept.py), before the report makes the stage done.
    keep_report(paths, gguf, stored, markdown)
    atomic.write_json(paths.report_json(settings), stored)
    atomic.write_text(paths.report_md(settings), markdown)
    # report.json/report.md: the folder's latest report, under the names earlier versions used.
    atomic.write_json(out / REPORT_JSON, stored)
    atomic.write_text(out / REPORT_MD, markdown)
    return Report.from_json(stored)


# The report's files store no absolute path: its commands name the project folder as "." (run them from there, as
# its ggk command). `gguf-trainer run` and the studio show them for the project's own path (better_advice).
STORED_PROJECT = "."


def stored_command(*words: object) -> str:
    return shell_line("gguf-trainer", *words)


def shown_advice(report: Report, command: Callable[..., str], project: object) -> str:
    """The report's advice with its commands for ``project`` (the stored advice names the project folder ".")."""
    if not report.better_weights:
        return report.advice
    stored = better_advice(report.better_weights, stored_command, STORED_PROJECT)
    return report.advice.replace(stored, better_advice(report.better_weights, command, project))


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def retrieval_text(figures: dict) -> str | None:
    """Prompt retrieval in one short line (the console's), from a dict of metrics.RETRIEVAL_KEYS; None when not
    measured."""
    n, top1 = figures.get(m.VAL_RETRIEVAL_PROMPTS), figures.get(m.VAL_RETRIEVAL_TOP1)
    if not n or top1 is None:
        return None
    return (f"top-1 {top1:.3f}, top-{m.RETRIEVAL_TOP} {figures[m.VAL_RETRIEVAL_TOP5]:.3f} (chance "
            f"{m.retrieval_chance(n):.3f}, {m.retrieval_chance(n, m.RETRIEVAL_TOP):.3f}), margin "
            f"{figures[m.VAL_RETRIEVAL_MARGIN]:.3f}")


SCORES = {s.key: s for s in (*m.COMPARED, *m.RETRIEVAL_SCORES)}


def _label(key: str, what: str, best: str = "") -> str:
    """A score's row label: its name, what it measures, and which way is better (``best``: the best value)."""
    return f"{SCORES[key].label} ({what}; {SCORES[key].better}{best})"


def retrieval_rows(r: Report) -> list[tuple[str, str]]:
    """(measure, value) of prompt retrieval, each with its chance level (lib/core/metrics.py)."""
    n = r.val_retrieval_prompts

    def chance(top: int) -> str:
        return f"; chance {m.retrieval_chance(n, top):.3f}" if n else ""

    return [(_label(m.VAL_RETRIEVAL_TOP1, f"own target the nearest, of {n or 'n/a'} non-empty val prompts"
                                          f"{chance(1)}"), SCORES[m.VAL_RETRIEVAL_TOP1].text(r.val_retrieval_top1)),
            (_label(m.VAL_RETRIEVAL_TOP5, f"own target among the {m.RETRIEVAL_TOP} nearest{chance(m.RETRIEVAL_TOP)}"),
             SCORES[m.VAL_RETRIEVAL_TOP5].text(r.val_retrieval_top5)),
            (_label(m.VAL_RETRIEVAL_MARGIN, "own centred cosine less the mean to the other prompts' targets"),
             SCORES[m.VAL_RETRIEVAL_MARGIN].text(r.val_retrieval_margin))]


# The export's check, the GGUF against the torch checkpoint it came from: one row compares their two scores, two
# compare their outputs, prompt by prompt.
GGUF_VS_CHECKPOINT = "GGUF vs torch checkpoint"


def score_rows(r: Report) -> list[tuple[str, str]]:
    """(measure, value) of every score the report holds, as report.md and the studio's Evaluation panel list
    them: the verdict's scores first, then the others in the raw target space (lib/core/metrics.py), each saying
    which way is better, then the export's check (the GGUF against its checkpoint)."""
    agree = r.gguf_vs_checkpoint or {}
    return [(_label(m.VAL_CENTRED_COSINE, "of the GGUF, by the numpy evaluator: the verdict's"),
             _fmt(r.val_centred_cosine)),
            (_label(m.VAL_CENTRED_COSINE, "of the torch checkpoint"), _fmt(r.val_centred_cosine_torch)),
            *retrieval_rows(r),
            (_label(m.EMPTY_PROMPT_COSINE, "the empty prompt's, the CFG embedding"), _fmt(r.empty_prompt_cosine)),
            (_label(m.VAL_REL_MSE, "sum of squared errors / sum of squared target spread", ", 0 is perfect"),
             _fmt(r.val_rel_mse)),
            (_label(m.VAL_RMS_COSINE, "each row over its RMS"), _fmt(r.val_rms_cosine)),
            (_label(m.WORST_ROW_COSINE, "the query row of the lowest mean centred cosine"),
             "n/a" if r.worst_row is None else f"row {r.worst_row}: {_fmt(r.worst_row_cosine)}"),
            (f"{GGUF_VS_CHECKPOINT}, scores: difference of the two val centred cosines above (lower is better)",
             "n/a" if r.gguf_vs_torch is None else format(r.gguf_vs_torch, ".2e")),
            (f"{GGUF_VS_CHECKPOINT}, outputs: cosine of the two outputs per query row, lowest / mean (higher is "
             "better, 1 is the same)",
             f"{agree[m.MIN_ROW_COSINE]:.6f} / {agree[m.MEAN_ROW_COSINE]:.6f}" if agree else "n/a"),
            (f"{GGUF_VS_CHECKPOINT}, outputs: largest difference of any value, and that share of the outputs' RMS "
             "(lower is better)",
             f"{agree[m.MAX_ABS_DIFF]:.2e} ({agree[m.MAX_ABS_DIFF_RELATIVE]:.2%} of their RMS)" if agree else "n/a"),
            ("val prompts", str(r.n_prompts) if r.n_prompts is not None else "n/a")]


def verdict_rule(r: Report) -> str:
    """How the verdict is reached, for report.md and the studio."""
    bar = retrieval_bar(r.val_retrieval_prompts) if r.val_retrieval_prompts is not None else None
    needed = ("" if bar is None else f" ({bar.hits} of these {bar.prompts})" if bar.hits is not None else
              f" (these {bar.prompts} are too few to show it)")
    return (f"\"Good\" needs val centred cosine >= {GOOD} and, where the GGUF was evaluated, prompt retrieval well "
            f"above chance: the own target the nearest for at least {LISTENS_TOP1:.0%} of the non-empty val prompts, "
            f"a count chance gives less than once in 1,000{needed}. Centred cosine counts what all prompts' targets "
            "share, so an adapter that ignores the prompt can score high on it; retrieval asks whether each "
            "prediction is nearer its own prompt's target than the other prompts' targets.")


def render_evaluation(r: Report) -> str:
    """Verdict, advice and the numbers (the scores, per shard, worst prompts)."""
    lines = [f"**{r.verdict}**", "", r.advice, "",
             markdown_table(["measure", "value"], score_rows(r)), "",
             "All scores are in the raw target space the DiT reads, centred on the training targets' per-row mean "
             "where centred.", "", verdict_rule(r), ""]
    if not r.evaluated:
        lines += ["The GGUF was not evaluated (`output.evaluate` is off); the verdict uses the torch score, prompt "
                  "retrieval is not measured, and the other scores are the checkpoint's last validation.", ""]
    if r.per_shard:
        lines += ["### Per shard", "", markdown_table(["shard", "prompts", "GGUF", "torch"], (
            [s["shard"], s["n"], _fmt(s[m.VAL_CENTRED_COSINE]), _fmt(s["val_centred_cosine_torch"])]
            for s in r.per_shard), right=[1, 2, 3]), ""]
    if r.worst:
        lines += [f"### The {len(r.worst)} worst val prompts", "", markdown_table(["cosine", "prompt"], (
            [f"{w['cosine']:.4f}", user_text(w["text"], 120) or "*(empty: the CFG prompt)*"] for w in r.worst),
            right=[0]), ""]
    return "\n".join(lines)


def render_files(files: list[dict], *, kept_f32: list[str]) -> str:
    """The exported files (and copies) with sizes and sha256."""
    lines = [markdown_table(["file", "role", "bytes", "sha256"], (
        [f"`{f['path']}`", f["role"] + (" (copy)" if f.get("copy_of") else ""), f"{f['bytes']:,}", f"`{f['sha256']}`"]
        for f in files), right=[2])]
    if kept_f32:
        lines += ["", f"Kept in f32 because values exceed the f16 range: {', '.join(kept_f32)}."]
    return "\n".join(lines) + "\n"


def render_use_in_ggk(r: Report) -> str:
    """Which file goes where, and the command line."""
    s, ggk = r.student, r.ggk_files
    rows = [["the adapter (this project's output)", f"`{ggk['adapter']}`", f"`{ADAPTER_FLAG}`"]]
    if ggk.get("student"):
        rows.append([f"the student LLM it was trained on (`{s['repo']}` at `{s['commit']}`), as ggk runs it",
                     f"`{ggk['student']}`", f"`{STUDENT_FLAG}`"])
    if ggk.get("tokenizer_pack"):
        rows.append(["the student's tokenizer, as ggk reads it", f"`{ggk['tokenizer_pack']}`",
                     f"`{TOKENIZER_PACK_FLAG}`"])
    if ggk["vision_encoder"]:
        rows.append(["the paired SigVQ vision encoder", f"`{ggk['vision_encoder']}`", f"`{VISION_FLAG}`"])
    rows.append(["the image model's DiT and VAE (yours: the adapter replaces its text stack only)",
                 f"{USER_FILES['dit_gguf']}, {USER_FILES['vae_gguf']}", "`--diffusion-model`, `--vae`"])
    lines = [markdown_table(["what", "file", "ggk flag"], rows)]
    copies = [f["path"] for f in r.files if f.get("copy_of")]
    lines += [""]
    if copies:
        lines += ["Verified copies are already in the `output.also_copy_to` folder: "
                  + ", ".join(f"`{c}`" for c in copies) + "."]
    else:
        lines += ["Copy these files into your ggk model folder, or set `output.also_copy_to` to that folder to have "
                  "it done (atomically, checked by sha256) on every export."]
    lines += ["", "The adapter only works with that exact student file; another student needs its own adapter.",
              "", f"Prompts: {ESCAPE_HINT}.", "",
              "Command line (template: `output.ggk_command`; relative paths are inside the project folder, so run "
              "it from there, with your DiT and VAE in place of the `<your ...>` placeholders):", "",
              "```", r.ggk_command, "```", ""]
    return "\n".join(lines)


def render_markdown(r: Report) -> str:
    return "\n".join(["# Evaluation", "", render_evaluation(r), "## Exported files", "",
                      render_files(r.files, kept_f32=r.kept_f32),
                      "## Use it in ggk", "", render_use_in_ggk(r)])
