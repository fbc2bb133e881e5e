"""Devices and live figures: pynvml for NVIDIA GPUs, psutil for CPU/RAM (progress and ETA: lib/telemetry/progress.py).

Everything degrades gracefully on a machine without NVIDIA hardware: the GPU figures are
simply absent.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING

import psutil

from gguf_assets.lib.core.errors import UserError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ENVIRONMENT_PACKAGES = ("torch", "transformers", "accelerate", "huggingface_hub", "dagster",
                        "gguf", "safetensors", "numpy", "tokenizers")
GIB = 2**30
SAMPLE_INTERVAL_S = 2.0
# An advanced knob: pretend this machine has N GPUs (ids 0..N-1) when counting them for `run --workers auto`.
# The tests use it to check that each worker is pinned to its own GPU on a machine without one.
GPU_COUNT_ENV = "GGUF_ASSETS_GPU_COUNT"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
AUTO_WORKERS = "auto"  # `run --workers auto`: one shard worker per visible GPU (orchestration/workers.py)


def resolve_device(setting: str) -> torch.device:
    """'auto' picks the first CUDA device when there is one, else the CPU."""
    import torch  # here, not above: every Dagster process (webserver, daemon, code server) imports this module

    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {setting!r} was requested but CUDA is not available here; "
                           "set the device to cpu or auto.")
    return torch.device(setting)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries: the user's CUDA_VISIBLE_DEVICES when set
    (CUDA stops at its first invalid entry, "-1" hides every GPU), else every GPU NVML counts (or GPU_COUNT_ENV)."""
    chosen = os.environ.get(CUDA_VISIBLE_DEVICES)
    if chosen is not None:
        entries = []
        for entry in (e.strip() for e in chosen.split(",")):
            if not entry or entry.startswith("-"):
                break
            entries.append(entry)
        return entries
    override = os.environ.get(GPU_COUNT_ENV, "").strip()
    if override:
        if not override.isdigit():
            raise UserError(f"{GPU_COUNT_ENV}={override!r}: must be a whole number of GPUs; unset it to count "
                            "this machine's own")
        return [str(i) for i in range(int(override))]
    return [str(gpu["index"]) for gpu in gpu_snapshot()]


def pin_to_gpu(gpu: str) -> None:
    """Make ``gpu`` (a CUDA_VISIBLE_DEVICES entry) this process's only GPU; it is then torch's cuda:0.

    CUDA reads the variable once, when torch first touches it, so this must come before that."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and os.environ.get(CUDA_VISIBLE_DEVICES) != gpu:
        raise RuntimeError(f"cannot pin this process to GPU {gpu}: CUDA was initialized before")
    os.environ[CUDA_VISIBLE_DEVICES] = gpu


def device_label(device: torch.device) -> str:
    """Which device computes, for a shard's record: "cpu", or "cuda:<i> (<name>)" with i the GPU's id on the machine
    (its CUDA_VISIBLE_DEVICES entry when that variable narrows what this process sees)."""
    if device.type != "cuda":
        return str(device)
    import torch

    index = device.index or 0
    visible = os.environ.get(CUDA_VISIBLE_DEVICES, "").split(",")
    machine_id = visible[index].strip() if index < len(visible) and visible[index].strip() else str(index)
    return f"cuda:{machine_id} ({torch.cuda.get_device_name(index)})"


class NvmlReader:
    """Reads every NVIDIA GPU through one NVML session; `available` is False without a driver."""

    def __init__(self) -> None:
        self.available = False
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no driver / no GPU / no library: no GPU figures
            return
        self._nvml = pynvml
        self.available = True

    def read(self) -> list[dict]:
        if not self.available:
            return []
        nv = self._nvml
        gpus = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                entry = {"index": i, "name": nv.nvmlDeviceGetName(h), "util_pct": float(util.gpu),
                         "mem_used_gib": mem.used / GIB, "mem_total_gib": mem.total / GIB}
                try:  # some boards (and MIG slices) report neither
                    entry["temp_c"] = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
                    entry["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000
                except Exception:
                    pass
                gpus.append(entry)
        except Exception as exc:  # a GPU fell off the bus mid-run: stop reporting rather than fail the run
            log.warning("NVML stopped answering (%s); GPU figures end here", exc)
            self.close()
            return []
        return gpus

    def versions(self) -> tuple[str | None, str | None]:
        """(driver version, CUDA version the driver supports); (None, None) without a driver."""
        if not self.available:
            return None, None
        try:
            driver = self._nvml.nvmlSystemGetDriverVersion()
            cuda = self._nvml.nvmlSystemGetCudaDriverVersion()
        except Exception:  # a panel must never fail a run
            return None, None
        return _text(driver), f"{cuda // 1000}.{cuda % 1000 // 10}"

    def close(self) -> None:
        if self.available:
            self.available = False
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass


def gpu_snapshot() -> list[dict]:
    """Utilization, memory, temperature and power per NVIDIA GPU; [] without one."""
    reader = NvmlReader()
    try:
        return reader.read()
    finally:
        reader.close()


def host_snapshot() -> dict:
    vm = psutil.virtual_memory()
    return {"cpu_pct": psutil.cpu_percent(interval=None), "ram_used_gib": (vm.total - vm.available) / GIB,
            "ram_total_gib": vm.total / GIB, "process_rss_gib": psutil.Process().memory_info().rss / GIB}


def _flatten(gpus: list[dict], host: dict) -> dict[str, float]:
    sample = {f"host_{k}": float(v) for k, v in host.items()}
    for g in gpus:
        for key in ("util_pct", "mem_used_gib", "temp_c", "power_w"):
            if key in g:
                sample[f"gpu{g['index']}_{key}"] = float(g[key])
    return sample


# Which statistics a summary keeps per figure: peaks for memory and heat, means too for load and power.
_SUMMARY_STATS = {"util_pct": ("mean", "max"), "cpu_pct": ("mean", "max"), "power_w": ("mean", "max"),
                  "mem_used_gib": ("max",), "ram_used_gib": ("max",), "process_rss_gib": ("max",),
                  "temp_c": ("max",), "ram_total_gib": ("max",)}


class HardwareSampler:
    """Samples GPU and host figures in a background thread while a long step runs.

    Use as a context manager; `summary(since=t)` condenses the samples taken after time t
    (on `clock`) into flat numbers such as ``gpu0_util_pct_mean`` or ``host_ram_used_gib_max``,
    ready for Dagster metadata (which the UI plots).
    """

    def __init__(self, *, interval_s: float = SAMPLE_INTERVAL_S, read_gpus: Callable[[], list[dict]] | None = None,
                 read_host: Callable[[], dict] = host_snapshot, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._nvml = None if read_gpus is not None else NvmlReader()
        self._read_gpus = read_gpus if read_gpus is not None else self._nvml.read
        self._read_host = read_host
        self.clock = clock
        self._samples: list[tuple[float, dict[str, float]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def has_gpus(self) -> bool:
        return any(k.startswith("gpu") for _, s in self._samples for k in s)

    def sample(self) -> dict[str, float]:
        try:
            sample = _flatten(self._read_gpus(), self._read_host())
        except Exception as exc:  # figures are a nicety; never let them break a precompute run
            log.debug("hardware sample failed: %s", exc)
            return {}
        with self._lock:
            self._samples.append((self.clock(), sample))
        return sample

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "HardwareSampler":
        psutil.cpu_percent(interval=None)  # the first reading is meaningless; start the CPU window now
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="hardware-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        self.sample()
        if self._nvml is not None:
            self._nvml.close()

    def summary(self, *, since: float | None = None) -> dict[str, float]:
        with self._lock:
            samples = [s for t, s in self._samples if since is None or t >= since]
        if not samples:  # a step shorter than the interval still gets one reading
            self.sample()
            with self._lock:
                samples = [s for t, s in self._samples if since is None or t >= since]
        values: dict[str, list[float]] = {}
        for s in samples:
            for k, v in s.items():
                values.setdefault(k, []).append(v)
        out: dict[str, float] = {"hw_samples": float(len(samples))}
        for name, series in sorted(values.items()):
            stats = next((v for k, v in _SUMMARY_STATS.items() if name.endswith(k)), ("max",))
            if "mean" in stats:
                out[f"{name}_mean"] = round(sum(series) / len(series), 3)
            if "max" in stats:
                out[f"{name}_max"] = round(max(series), 3)
        return out


def environment_report() -> dict:
    versions = {"python": platform.python_version()}
    for name in ENVIRONMENT_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def hardware_report() -> dict:
    """GPUs (name, VRAM, driver, CUDA version), CPU and RAM: the 'Hardware' panel."""
    reader = NvmlReader()
    try:
        gpus = [{"index": g["index"], "name": _text(g["name"]), "vram_gib": round(g["mem_total_gib"], 1)}
                for g in reader.read()]
        driver, cuda = reader.versions()
    finally:
        reader.close()
    return {"gpus": gpus, "driver": driver, "cuda": cuda,
            "cpu": _cpu_model(), "cpu_cores": psutil.cpu_count(logical=False) or psutil.cpu_count(),
            "cpu_threads": psutil.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1)}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
