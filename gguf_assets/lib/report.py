"""The evaluation report: report.json (for tools) and report.md (shown in the UI)."""

from __future__ import annotations

from pathlib import Path

from gguf_assets.lib import atomic
from gguf_assets.lib.layout import REPORT_JSON, REPORT_MD, ProjectPaths
from gguf_assets.lib.settings import Settings
from gguf_assets.lib.verdict import verdict


def ggk_command(settings: Settings, materials: dict, gguf: Path) -> str:
    student = materials["student"]["path"]
    return (settings.output.ggk_command.replace("{student}", student).replace("{adapter_gguf}", str(gguf))
            .replace("{vision_gguf}", ""))


def build_report(paths: ProjectPaths, settings: Settings, materials: dict, gguf: dict, evaluation: dict | None,
                 *, fingerprint: str) -> dict:
    """Write report.json and report.md into the output folder; returns the report dict."""
    gguf_file = Path(gguf["path"])
    score = evaluation["val_centred_cosine"] if evaluation else gguf["val_centred_cosine_torch"]
    text, advice = verdict(score)
    files = [{"path": str(gguf_file), "bytes": gguf["bytes"], "sha256": gguf["sha256"]}]
    files += [{"path": c, "bytes": gguf["bytes"], "sha256": gguf["sha256"]} for c in gguf.get("copies", [])]
    report = {
        "fingerprint": fingerprint,
        "evaluated": evaluation is not None,
        "val_centred_cosine": evaluation["val_centred_cosine"] if evaluation else None,
        "val_centred_cosine_torch": gguf["val_centred_cosine_torch"],
        "empty_prompt_cosine": evaluation["empty_prompt_cosine"] if evaluation else gguf.get("empty_prompt_cosine_torch"),
        "gguf_path": str(gguf_file), "gguf_sha256": gguf["sha256"], "gguf_bytes": gguf["bytes"],
        "n_prompts": evaluation["n_prompts"] if evaluation else None,
        "per_shard": evaluation["per_shard"] if evaluation else [],
        "worst": evaluation["worst"] if evaluation else [],
        "verdict": text, "advice": advice, "files": files,
        "ggk_command": ggk_command(settings, materials, gguf_file),
        "kept_f32": gguf.get("kept_f32", []),
    }
    out = paths.output_dir(settings)
    atomic.write_json(out / REPORT_JSON, report)
    atomic.write_text(out / REPORT_MD, render_markdown(report))
    return report


def render_markdown(r: dict) -> str:
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    lines = ["# Evaluation", "", f"**{r['verdict']}**", "", r["advice"], "",
             "| measure | value |", "|---|---|",
             f"| val centred cosine (GGUF, numpy) | {fmt(r['val_centred_cosine'])} |",
             f"| val centred cosine (torch checkpoint) | {fmt(r['val_centred_cosine_torch'])} |",
             f"| empty prompt cosine | {fmt(r['empty_prompt_cosine'])} |",
             f"| val prompts | {r['n_prompts'] if r['n_prompts'] is not None else 'n/a'} |", ""]
    if r["worst"]:
        lines += ["## Worst val prompts", "", "| cosine | prompt |", "|---|---|"]
        lines += [f"| {w['cosine']:.4f} | {(w['text'][:120] or '(empty: CFG prompt)').replace('|', '/')} |"
                  for w in r["worst"]]
        lines.append("")
    lines += ["## Exported files", "", "| file | bytes | sha256 |", "|---|---|---|"]
    lines += [f"| `{f['path']}` | {f['bytes']} | `{f['sha256']}` |" for f in r["files"]]
    lines += ["", "## Use it in ggk", "",
              "Put the adapter GGUF next to your ggk models (or set `output.also_copy_to` to that folder), keep the "
              "student model it was trained on, and run:", "", "```", r["ggk_command"], "```", ""]
    return "\n".join(lines)
