"""The committed demo model: small, loadable like llava-hf, and right on images it never saw.

Accuracy is measured through the engine itself (``llava.demo_eval.evaluate``): the model dir
loaded through ``llava.model.load_model``, one session per dialogue, greedy decoding.
"""

from __future__ import annotations

import random

import pytest
from PIL import Image

from llava.demo_eval import KINDS, QUESTIONS, DialogueTokens, evaluate
from llava.prompt import user_message
from llava.synthetic import (
    COLORS,
    HELD_OUT_SEED_START,
    SHAPES,
    TRAIN_SEEDS,
    draw_sample,
    held_out_samples,
    sample_from_seed,
)
from tests.conftest import DEMO_MODEL_DIR

HELD_OUT_IMAGES = 100
MIN_ACCURACY = 0.95
MAX_DIR_BYTES = 8 * 2**20

EXPECTED_FILES = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def test_model_dir_holds_only_a_few_megabytes_of_model_files():
    files = {p.name: p.stat().st_size for p in DEMO_MODEL_DIR.iterdir()}
    assert set(files) == EXPECTED_FILES  # no checkpoints, optimizer states or leftovers
    assert sum(files.values()) < MAX_DIR_BYTES


def test_held_out_accuracy_per_question_kind(demo_model):
    accuracy = evaluate(demo_model, held_out_samples(HELD_OUT_IMAGES))
    assert set(accuracy) == set(KINDS)
    below = {kind: value for kind, value in accuracy.items() if value < MIN_ACCURACY}
    assert not below, f"held-out accuracy below {MIN_ACCURACY:.0%}: {below} (all: {accuracy})"


def test_special_ids_agree_between_tokenizer_and_config(demo_model):
    tokenizer, config = demo_model.tokenizer, demo_model.model.config
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert demo_model.eos_token_ids == {tokenizer.eos_token_id}
    assert demo_model.model.generation_config.pad_token_id == tokenizer.pad_token_id
    ids = tokenizer("What shape is it?").input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids


def test_every_answer_word_is_one_token(demo_model):
    tokenizer = demo_model.tokenizer
    for word in (*COLORS, *SHAPES):
        assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, word


def test_image_expands_to_one_token_per_patch(demo_model):
    """Any image size: the processor resizes, then one <image> token per patch (CLS dropped)."""
    vision = demo_model.model.config.vision_config
    odd_size = Image.new("RGB", (50, 80))
    ids, _ = DialogueTokens(demo_model.processor).first_turn(QUESTIONS[0], odd_size)
    patches = (vision.image_size // vision.patch_size) ** 2
    assert ids.count(demo_model.model.config.image_token_id) == patches


def test_training_first_turn_is_the_canonical_prompt(demo_model):
    """Turn 1 as trained (one processor call) == the engine's canonical prompt ids."""
    pieces = DialogueTokens(demo_model.processor)
    image = held_out_samples(1)[0].image
    for question in QUESTIONS[:2]:
        ids, _ = pieces.first_turn(question, image)
        tokens = ids.count(demo_model.model.config.image_token_id)
        messages = [user_message(question, with_image=True)]
        assert ids == demo_model.prompt.ids(messages, image_tokens=tokens)


def test_samples_are_a_function_of_their_seed():
    a, b = sample_from_seed(123), sample_from_seed(123)
    assert (a.shape, a.color, a.image.tobytes()) == (b.shape, b.color, b.image.tobytes())
    assert draw_sample(random.Random(5)).image.size == (64, 64)


def test_held_out_seeds_never_overlap_training_seeds():
    assert TRAIN_SEEDS.stop <= HELD_OUT_SEED_START
    with pytest.raises(ValueError):
        held_out_samples(1, seed=TRAIN_SEEDS.stop - 1)


def test_samples_cover_every_shape_and_colour():
    samples = held_out_samples(300)
    assert {s.shape for s in samples} == set(SHAPES)
    assert {s.color for s in samples} == set(COLORS)
