"""Pad-to-square (LLaVA-1.5's image_aspect_ratio=pad): on where the checkpoint asks, else off."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image, ImageDraw

from llava.config import EngineConfig, SettingsError
from llava.engine import Engine
from llava.kv.budget import MemoryBudget
from llava.model.imageprep import (
    PAD,
    image_aspect_ratio,
    mean_fill,
    pad_to_square,
    prepare_image,
    prepared_size,
)


def wide_orange_circle() -> Image.Image:
    """640x240, light grey, an orange circle near the right edge: centre-cropped away.

    Its radius (100 px) is 0.16 of the longer side: padded to a square, that side is the
    model's, and the demo model knows shapes from 0.15 of it (docs/demo-model.md §What it knows).
    """
    image = Image.new("RGB", (640, 240), (235, 235, 235))
    ImageDraw.Draw(image).ellipse((436, 20, 636, 220), fill=(255, 140, 0))
    return image


def test_pad_centres_the_image_on_a_square_of_the_fill_colour():
    image = Image.new("RGB", (6, 2), (200, 10, 10))
    square = pad_to_square(image, (1, 2, 3))
    assert square.size == (6, 6)
    assert square.getpixel((0, 0)) == square.getpixel((5, 5)) == (1, 2, 3)
    assert square.crop((0, 2, 6, 4)).tobytes() == image.tobytes()  # rows 2-3: the image
    tall = pad_to_square(Image.new("RGB", (1, 3), (9, 9, 9)), (0, 0, 0))
    assert [tall.getpixel((x, 1)) for x in range(3)] == [(0, 0, 0), (9, 9, 9), (0, 0, 0)]


def test_square_images_and_checkpoints_without_the_key_are_left_alone(demo_model):
    processor = demo_model.processor.image_processor
    square = Image.new("RGB", (50, 50))
    assert prepare_image(square, PAD, processor) is square
    wide = wide_orange_circle()
    assert prepare_image(wide, None, processor) is wide
    assert image_aspect_ratio(object()) is None  # no key: the processor's own behaviour


@pytest.mark.parametrize("mode", [PAD, None])
@pytest.mark.parametrize("size", [(50, 50), (80, 30), (30, 81)])
def test_the_prepared_size_is_known_without_preparing(demo_model, mode, size):
    """What a turn's image-token count is taken from, before its features exist."""
    image = Image.new("RGB", size)
    prepared = prepare_image(image, mode, demo_model.processor.image_processor)
    assert prepared_size(image, mode) == prepared.size


def test_an_unknown_mode_is_a_one_line_settings_error_at_load():
    config = type("Config", (), {"image_aspect_ratio": "anyres"})()
    with pytest.raises(SettingsError, match="image_aspect_ratio: 'anyres'") as raised:
        image_aspect_ratio(config)
    assert "\n" not in str(raised.value)


def test_the_whole_image_reaches_the_vision_tower_only_when_the_checkpoint_says_pad(demo_model):
    wide = wide_orange_circle()
    image_processor = demo_model.processor.image_processor
    padded = pad_to_square(wide, mean_fill(image_processor))
    assert padded.size == (640, 640) and padded.getpixel((588, 318)) == (255, 140, 0)
    for mode, seen in ((PAD, padded), (None, wide)):  # None: as llava-hf checkpoints
        loaded = dataclasses.replace(demo_model, image_aspect_ratio=mode)
        engine = Engine(loaded, EngineConfig(model_dir="-"), MemoryBudget(1 << 24))
        try:
            expected = image_processor(images=seen, return_tensors="pt").pixel_values
            assert torch.equal(engine._pixels(wide)["pixel_values"], expected)
        finally:
            engine.stop()


def test_the_demo_model_pads_and_answers_about_the_whole_wide_image(demo_model):
    """The issue's example: centre-cropped, the circle was cut away and "blue" came back."""
    assert demo_model.image_aspect_ratio == PAD  # stored in its config.json
    engine = Engine(demo_model, EngineConfig(model_dir="-"), MemoryBudget(1 << 24))
    try:
        session_id = engine.open(wide_orange_circle()).session_id
        assert engine.ask(session_id, "What shape is it?").text == "circle"
        assert engine.ask(session_id, "And its color?").text == "orange"
    finally:
        engine.stop()
