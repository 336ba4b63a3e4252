"""Synthetic labelled images for the demo model: one coloured shape on a background.

The demo LLaVA is trained and evaluated on these, so it can answer "What shape is it?" and
"What color is the shape?" about images it has never seen, fully offline. Only PIL and the
standard library are used (no torch), so tests, the demo and the notebook can import this cheaply.

Every sample is a pure function of one integer seed (and its family), which keeps training and
evaluation disjoint by construction:

* seeds ``0 .. 19_999`` (``TRAIN_SEEDS``) are the only ones the build script trains on;
* seeds from ``20_000`` up (``HELD_OUT_SEED_START``) are for held-out evaluation only.

What people draw, not only what is easy: backgrounds in four families (``muted`` greys and dull
tints, ``light`` white and near-white, ``dark``, ``textured`` noise, stripes and checks), a
fifth family ``wide`` of non-square canvases (aspect ratio up to 2.5 either way), shapes whose
radius is 0.15-0.45 of the canvas' shorter side anywhere in the frame, canvases of 48-128 px,
and a JPEG round trip for about a third of them. A shape's colour is a saturated hue (or white
on a darker background), so "the colour" always means the shape's colour.
"""

from __future__ import annotations

import colorsys
import io
import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFilter

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange", "white")
BACKGROUNDS: tuple[str, ...] = ("muted", "light", "dark", "textured")
FAMILIES: tuple[str, ...] = (*BACKGROUNDS, "wide")  # wide: any background, non-square canvas

TRAIN_SEEDS = range(0, 20_000)
HELD_OUT_SEED_START = 20_000

SHORT_SIDE = (48, 128)  # canvas shorter side in pixels
RADIUS = (0.15, 0.45)  # shape radius (centre to farthest point) / canvas shorter side
MAX_ASPECT = 2.5  # wide canvases: longer / shorter side
JPEG_SHARE = 0.35
_SUPERSAMPLE = 3  # draw the shape large and downsample: anti-aliased edges, as in a photo

# Hue band in degrees, minimum saturation and value of each saturated colour: wide enough for
# what people pick (pure web colours such as PIL's "green" (0,128,0) and "purple" (128,0,128)).
_COLOR_BANDS = {
    "red": (-15.0, 10.0, 0.65, 0.6),
    "orange": (18.0, 42.0, 0.75, 0.85),
    "yellow": (47.0, 65.0, 0.7, 0.8),
    "green": (85.0, 155.0, 0.6, 0.45),
    "blue": (200.0, 245.0, 0.6, 0.5),
    "purple": (262.0, 305.0, 0.5, 0.45),
}
# Background value (brightness) range per family; white shapes get a darker cap.
_BACKGROUND_VALUE = {
    "muted": (0.25, 0.75),
    "light": (0.86, 1.0),
    "dark": (0.0, 0.25),
    "textured": (0.1, 0.8),
}
_WHITE_SHAPE_MAX_VALUE = 0.55


@dataclass(frozen=True)
class ShapeSample:
    """An RGB image, its two labels (the words the demo model answers with) and how it was made."""

    image: Image.Image
    shape: str
    color: str
    family: str = "muted"
    radius: float = 0.3  # of the canvas' shorter side
    # The outline's vertices as (x, y) fractions of the canvas' width and height, and whether
    # each is convex (a tip) or concave (a star's or cross's inner corner); none for a circle.
    corners: tuple[tuple[float, float, bool], ...] = ()


def _rgb(hue: float, sat: float, val: float) -> tuple[int, int, int]:
    red, green, blue = colorsys.hsv_to_rgb(hue % 1.0, sat, val)
    return round(red * 255), round(green * 255), round(blue * 255)


def _shape_rgb(rng: random.Random, color: str) -> tuple[int, int, int]:
    if color == "white":
        return _rgb(rng.random(), rng.uniform(0.0, 0.06), rng.uniform(0.93, 1.0))
    low, high, min_sat, min_val = _COLOR_BANDS[color]
    hue = rng.uniform(low, high) / 360.0
    return _rgb(hue, rng.uniform(min_sat, 1.0), rng.uniform(min_val, 1.0))


class _Palette:
    """Low-saturation background colours within one value range."""

    def __init__(self, rng: random.Random, values: tuple[float, float], max_sat: float):
        self.rng, self.values, self.max_sat = rng, values, max_sat

    def __call__(self) -> tuple[int, int, int]:
        rng = self.rng
        return _rgb(rng.random(), rng.uniform(0.0, self.max_sat), rng.uniform(*self.values))


def _gradient(rng: random.Random, size: tuple[int, int], palette: _Palette) -> Image.Image:
    # Rotate a ramp larger than the canvas and keep its centre: no corners filled with black.
    side = 2 * max(size)
    ramp = Image.linear_gradient("L").resize((side, side))
    ramp = ramp.rotate(rng.uniform(0, 360), Image.Resampling.BILINEAR)
    left, top = (side - size[0]) // 2, (side - size[1]) // 2
    ramp = ramp.crop((left, top, left + size[0], top + size[1]))
    return Image.composite(
        Image.new("RGB", size, palette()), Image.new("RGB", size, palette()), ramp
    )


def _blotches(rng: random.Random, size: tuple[int, int], palette: _Palette) -> Image.Image:
    cells = (rng.randint(3, 6), rng.randint(3, 6))
    grid = Image.new("RGB", cells)
    grid.putdata([palette() for _ in range(cells[0] * cells[1])])
    return grid.resize(size, Image.Resampling.BICUBIC)


def _pattern(rng: random.Random, size: tuple[int, int], palette: _Palette) -> Image.Image:
    """Stripes or checks of two close colours, at a pitch much finer or coarser than a shape."""
    image = Image.new("RGB", size, palette())
    draw = ImageDraw.Draw(image)
    other = palette()
    pitch = rng.choice((2, 3, 4, 12, 16))
    checks = rng.random() < 0.5
    for x in range(0, size[0], 2 * pitch):
        if checks:
            for y in range(0, size[1], 2 * pitch):
                draw.rectangle((x, y, x + pitch - 1, y + pitch - 1), fill=other)
                draw.rectangle(
                    (x + pitch, y + pitch, x + 2 * pitch - 1, y + 2 * pitch - 1), fill=other
                )
        else:
            draw.rectangle((x, 0, x + pitch - 1, size[1]), fill=other)
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.ROTATE_90).resize(size)
    return image


def _grain(rng: random.Random, image: Image.Image, amount: float) -> Image.Image:
    """Fine noise from the seeded rng (PIL's own noise is not seedable)."""
    noise = Image.frombytes("RGB", image.size, rng.randbytes(image.width * image.height * 3))
    return Image.blend(image, noise.filter(ImageFilter.GaussianBlur(0.6)), amount)


def _background(rng: random.Random, size: tuple[int, int], kind: str, color: str) -> Image.Image:
    low, high = _BACKGROUND_VALUE[kind]
    if color == "white":  # a white shape keeps its contrast
        high = min(high, _WHITE_SHAPE_MAX_VALUE)
    if kind == "light":
        palette = _Palette(rng, (low, high), 0.08)
        image = (
            Image.new("RGB", size, palette())
            if rng.random() < 0.7
            else _gradient(rng, size, palette)
        )
        return _grain(rng, image, rng.uniform(0.0, 0.06))
    if kind == "textured":
        palette = _Palette(rng, (low, high), 0.25)
        maker = rng.choice((_blotches, _pattern, _gradient))
        return _grain(rng, maker(rng, size, palette), rng.uniform(0.1, 0.3))
    palette = _Palette(rng, (low, high), 0.3 if kind == "dark" else 0.22)
    maker = rng.choice((_blotches, _gradient, None))
    image = Image.new("RGB", size, palette()) if maker is None else maker(rng, size, palette)
    return _grain(rng, image, rng.uniform(0.0, 0.1))


def _rotate(points: list[tuple[float, float]], angle: float) -> list[tuple[float, float]]:
    cos, sin = math.cos(angle), math.sin(angle)
    return [(x * cos - y * sin, x * sin + y * cos) for x, y in points]


def _outline(shape: str, rng: random.Random) -> list[tuple[float, float]] | None:
    """Polygon of radius ~1 (centred at 0) for ``shape``; None for the circle.

    Shapes stand upright as people draw them, tilted a little (triangles sometimes point down):
    with every orientation the tower has far more corner patterns to learn, and named 82 %
    instead of 90 % of shapes after 1000 steps (docs/demo-model.md §Demo model: what made shapes
    learnable).
    """
    if shape == "circle":
        return None
    if shape == "square":
        points = [(-0.72, -0.72), (0.72, -0.72), (0.72, 0.72), (-0.72, 0.72)]
        tilt = 6.0
    elif shape == "triangle":
        points = [
            (math.cos(a), math.sin(a))
            for a in (-math.pi / 2 + k * 2 * math.pi / 3 for k in range(3))
        ]
        points = [(x, y + 0.15) for x, y in points]  # centre the triangle's mass
        tilt = 9.0
        if rng.random() < 0.2:  # pointing down
            points = [(x, -y) for x, y in points]
    elif shape == "star":
        inner = rng.uniform(0.36, 0.5)
        points = []
        for k in range(10):
            radius = 1.0 if k % 2 == 0 else inner
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((radius * math.cos(angle), radius * math.sin(angle)))
        tilt = 11.0
    elif shape == "cross":
        arm = rng.uniform(0.2, 0.42)  # thin to fat plus signs
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
        tilt = 6.0
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")
    return _rotate(points, math.radians(rng.uniform(-tilt, tilt)))


def _corners(points: list[tuple[float, float]]) -> list[bool]:
    """Per vertex of a simple polygon: convex (True) or concave, whatever its orientation."""
    n = len(points)
    turns = []
    for i in range(n):
        (ax, ay), (bx, by), (cx, cy) = points[i - 1], points[i], points[(i + 1) % n]
        turns.append((bx - ax) * (cy - by) - (by - ay) * (cx - bx))
    following = points[1:] + points[:1]
    area = sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(points, following, strict=True))
    return [turn * area > 0 for turn in turns]


def _canvas_size(rng: random.Random, wide: bool) -> tuple[int, int]:
    short = rng.randint(*SHORT_SIDE)
    if not wide:
        return short, short
    long = round(short * rng.uniform(1.25, MAX_ASPECT))
    return (long, short) if rng.random() < 0.6 else (short, long)


def draw_sample_and_mask(
    rng: random.Random, family: str | None = None
) -> tuple[ShapeSample, Image.Image]:
    """One random shape of one random colour in ``family`` (random if None), and its mask.

    The mask ("L", 255 = inside the shape, same size as the image) is an auxiliary training
    target: telling the vision tower which patches are the shape, whatever its colour, is what
    makes shapes learnable in minutes.
    """
    if family is None:
        family = rng.choices(FAMILIES, weights=(3, 3, 2, 2, 3))[0]
    shape, color = rng.choice(SHAPES), rng.choice(COLORS)
    kinds = [k for k in BACKGROUNDS if not (color == "white" and k == "light")]
    kind = family if family in BACKGROUNDS else rng.choice(kinds)
    if color == "white" and kind == "light":
        color = rng.choice(COLORS[:-1])
    size = _canvas_size(rng, wide=family == "wide")
    short, long = min(size), max(size)
    # Padded to a square, the canvas' longer side is the model's side: keep a shape at least
    # 0.15 of that, so a wide canvas does not shrink it below what the model can see.
    low = max(RADIUS[0] * short, RADIUS[0] * long)
    radius = rng.uniform(low, RADIUS[1] * short)
    background = _background(rng, size, kind, color)

    scale = _SUPERSAMPLE
    big = (size[0] * scale, size[1] * scale)
    reach = radius * scale * 1.05  # the square's corners reach 1.02
    cx = rng.uniform(reach, big[0] - reach)
    cy = rng.uniform(reach, big[1] - reach)
    mask = Image.new("L", big, 0)
    draw = ImageDraw.Draw(mask)
    outline = _outline(shape, rng)
    r = radius * scale
    corners: tuple[tuple[float, float, bool], ...] = ()
    if outline is None:
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
    else:
        points = [(cx + x * r, cy + y * r) for x, y in outline]
        draw.polygon(points, fill=255)
        corners = tuple(
            (x / big[0], y / big[1], convex)
            for (x, y), convex in zip(points, _corners(points), strict=True)
        )
    mask = mask.resize(size, Image.Resampling.LANCZOS)
    image = Image.composite(Image.new("RGB", size, _shape_rgb(rng, color)), background, mask)
    if rng.random() < JPEG_SHARE:
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=rng.randint(30, 90))
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    sample = ShapeSample(image, shape, color, family, radius / short, corners)
    return sample, mask


def draw_sample(rng: random.Random, family: str | None = None) -> ShapeSample:
    """Draw one random shape of one random colour, at a random size and position."""
    return draw_sample_and_mask(rng, family)[0]


def sample_and_mask_from_seed(
    seed: int, family: str | None = None
) -> tuple[ShapeSample, Image.Image]:
    """The sample of one seed: the same seed (and family) always gives the same image."""
    return draw_sample_and_mask(random.Random(seed), family)


def sample_from_seed(seed: int, family: str | None = None) -> ShapeSample:
    return sample_and_mask_from_seed(seed, family)[0]


def held_out_samples(
    n: int, seed: int = HELD_OUT_SEED_START, families: tuple[str, ...] = BACKGROUNDS
) -> list[ShapeSample]:
    """``n`` evaluation samples from seeds ``seed .. seed+n-1``, never a training seed.

    Families take turns; the default is the four square-canvas families, so every image keeps
    its whole content through the processor even without padding. ``FAMILIES`` adds ``wide``.
    """
    if seed < HELD_OUT_SEED_START:
        raise ValueError(f"held-out seeds start at {HELD_OUT_SEED_START}; {seed} may be trained on")
    return [sample_from_seed(seed + i, families[i % len(families)]) for i in range(n)]
