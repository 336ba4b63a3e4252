"""Shapes as a person draws them in PIL: an independent check of the demo model.

Shares no code with ``demo_model/synthetic.py`` (the training generator): plain named colours,
plain backgrounds, upright shapes built from PIL primitives, several sizes, saved as JPEG.
If the model only knew its generator's quirks, these would show it.
"""

from __future__ import annotations

import io
import math
import random

from PIL import Image, ImageColor, ImageDraw

PLAIN_COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "white")
PLAIN_SHAPES = ("circle", "square", "triangle", "star", "cross")
LIGHT_BACKGROUNDS = ("white", "#f2f2f2", "lightgray", "beige")
DARK_BACKGROUNDS = ("black", "dimgray", "#1e2a44", "gray")
RADII = (0.15, 0.25, 0.35, 0.45)  # shape half-width / canvas side


def _star(cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    points = []
    for i in range(10):
        reach = r if i % 2 == 0 else r * 0.4
        angle = math.radians(90 + 36 * i)
        points.append((cx + reach * math.cos(angle), cy - reach * math.sin(angle)))
    return points


def draw_plain(shape: str, color: str, background: str, side: int, radius: float, rng):
    """One upright ``shape`` of PIL's named ``color`` on a plain square canvas."""
    image = Image.new("RGB", (side, side), ImageColor.getrgb(background))
    draw = ImageDraw.Draw(image)
    r = radius * side
    cx, cy = rng.uniform(r + 2, side - r - 2), rng.uniform(r + 2, side - r - 2)
    fill = ImageColor.getrgb(color)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        half = r * 0.75
        draw.rectangle((cx - half, cy - half, cx + half, cy + half), fill=fill)
    elif shape == "triangle":
        draw.polygon(
            [(cx, cy - r), (cx - r * 0.87, cy + r * 0.6), (cx + r * 0.87, cy + r * 0.6)], fill=fill
        )
    elif shape == "star":
        draw.polygon(_star(cx, cy, r), fill=fill)
    elif shape == "cross":
        arm = r / 3
        draw.rectangle((cx - arm, cy - r, cx + arm, cy + r), fill=fill)
        draw.rectangle((cx - r, cy - arm, cx + r, cy + arm), fill=fill)
    else:
        raise ValueError(shape)
    return image


def as_jpeg(image: Image.Image, quality: int = 80) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def plain_images(seed: int = 7) -> list[tuple[Image.Image, str, str]]:
    """(image, shape, colour) for every shape x colour at each size on light and dark grounds.

    5 shapes x 7 colours x 4 sizes = 140 images; white shapes only on dark backgrounds.
    """
    rng = random.Random(seed)
    found = []
    for shape in PLAIN_SHAPES:
        for color in PLAIN_COLORS:
            for k, radius in enumerate(RADII):
                dark = color == "white" or k % 2 == 1
                background = rng.choice(DARK_BACKGROUNDS if dark else LIGHT_BACKGROUNDS)
                if color == "white" and background == "gray":
                    background = "black"
                side = rng.choice((128, 200, 320))
                image = draw_plain(shape, color, background, side, radius, rng)
                found.append((as_jpeg(image), shape, color))
    return found
