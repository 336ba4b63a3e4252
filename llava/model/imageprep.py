"""What happens to an image before the processor: keep all of it (LLaVA-1.5's ``pad``).

A CLIP processor resizes the shorter side and centre-crops a square, so a wide image loses its
sides (a shape near the edge of a 640x240 picture is cut away). LLaVA-1.5 trained with
``image_aspect_ratio=pad``: the image is first centred on a square canvas of its longer side,
filled with the processor's mean colour (which normalizes to zero). A checkpoint asks for that
with ``"image_aspect_ratio": "pad"`` in its ``config.json``; without the key the processor's
own behaviour is kept (llava-hf checkpoints). See docs/engine/prompt-fidelity.md §Pad to square.
"""

from __future__ import annotations

import hashlib
import struct

from PIL import Image

from llava.config import SettingsError

PAD = "pad"
ASPECT_RATIO_MODES = (None, PAD)


def image_aspect_ratio(config) -> str | None:
    """The checkpoint's setting (``config.image_aspect_ratio``), checked; None when absent."""
    mode = getattr(config, "image_aspect_ratio", None)
    if mode not in ASPECT_RATIO_MODES:  # one line at start, like every bad setting
        raise SettingsError(
            "image_aspect_ratio",
            f"{mode!r}; known: {PAD!r} or no key at all",
            source="the model's config.json image_aspect_ratio",
        )
    return mode


def mean_fill(image_processor) -> tuple[int, int, int]:
    """The processor's ``image_mean`` as an RGB colour: padding that normalizes to ~0."""
    return tuple(round(channel * 255) for channel in image_processor.image_mean)


def pad_to_square(image: Image.Image, fill: tuple[int, int, int] | int) -> Image.Image:
    """``image`` centred on a ``fill``-coloured square of its longer side (square: unchanged)."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    square = Image.new(image.mode, (side, side), fill)
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


def content_key(image: Image.Image, salt: bytes) -> bytes:
    """A SHA-256 of the decoded pixels with their mode, size and palette, and ``salt`` (what
    else changes the features: model, preprocessing): never of a URL or an object. One pixel
    changed is another key (docs/engine/memory.md §Shared prefixes)."""
    digest = hashlib.sha256(salt)
    digest.update(image.mode.encode() + b"\0" + struct.pack("<II", *image.size))
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    digest.update(bytes(palette or ()))
    digest.update(image.tobytes())
    return digest.digest()


def prepare_image(image: Image.Image, mode: str | None, image_processor) -> Image.Image:
    """The image as the processor should see it under the checkpoint's ``mode``."""
    if mode != PAD or image.width == image.height:
        return image
    return pad_to_square(image.convert("RGB"), mean_fill(image_processor))


def prepared_size(image: Image.Image, mode: str | None) -> tuple[int, int]:
    """The (width, height) ``prepare_image`` gives ``image``, without preparing it."""
    if mode != PAD:
        return image.size
    side = max(image.size)
    return side, side
