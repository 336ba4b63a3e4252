"""Where a worker loads: the GPU TorchServe assigned it, weights placed straight there.

CUDA itself is checked in tests/unit/test_gpu.py (skipped without a GPU); here the CPU path and the
choice of device, with ``torch.cuda.is_available`` answered both ways.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlavaForConditionalGeneration

from llava.model import assigned_device, load_model
from tests.conftest import DEMO_MODEL_DIR


@pytest.mark.parametrize(
    ("setting", "gpu_id", "cuda", "device"),
    [
        ("auto", 1, True, "cuda:1"),  # TorchServe's round-robin gave this worker GPU 1
        ("auto", "0", True, "cuda:0"),
        ("auto", None, True, "auto"),  # no assignment: llava.model picks the current GPU
        ("auto", 1, False, "auto"),  # a CPU-only host: auto resolves to cpu
        ("cpu", 1, True, "cpu"),  # an explicit setting wins over the assignment
        ("cuda:3", 1, True, "cuda:3"),
    ],
)
def test_worker_device_follows_torchserve_gpu_id(monkeypatch, setting, gpu_id, cuda, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert assigned_device(setting, gpu_id) == device


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
