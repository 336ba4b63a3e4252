"""Synthetic labelled images for the demo model: one coloured shape on a muted background.

The demo LLaVA is trained and evaluated on these, so it can answer "What shape is it?" and
"What color is the shape?" about images it has never seen, fully offline. Only PIL and the
standard library are used (no torch), so tests, the demo and the notebook can import this cheaply.

Every sample is a pure function of one integer seed, which keeps training and evaluation
disjoint by construction:

* seeds ``0 .. 9_999`` (``TRAIN_SEEDS``) are the only ones the build script trains on;
* seeds from ``10_000`` up (``HELD_OUT_SEED_START``) are for held-out evaluation only.

Backgrounds are low-saturation (greys, dull tints, gradients, blotchy and fine noise) and the
shape is a saturated colour (or white on a darker background), so "the colour" always means the
shape's colour and the shape always stands out.
"""

from __future__ import annotations

import colorsys
import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFilter

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange", "white")

TRAIN_SEEDS = range(0, 10_000)
HELD_OUT_SEED_START = 10_000

DEFAULT_SIZE = 64
_SUPERSAMPLE = 4  # draw large and downsample: anti-aliased edges, as in a real photo

# Hue centre in degrees for the saturated colours; jitter stays well inside each band.
_HUES = {"red": 0.0, "orange": 30.0, "yellow": 56.0, "green": 120.0, "blue": 225.0, "purple": 280.0}
_HUE_JITTER = 7.0
# Shape radius as a fraction of the image side: small shapes leave too few pixels to tell
# a circle from a square once the processor shrinks the image to the model's 32 px.
_RADIUS = (0.28, 0.45)


@dataclass(frozen=True)
class ShapeSample:
    """An RGB image and its two labels: the words the demo model answers with."""

    image: Image.Image
    shape: str
    color: str


def _shape_rgb(rng: random.Random, color: str) -> tuple[int, int, int]:
    if color == "white":
        hue, sat, val = rng.random(), rng.uniform(0.0, 0.06), rng.uniform(0.93, 1.0)
    else:
        hue = (_HUES[color] + rng.uniform(-_HUE_JITTER, _HUE_JITTER)) / 360.0 % 1.0
        sat, val = rng.uniform(0.8, 1.0), rng.uniform(0.8, 1.0)
    red, green, blue = colorsys.hsv_to_rgb(hue, sat, val)
    return round(red * 255), round(green * 255), round(blue * 255)


def _muted_rgb(rng: random.Random, val_range: tuple[float, float]) -> tuple[int, int, int]:
    red, green, blue = colorsys.hsv_to_rgb(
        rng.random(), rng.uniform(0.0, 0.22), rng.uniform(*val_range)
    )
    return round(red * 255), round(green * 255), round(blue * 255)


def _background(rng: random.Random, size: int, color: str) -> Image.Image:
    """A muted background; darker ranges for white shapes so they keep their contrast."""
    val_range = (0.08, 0.55) if color == "white" else (0.08, 0.75)
    kind = rng.choice(("solid", "gradient", "blotches"))
    if kind == "solid":
        image = Image.new("RGB", (size, size), _muted_rgb(rng, val_range))
    elif kind == "gradient":
        start, end = _muted_rgb(rng, val_range), _muted_rgb(rng, val_range)
        # Rotate a ramp twice the size and keep its centre: no corners filled with black.
        ramp = Image.linear_gradient("L").resize((2 * size, 2 * size))
        ramp = ramp.rotate(rng.uniform(0, 360), Image.Resampling.BILINEAR)
        ramp = ramp.crop((size // 2, size // 2, size // 2 + size, size // 2 + size))
        image = Image.composite(
            Image.new("RGB", (size, size), end), Image.new("RGB", (size, size), start), ramp
        )
    else:
        cells = rng.randint(3, 6)
        grid = Image.new("RGB", (cells, cells))
        grid.putdata([_muted_rgb(rng, val_range) for _ in range(cells * cells)])
        image = grid.resize((size, size), Image.Resampling.BICUBIC)
    amount = rng.uniform(0.0, 0.25)
    if amount > 0.02:  # fine grain, from the seeded rng (PIL's own noise is not seedable)
        noise = Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))
        image = Image.blend(image, noise.filter(ImageFilter.GaussianBlur(0.6)), amount * 0.5)
    return image


def _rotate(points: list[tuple[float, float]], angle: float) -> list[tuple[float, float]]:
    cos, sin = math.cos(angle), math.sin(angle)
    return [(x * cos - y * sin, x * sin + y * cos) for x, y in points]


def _outline(shape: str, rng: random.Random) -> list[tuple[float, float]] | None:
    """Unit-radius polygon (centred at 0) for ``shape``; None for the circle."""
    if shape == "circle":
        return None
    if shape == "square":
        points = [(-0.75, -0.75), (0.75, -0.75), (0.75, 0.75), (-0.75, 0.75)]
        tilt = 20.0  # a larger tilt would turn the square into a diamond
    elif shape == "triangle":
        points = [
            (math.cos(a), math.sin(a))
            for a in (-math.pi / 2 + k * 2 * math.pi / 3 for k in range(3))
        ]
        points = [(x, y + 0.15) for x, y in points]  # centre the triangle's mass
        tilt = 25.0
    elif shape == "star":
        points = []
        for k in range(10):
            radius = 1.0 if k % 2 == 0 else 0.42
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((radius * math.cos(angle), radius * math.sin(angle)))
        tilt = 25.0
    elif shape == "cross":
        arm = 0.3
        points = [
            (-arm, -1),
            (arm, -1),
            (arm, -arm),
            (1, -arm),
            (1, arm),
            (arm, arm),
            (arm, 1),
            (-arm, 1),
            (-arm, arm),
            (-1, arm),
            (-1, -arm),
            (-arm, -arm),
        ]
        tilt = 20.0
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")
    return _rotate(points, math.radians(rng.uniform(-tilt, tilt)))


def draw_sample(rng: random.Random, size: int = DEFAULT_SIZE) -> ShapeSample:
    """Draw one random shape of one random colour, at a random size and position."""
    return draw_sample_and_mask(rng, size)[0]


def draw_sample_and_mask(
    rng: random.Random, size: int = DEFAULT_SIZE
) -> tuple[ShapeSample, Image.Image]:
    """:func:`draw_sample` plus the shape's coverage mask ("L", 255 = inside the shape).

    The build script uses the mask as an auxiliary training target: telling the vision tower
    which patches are the shape, whatever its colour, is what makes shapes learnable in minutes.
    """
    shape, color = rng.choice(SHAPES), rng.choice(COLORS)
    background = _background(rng, size, color)
    big = size * _SUPERSAMPLE
    mask = Image.new("L", (big, big), 0)
    radius = rng.uniform(*_RADIUS) * big
    margin = radius * 1.1  # the square's corners reach 1.06
    cx, cy = rng.uniform(margin, big - margin), rng.uniform(margin, big - margin)
    draw = ImageDraw.Draw(mask)
    outline = _outline(shape, rng)
    if outline is None:
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=255)
    else:
        draw.polygon([(cx + x * radius, cy + y * radius) for x, y in outline], fill=255)
    mask = mask.resize((size, size), Image.Resampling.LANCZOS)
    image = Image.composite(
        Image.new("RGB", (size, size), _shape_rgb(rng, color)), background, mask
    )
    return ShapeSample(image=image, shape=shape, color=color), mask


def sample_from_seed(seed: int, size: int = DEFAULT_SIZE) -> ShapeSample:
    """The sample of one seed: the same seed always gives the same image and labels."""
    return draw_sample(random.Random(seed), size)


def sample_and_mask_from_seed(
    seed: int, size: int = DEFAULT_SIZE
) -> tuple[ShapeSample, Image.Image]:
    return draw_sample_and_mask(random.Random(seed), size)


def held_out_samples(
    n: int, seed: int = HELD_OUT_SEED_START, size: int = DEFAULT_SIZE
) -> list[ShapeSample]:
    """``n`` evaluation samples from seeds ``seed .. seed+n-1``, never a training seed."""
    if seed < HELD_OUT_SEED_START:
        raise ValueError(f"held-out seeds start at {HELD_OUT_SEED_START}; {seed} may be trained on")
    return [sample_from_seed(seed + i, size) for i in range(n)]
