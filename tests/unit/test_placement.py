"""Where a worker loads: one engine shard per device of its setting, weights placed straight
there.

CUDA itself is checked in tests/unit/test_gpu.py (skipped without a GPU); here the CPU path and the
choice of devices, with ``torch.cuda.is_available`` and ``device_count`` answered as a GPU
host would (nothing is placed on those devices here).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlavaForConditionalGeneration

from llava.config import SettingsError
from llava.model.loading import load_model, shard_devices
from tests.conftest import DEMO_MODEL_DIR


@pytest.mark.parametrize(
    ("setting", "gpus", "devices"),
    [
        ("auto", 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),  # one shard per visible GPU
        ("auto", 0, ["cpu"]),  # a CPU-only host: the CPU alone
        ("cpu,cpu", 0, ["cpu", "cpu"]),  # two shards on the CPU (the tests' two-shard path)
        ("cuda:1,cuda:3", 4, ["cuda:1", "cuda:3"]),
        ("cuda:0,cuda:0", 1, ["cuda:0", "cuda:0"]),  # two shards on one GPU (make gpu-check)
    ],
)
def test_shard_devices_follow_the_setting(monkeypatch, setting, gpus, devices):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert shard_devices(setting) == [torch.device(d) for d in devices]


@pytest.mark.parametrize(
    ("setting", "gpus", "says"),
    [
        ("cuda:0", 0, "'cuda:0' names cuda:0, but CUDA is not available here"),
        ("cuda:0,cuda:2", 2, "'cuda:0,cuda:2' names cuda:2; 2 GPUs are visible"),
    ],
)
def test_a_device_this_machine_lacks_is_one_line(monkeypatch, setting, gpus, says):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(SettingsError) as raised:
        shard_devices(setting)
    assert str(raised.value) == f"bad setting device: {says}"


def test_weights_are_placed_by_device_map_not_moved_afterwards(monkeypatch):
    """A spy (the real load runs): from_pretrained is given the device as its device_map, so
    each tensor is read onto the device; a 7B checkpoint never sits in CPU RAM on a GPU host."""
    calls = []
    real = LlavaForConditionalGeneration.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        calls.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(LlavaForConditionalGeneration, "from_pretrained", classmethod(spy))
    loaded = load_model(str(DEMO_MODEL_DIR), device="cpu")
    assert [c.get("device_map") for c in calls] == [{"": torch.device("cpu")}]
    assert {p.device for p in loaded.model.parameters()} == {torch.device("cpu")}
