"""An image's features, once per session, computed as the checkpoint's own code computes them.

LLaVA-1.5 resizes an image to one 336-px view: always the same number of image tokens (576).
LLaVA-NeXT ("anyres") picks the ``image_grid_pinpoints`` resolution that fits the image best,
cuts it into 336-px tiles plus one global view, drops the padding rows and columns of the tiled
grid, and ends every feature row with the learned ``image_newline``: the image-token count
depends on the image's size (up to 2,928 for llava-v1.6-mistral-7b-hf). Both go through the
same two calls here: the processor makes the model's inputs (``image_sizes`` too, for NeXT) and
the model's own ``get_image_features`` makes the features, so their row count is the count the
checkpoint's processor puts in the prompt (docs/models.md §LLaVA-NeXT images).
"""

from __future__ import annotations

import torch
from PIL import Image

from llava.model.imageprep import prepare_image, prepared_size

# What the model's get_image_features takes from the processor's output (NeXT adds image_sizes).
VISION_INPUTS = ("pixel_values", "image_sizes")


def vision_inputs(image: Image.Image, image_processor, aspect_mode: str | None) -> dict:
    """The processor's preprocessing of ``image`` (on the host: runs in the caller's thread)."""
    image = prepare_image(image, aspect_mode, image_processor)
    out = image_processor(images=image, return_tensors="pt")
    return {name: out[name] for name in VISION_INPUTS if name in out}


@torch.inference_mode()
def image_features(model, inputs: dict, dtype: torch.dtype) -> torch.Tensor:
    """The vision tower and projector (and NeXT's tiling, unpadding and row newlines):
    (image tokens, hidden) features."""
    kwargs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
    kwargs["pixel_values"] = kwargs["pixel_values"].to(dtype)
    pooled = model.get_image_features(**kwargs, return_dict=True).pooler_output
    if isinstance(pooled, list | tuple):
        pooled = torch.cat(list(pooled), dim=0)
    return pooled.reshape(-1, pooled.shape[-1])


def image_tokens(processor, width: int, height: int) -> int:
    """How many image tokens the checkpoint's processor puts in the prompt for an image of
    this size as the processor receives it."""
    counted = processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
    return counted.num_image_tokens[0]


def image_tokens_of(image: Image.Image, processor, aspect_mode: str | None) -> int:
    """How many image tokens the checkpoint's processor puts in the prompt for ``image``, as
    ``vision_inputs`` prepares it: known before its features are computed."""
    return image_tokens(processor, *prepared_size(image, aspect_mode))


def most_image_tokens(processor) -> int:
    """The largest image-token count any image gets: an image of a pinpoint's exact size is
    tiled with no padding to drop (NeXT); LLaVA-1.5's count is the same for every image."""
    image_processor = processor.image_processor
    pinpoints = getattr(image_processor, "image_grid_pinpoints", None)
    crop = image_processor.crop_size
    sizes = pinpoints or [(crop["height"], crop["width"])]
    return max(image_tokens(processor, width, height) for height, width in sizes)


def largest_side(image_processor) -> int:
    """The largest side the processor resizes an image to (its biggest pinpoint for NeXT):
    intake decodes an image no larger than about twice this (llava.intake.decode_image's
    ``fit``)."""
    sizes = (image_processor.size, image_processor.crop_size)  # dicts or SizeDicts
    sides = ("shortest_edge", "longest_edge", "height", "width")
    side = max(size.get(name) or 0 for size in sizes if size for name in sides)
    pinpoints = getattr(image_processor, "image_grid_pinpoints", None) or []
    return max([side, *(max(point) for point in pinpoints)])
