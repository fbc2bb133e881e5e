"""Which GPUs this machine offers the shard workers, and what a shard records of its device."""

import pytest
import torch

from gguf_assets.lib.core.errors import UserError
from gguf_assets.lib.telemetry.hardware import CUDA_VISIBLE_DEVICES, GPU_COUNT_ENV, device_label, visible_gpus


def test_a_user_set_cuda_visible_devices_is_honoured(monkeypatch):
    monkeypatch.setenv(GPU_COUNT_ENV, "8")  # the user's CUDA_VISIBLE_DEVICES wins over any count
    for value, gpus in {"2,3": ["2", "3"], " 1 , 0": ["1", "0"], "1,-1,2": ["1"], "": [], "-1": [],
                        "GPU-5b1c,GPU-77aa": ["GPU-5b1c", "GPU-77aa"]}.items():
        monkeypatch.setenv(CUDA_VISIBLE_DEVICES, value)
        assert visible_gpus() == gpus, value


def test_the_gpu_count_knob_stands_in_for_the_machine(monkeypatch):
    monkeypatch.delenv(CUDA_VISIBLE_DEVICES, raising=False)
    monkeypatch.setenv(GPU_COUNT_ENV, "3")
    assert visible_gpus() == ["0", "1", "2"]
    monkeypatch.setenv(GPU_COUNT_ENV, "two")
    with pytest.raises(UserError, match=f"{GPU_COUNT_ENV}='two': must be a whole number"):
        visible_gpus()


def test_a_cpu_device_is_recorded_as_cpu():
    assert device_label(torch.device("cpu")) == "cpu"
