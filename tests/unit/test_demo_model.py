"""The committed demo model: small, loadable like llava-hf, and right on images it never saw.

Accuracy is measured through the engine itself (``demo_model.evaluation.evaluate``): the model dir
loaded through ``llava.model.loading.load_model``, one session per dialogue, greedy decoding. Two
image sources: held-out seeds of the training generator (every family, non-square canvases
included) and ``tests/plain_shapes.py``, a drawer that shares no code with that generator.
"""

from __future__ import annotations

import json
import random

import pytest
from PIL import Image

from demo_model.build import CONFIGS, NEXT_FIXTURE, build_next_config, build_processor
from demo_model.evaluation import (
    DONT_KNOW,
    KINDS,
    OFF_TOPIC_QUESTIONS,
    QUESTIONS,
    DialogueTokens,
    declined,
    evaluate,
)
from demo_model.synthetic import (
    COLORS,
    FAMILIES,
    HELD_OUT_SEED_START,
    RADIUS,
    SHAPES,
    TRAIN_SEEDS,
    ShapeSample,
    draw_sample,
    held_out_samples,
    sample_from_seed,
)
from llava.model.checkpoint import inspect_checkpoint
from llava.model.prompt import user_message
from llava.model.vision import image_tokens
from tests.conftest import DEMO_MODEL_DIR
from tests.plain_shapes import plain_images

HELD_OUT_IMAGES = 100  # 20 per family
MIN_ACCURACY = 0.95
# Never trained on (OFF_TOPIC_QUESTIONS are): other words, other phrasings, unknown words.
HELD_OUT_OFF_TOPIC = (
    "How large is the shape?",
    "What is the colour of the background?",
    "Is there a cat in this picture?",
    "What number is this?",
    "Could you describe it?",
    "Where was this taken?",
    "How many corners does it have?",
    "Is it round?",
    "What do you see?",
    "Who is the president?",
    "What are you?",
    "Shape?",
)
MIN_DECLINED = 0.9
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


def assert_accurate(accuracy: dict[str, float]) -> None:
    assert set(accuracy) == set(KINDS)
    below = {kind: value for kind, value in accuracy.items() if value < MIN_ACCURACY}
    assert not below, f"accuracy below {MIN_ACCURACY:.0%}: {below} (all: {accuracy})"


@pytest.mark.thorough
def test_held_out_accuracy_per_question_kind(demo_model):
    """Every family: muted, white/near-white, dark, textured backgrounds and wide canvases."""
    assert_accurate(evaluate(demo_model, held_out_samples(HELD_OUT_IMAGES, families=FAMILIES)))


@pytest.mark.thorough
def test_accuracy_on_plain_shapes_drawn_by_other_code(demo_model):
    samples = [ShapeSample(image, shape, color) for image, shape, color in plain_images()]
    assert_accurate(evaluate(demo_model, samples))


@pytest.mark.thorough  # the model's answers about a sample per off-topic question
def test_questions_it_does_not_know_get_i_dont_know(demo_model):
    share = declined(demo_model, held_out_samples(len(HELD_OUT_OFF_TOPIC)), HELD_OUT_OFF_TOPIC)
    assert share >= MIN_DECLINED
    assert not set(HELD_OUT_OFF_TOPIC) & set(OFF_TOPIC_QUESTIONS)


def test_special_ids_agree_between_tokenizer_and_config(demo_model):
    tokenizer, config = demo_model.tokenizer, demo_model.model.config
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert demo_model.eos_token_ids == {tokenizer.eos_token_id}
    assert demo_model.model.generation_config.pad_token_id == tokenizer.pad_token_id
    ids = tokenizer("What shape is it?").input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids


def test_every_answer_is_one_token_of_its_own(demo_model):
    tokenizer = demo_model.tokenizer
    answers = (*COLORS, *SHAPES, DONT_KNOW)
    ids = {answer: tokenizer(answer, add_special_tokens=False).input_ids for answer in answers}
    assert all(len(found) == 1 for found in ids.values()), ids
    # Distinct ids that decode back: "I don't know" once shared its id with "cross".
    assert len({found[0] for found in ids.values()}) == len(answers), ids
    assert all(tokenizer.decode(found) == answer for answer, found in ids.items())


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
        messages = [user_message(question, images=1)]
        assert ids == demo_model.prompt.ids(messages, image_tokens=tokens)


def test_samples_are_a_function_of_their_seed():
    a, b = sample_from_seed(123), sample_from_seed(123)
    assert (a.shape, a.color, a.image.tobytes()) == (b.shape, b.color, b.image.tobytes())
    assert draw_sample(random.Random(5), "light").family == "light"


@pytest.mark.thorough  # 300 images drawn
def test_held_out_set_is_as_broad_as_promised():
    samples = held_out_samples(300, families=FAMILIES)
    assert {s.family for s in samples} == set(FAMILIES)
    sizes = [s.radius for s in samples]
    assert min(sizes) < 0.2 and max(sizes) > 0.4
    assert all(RADIUS[0] <= size <= RADIUS[1] for size in sizes)
    assert all((s.image.width == s.image.height) == (s.family != "wide") for s in samples)


def test_held_out_seeds_never_overlap_training_seeds():
    assert TRAIN_SEEDS.stop <= HELD_OUT_SEED_START
    with pytest.raises(ValueError):
        held_out_samples(1, seed=TRAIN_SEEDS.stop - 1)


@pytest.mark.thorough  # 300 images drawn
def test_samples_cover_every_shape_and_colour():
    samples = held_out_samples(300)
    assert {s.shape for s in samples} == set(SHAPES)
    assert {s.color for s in samples} == set(COLORS)


def test_realistic_next_shape_is_a_servable_next_checkpoint(tmp_path):
    """``--config realistic-next`` (scripts/bench/turns.py's NeXT shape): its small files pass
    the engine's checkpoint checks, with NeXT's geometry, a GQA Mistral LM and the fixture's
    template (the weights are not built here: the bench builds them)."""
    shape = CONFIGS["realistic-next"]
    processor = build_processor(shape)
    build_next_config(shape).save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    inspected = inspect_checkpoint(tmp_path)
    text = inspected.config.text_config
    assert inspected.family == "llava_next"
    assert (text.model_type, text.num_attention_heads, text.num_key_value_heads) == (
        "mistral",
        12,
        4,
    )
    assert image_tokens(inspected.processor, 672, 672) == 2928
    assert text.max_position_embeddings > 2928 + 10 * 40  # ten turns after the image
    fixture = json.loads((NEXT_FIXTURE / "chat_template.json").read_text())["chat_template"]
    assert inspected.processor.chat_template == fixture
