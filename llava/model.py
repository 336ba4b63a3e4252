"""Loading a llava-hf style checkpoint directory: processor, model, prompt, special ids.

The same code path loads the committed demo model and ``llava-hf/llava-1.5-7b-hf``: both are
directories with ``config.json``, safetensors weights, tokenizer and processor configs.
Nothing here reaches a model hub.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from llava.imageprep import image_aspect_ratio
from llava.prompt import ChatPrompt


@dataclass(frozen=True)
class LoadedModel:
    model: LlavaForConditionalGeneration
    processor: object
    prompt: ChatPrompt
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    max_positions: int
    image_aspect_ratio: str | None = None  # "pad": keep the whole image (llava/imageprep.py)

    @property
    def tokenizer(self):
        return self.processor.tokenizer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def assigned_device(setting: str, gpu_id: int | str | None) -> str:
    """The device a TorchServe worker loads on: with ``auto`` and working CUDA, the GPU that
    TorchServe assigned to this worker (``gpu_id``), not whichever GPU is current. TorchServe's
    round-robin starts at GPU 1 unless ``deviceIds`` pins it
    (docs/design.md §TorchServe 0.12 facts).
    """
    if setting == "auto" and gpu_id is not None and torch.cuda.is_available():
        return f"cuda:{int(gpu_id)}"
    return setting


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """fp32 on CPU (half precision is slow there); bf16/fp16 on CUDA unless told otherwise."""
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids = model.generation_config.eos_token_id
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        raise ValueError("checkpoint defines no eos token: answers would never end")
    return frozenset(ids if isinstance(ids, list) else [ids])


def load_model(
    model_dir: str, device: str = "auto", dtype: str = "auto", attn_implementation: str = "sdpa"
) -> LoadedModel:
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if torch_device.type == "cuda":  # kernels and allocations without a device go there too
        torch.cuda.set_device(torch_device)
    processor = AutoProcessor.from_pretrained(model_dir)
    # device_map: each tensor is read from safetensors straight onto the device; a 7B
    # checkpoint never sits in CPU RAM first (needs accelerate).
    model = LlavaForConditionalGeneration.from_pretrained(
        model_dir,
        dtype=torch_dtype,
        attn_implementation=attn_implementation,
        device_map={"": torch_device},
    )
    model.eval()
    prompt = ChatPrompt(processor)
    prompt.check_stateful()
    return LoadedModel(
        model=model,
        processor=processor,
        prompt=prompt,
        device=torch_device,
        dtype=torch_dtype,
        eos_token_ids=_eos_ids(model, processor.tokenizer),
        max_positions=model.config.text_config.max_position_embeddings,
        image_aspect_ratio=image_aspect_ratio(model.config),
    )
