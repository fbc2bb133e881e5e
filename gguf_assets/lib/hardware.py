"""Devices and hardware figures (pynvml for NVIDIA GPUs, psutil for CPU/RAM).

Everything degrades gracefully on a machine without NVIDIA hardware.
"""

from __future__ import annotations

import logging
import platform
from importlib import metadata

import psutil
import torch

log = logging.getLogger(__name__)

ENVIRONMENT_PACKAGES = ("torch", "transformers", "accelerate", "huggingface_hub", "dagster",
                        "gguf", "safetensors", "numpy", "tokenizers")


def resolve_device(setting: str) -> torch.device:
    """'auto' picks the first CUDA device when there is one, else the CPU."""
    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {setting!r} was requested but CUDA is not available here; "
                           "set the device to cpu or auto.")
    return torch.device(setting)


def gpu_snapshot() -> list[dict]:
    """Utilization, memory, temperature and power per NVIDIA GPU; [] without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver / no GPU: nothing to report
        return []
    gpus = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            entry = {"index": i, "name": pynvml.nvmlDeviceGetName(h), "util_pct": util.gpu,
                     "mem_used_gib": mem.used / 2**30, "mem_total_gib": mem.total / 2**30}
            try:
                entry["temp_c"] = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
                entry["power_w"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000
            except Exception:
                pass
            gpus.append(entry)
    finally:
        pynvml.nvmlShutdown()
    return gpus


def host_snapshot() -> dict:
    vm = psutil.virtual_memory()
    return {"cpu_pct": psutil.cpu_percent(interval=None), "ram_used_gib": (vm.total - vm.available) / 2**30,
            "ram_total_gib": vm.total / 2**30, "process_rss_gib": psutil.Process().memory_info().rss / 2**30}


def environment_report() -> dict:
    versions = {"python": platform.python_version()}
    for name in ENVIRONMENT_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions
