"""Loading a llava-hf style checkpoint directory: processor, model, prompt, special ids.

The same code path loads the committed demo model, ``llava-hf/llava-1.5-7b-hf`` and the
LLaVA-NeXT checkpoints (``llava-hf/llava-v1.6-*``): directories with ``config.json``,
safetensors weights, tokenizer and processor configs. Every check runs on the small files
first (llava.model.checkpoint), so a checkpoint the engine cannot serve is refused before its
weights are read. Nothing here reaches a model hub.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llava.config import SettingsError
from llava.kv.allocator import use_expandable_segments
from llava.model.checkpoint import inspect_checkpoint
from llava.model.prompt import ChatPrompt


@dataclass(frozen=True)
class LoadedModel:
    model: object  # a LlavaForConditionalGeneration or LlavaNextForConditionalGeneration
    processor: object
    prompt: ChatPrompt
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    max_positions: int
    image_aspect_ratio: str | None = None  # "pad": keep the whole image (llava/model/imageprep.py)
    model_dir: str | None = None  # where its weights were read from (None: built in memory)

    @property
    def tokenizer(self):
        return self.processor.tokenizer


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means; a CUDA device always with its index ("cuda" is the current
    one): torch.cuda.set_device refuses a bare "cuda" (torch 2.11)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def shard_devices(setting: str) -> list[torch.device]:
    """One device per engine shard (docs/engine/scheduling.md §Engine shards): ``auto`` → every
    visible GPU, else the CPU alone; otherwise the listed devices ("cuda:0,cuda:1", "cpu,cpu"), each
    checked against this machine, so a bad one fails the start in one line (SettingsError)."""
    if setting == "auto":
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]
    return [_present(torch.device(name), setting) for name in setting.split(",")]


def _present(device: torch.device, setting: str) -> torch.device:
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise SettingsError("device", f"{setting!r} names {device}, but CUDA is not available here")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise SettingsError("device", f"{setting!r} names {device}; {count} GPUs are visible")
    return torch.device("cuda", index)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """fp32 on CPU (half precision is slow there); bf16/fp16 on CUDA unless told otherwise."""
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load_model(
    model_dir: str, device: str = "auto", dtype: str = "auto", attn_implementation: str = "sdpa"
) -> LoadedModel:
    use_expandable_segments()  # before anything starts CUDA's allocator (llava.kv.allocator)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if torch_device.type == "cuda":  # kernels and allocations without a device go there too
        torch.cuda.set_device(torch_device)
    checkpoint = inspect_checkpoint(model_dir)  # refuses in one line, before any weight
    # device_map: each tensor is read from safetensors straight onto the device; a 7B
    # checkpoint never sits in CPU RAM first (needs accelerate).
    model = checkpoint.model_class.from_pretrained(
        model_dir,
        dtype=torch_dtype,
        attn_implementation=attn_implementation,
        device_map={"": torch_device},
    )
    model.eval()
    return LoadedModel(
        model=model,
        processor=checkpoint.processor,
        prompt=checkpoint.prompt,
        device=torch_device,
        dtype=torch_dtype,
        eos_token_ids=checkpoint.eos_token_ids,
        max_positions=model.config.text_config.max_position_embeddings,
        image_aspect_ratio=checkpoint.image_aspect_ratio,
        model_dir=str(model_dir),
    )
