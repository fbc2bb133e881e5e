"""The arithmetic a training step runs in (training.precision): bf16 autocast where the device computes bf16 in
hardware, else f32.

Under autocast the matmuls (the adapter's MLP is most of a step) run in bf16 while the weights, the optimizer state,
the loss and every validation stay f32, so the export and the scores read f32 weights as before. Measured
on a 2-core AMD EPYC with avx512_bf16, one thread, a step of the demo's shape (width 128, batch 16): 77 -> 48 ms;
width 1024, batch 32: 6.0 -> 3.1 s; the demo's score 0.9069 either way (benchmarks/bench_train.py, section 5).
Without bf16 hardware autocast emulates it, slower than f32, so "auto" leaves such a device in f32, and a CPU
too where the step is so small that the casts cost more than they save.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BF16, FP32 = "bf16", "fp32"
# On a CPU, autocast's casts cost more than bf16 matmuls save in a small step (prompts x query rows x width, one
# thread): 4 query rows x 16 prompts x 128 wide ran at 0.6x in bf16, 256 x 8 x 64 (131,072) at 1.09x,
# 256 x 16 x 64 (262,144) at 1.16x, the demo's 256 x 16 x 128 at 1.59x, 256 x 32 x 1024 at 1.93x.
CPU_BF16_MIN_WORK = 1 << 18
# The x86 CPU features with bf16 dot products (torch.cpu.get_capabilities' names): AVX512-BF16 (Zen 4, Cooper
# Lake and later) and AMX-BF16 (Sapphire Rapids and later). Arm CPUs stay in f32: not measured here.
CPU_BF16_FEATURES = ("avx512_bf16", "amx_bf16")


def native_bf16(device: torch.device) -> str | None:
    """What computes bf16 in hardware on ``device`` ("CUDA compute capability 8.0", "avx512_bf16"), or None."""
    import torch

    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # a torch before the argument: NVIDIA's bf16 units came with compute capability 8.0
            native = major >= 8
        return f"CUDA compute capability {major}.{minor}" if native else None
    if device.type == "cpu":
        # A torch without the public reader (pyproject admits 2.4) trains in f32 on the CPU, as before.
        capabilities = getattr(torch.cpu, "get_capabilities", dict)()
        return next((feature for feature in CPU_BF16_FEATURES if capabilities.get(feature)), None)
    return None


def step_work(*, batch_size: int, query_rows: int, width: int) -> int:
    """The size of a training step's matrices, as the CPU's choice weighs it: the rows the adapter's MLP runs
    (prompts x query rows) times its width."""
    return batch_size * query_rows * width


def step_precision(setting: str, device: torch.device, *, work: int) -> str:
    """training.precision resolved for ``device`` and a step of ``work`` (``step_work``): "bf16" or "fp32"."""
    if setting != "auto":
        return setting
    if not native_bf16(device) or (device.type == "cpu" and work < CPU_BF16_MIN_WORK):
        return FP32
    return BF16


def describe(setting: str, device: torch.device, *, work: int) -> str:
    """One line for the training log: the precision in force and why."""
    hardware = native_bf16(device)
    if step_precision(setting, device, work=work) == FP32:
        if setting == FP32:
            why = "training.precision: fp32"
        elif not hardware:
            why = f"{device.type} has no bf16 hardware"
        else:
            why = (f"a step this small runs faster in f32 on a CPU: prompts x query rows x width = {work:,}, "
                   f"below {CPU_BF16_MIN_WORK:,}")
        return f"training steps run in f32 ({why})"
    how = f"{hardware} computes bf16" if hardware else "emulated: slower than f32 on this device"
    return (f"training steps run under bf16 autocast ({how}; weights, optimizer, loss and validation stay f32; "
            "training.precision: fp32 turns it off)")


def step_autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a training step's forward runs in for a resolved ``precision``."""
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == BF16)
