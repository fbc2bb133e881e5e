"""The app's 'Hardware' and 'Environment' panels, as Markdown metadata on the long steps."""

import dagster as dg

from gguf_assets.lib.core.markdown import markdown_table
from gguf_assets.lib.telemetry.hardware import environment_report, hardware_report


def panel_metadata() -> dict:
    hw = hardware_report()
    devices = [["CPU", f"{hw['cpu']} ({hw['cpu_cores']} cores, {hw['cpu_threads']} threads)"],
               ["RAM", f"{hw['ram_gib']} GiB"]]
    devices += [[f"GPU {g['index']}", f"{g['name']}, {g['vram_gib']} GiB"] for g in hw["gpus"]] or [["GPU", "none"]]
    devices.append(["NVIDIA driver / CUDA", f"{hw['driver'] or 'none'} / {hw['cuda'] or 'none'}"])
    # Tables, not numbers: a number here would be plotted as a one-point chart per run.
    return {"hardware": dg.MetadataValue.md(markdown_table(["device", "details"], devices)),
            "environment": dg.MetadataValue.md(markdown_table(["package", "version"],
                                                              environment_report().items()))}
