"""The app's 'Hardware' and 'Environment' panels, as Markdown metadata on the long steps."""

import dagster as dg

from gguf_assets.lib.hardware import environment_report, hardware_report


def panel_metadata() -> dict:
    hw = hardware_report()
    rows = ["| device | details |", "|---|---|",
            f"| CPU | {hw['cpu']} ({hw['cpu_cores']} cores, {hw['cpu_threads']} threads) |",
            f"| RAM | {hw['ram_gib']} GiB |"]
    rows += [f"| GPU {g['index']} | {g['name']}, {g['vram_gib']} GiB |" for g in hw["gpus"]]
    rows.append(f"| NVIDIA driver / CUDA | {hw['driver'] or 'none'} / {hw['cuda'] or 'none'} |")
    env = ["| package | version |", "|---|---|"] + [f"| {k} | {v} |" for k, v in environment_report().items()]
    return {"hardware": dg.MetadataValue.md("\n".join(rows)), "environment": dg.MetadataValue.md("\n".join(env)),
            "gpu_count": len(hw["gpus"])}
