"""Bytes → an RGB ``PIL.Image``: format by content, pixel count checked before decoding."""

from __future__ import annotations

import io

from PIL import Image, ImageOps

from llava.errors import ImageTooLarge, NotAnImage

from .policy import IntakePolicy

_WHITE = (255, 255, 255)


def decode_image(data: bytes, policy: IntakePolicy) -> Image.Image:
    """Decode ``data`` into an RGB image, oriented as its EXIF says.

    Only the policy's formats are even parsed (``formats=``: no exotic decoder sees the
    bytes). The pixel count comes from the header and is checked before the pixels are
    decoded, so a small file declaring a huge image costs nothing. PIL raises many kinds of
    exception on hostile input, so every failure while parsing or decoding is ``NotAnImage``.
    """
    try:
        image = Image.open(io.BytesIO(data), formats=sorted(policy.formats))
    except Image.DecompressionBombError as e:  # PIL's own, larger limit
        raise ImageTooLarge(f"image is too large ({e}); send a smaller image") from e
    except Exception as e:
        raise NotAnImage(
            f"not an image in an allowed format ({', '.join(sorted(policy.formats))}); "
            f"send one of those or add the format to intake.formats"
        ) from e
    with image:
        width, height = image.size
        if width * height > policy.max_pixels:
            raise ImageTooLarge(
                f"image is {width}x{height} = {width * height} pixels, more than "
                f"{policy.max_pixels}; send a smaller image or raise intake.max_pixels"
            )
        try:
            image.load()
            return _to_rgb(ImageOps.exif_transpose(image))
        except Exception as e:
            raise NotAnImage(
                f"the {image.format} image cannot be decoded ({e}); is it truncated?"
            ) from e


def _to_rgb(image: Image.Image) -> Image.Image:
    """Normalise any mode to RGB: alpha composited on white, 16/32-bit grey scaled to 8."""
    if image.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N", "F"):
        # Full-range 16-bit grey: a plain convert("L") would clip everything above 255 to white.
        image = image.convert("I").point(lambda v: v / 256).convert("L")
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, _WHITE)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")
