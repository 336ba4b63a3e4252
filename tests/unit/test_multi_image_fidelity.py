"""Several images in one session (issue 52), token for token against Hugging Face's pipeline.

A session gets an image at its open and on any turn (``Engine.ask(..., image=...)``), each in
its own user message before the question, as HF's chat template places one. The oracle is HF's
own pipeline on the whole conversation each turn: ``processor.apply_chat_template(...,
tokenize=True)`` with the PIL images in the image parts (the processor expands each ``<image>``
by that image's own count: LLaVA-NeXT's differs by aspect ratio) and ``model.generate``, never
the engine's own history. Greedy answers must equal it over 10 turns, on the tiny llava-1.5 of
test_checkpoint_fidelity.py's shape and the tiny LLaVA-NeXT families of test_family_fidelity.py,
and after every tier move, a restart, a rewind past an image, a refused image and a shared one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import InvalidRequest
from llava.kv.budget import MemoryBudget
from llava.kv.holding import Tier
from llava.model.loading import load_model
from llava.model.vision import image_tokens
from tests.families import FAMILIES, build_family
from tests.unit.test_checkpoint_fidelity import (
    build_tiny_llava15,
    hf_generate,
    hf_inputs,
    last_prompt,
)
from tests.unit.test_family_fidelity import QUESTIONS

MAX_NEW = 6
# (width, height) of NeXT images that pick different pinpoints: different token counts
WIDE, ODD, TALL = (150, 50), (97, 61), (50, 150)


# -- the models --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava15(tmp_path_factory):
    """llava-1.5-7b-hf's config shrunk (56 px images: 16 image tokens each), its processor."""
    out = tmp_path_factory.mktemp("multi-image-llava-1.5")
    build_tiny_llava15(out, seed=1)
    return load_model(str(out), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def next_models(tmp_path_factory):
    """The tiny LLaVA-NeXT family of that name (test_family_fidelity.FAMILIES), built once."""
    built = {}

    def get(name: str = "v1.6-mistral"):
        if name not in built:
            out = tmp_path_factory.mktemp(f"multi-image-{name}")
            build_family(out, FAMILIES[name])
            built[name] = load_model(str(out), device="cpu", dtype="float32")
        return built[name]

    return get


@pytest.fixture
def next_model(next_models):
    return next_models()


def new_engine(loaded, **settings) -> Engine:
    config = EngineConfig(model_dir="-", **settings)
    return Engine(loaded, config, MemoryBudget(1 << 28, host_bytes=1 << 26))


def persistent_engine(loaded, directory: Path, **settings) -> Engine:
    return new_engine(loaded, persist_dir=str(directory), **settings)


# Backgrounds far apart: the tiny random models' greedy answers then change with the image
# (with alike pictures they barely do, and features fed in the wrong place could pass unseen).
COLORS = [(250, 250, 250), (230, 20, 20), (20, 230, 20), (5, 5, 5)]


def pictures(*sizes: tuple[int, int]) -> list[Image.Image]:
    """An image of each size, each on its own background, with a shape off-centre in the
    opposite color (so NeXT's tiles and the unpadded grid's edges see different pixels)."""
    images = []
    for (width, height), color in zip(sizes, COLORS, strict=False):
        image = Image.new("RGB", (width, height), color)
        shape = (width // 8, height // 6, width // 2, height // 2)
        ImageDraw.Draw(image).rectangle(shape, fill=tuple(255 - c for c in color))
        images.append(image)
    return images


# -- the oracle --------------------------------------------------------------------------------


@dataclass
class Turn:
    question: str
    image: Image.Image | None
    answer: str | None  # None: the question being asked


def messages_of(turns: list[Turn], opening: Image.Image | None) -> list[dict]:
    """The conversation as HF's pipeline takes it: each user message holds its images (the
    open's first, in the first one), as PIL images in the image parts, then the question."""
    messages = []
    for n, turn in enumerate(turns):
        images = [opening] if n == 0 and opening is not None else []
        images += [turn.image] if turn.image is not None else []
        content = [{"type": "image", "image": image} for image in images]
        content.append({"type": "text", "text": turn.question.strip()})
        messages.append({"role": "user", "content": content})
        if turn.answer is not None:
            text = {"type": "text", "text": turn.answer}
            messages.append({"role": "assistant", "content": [text]})
    return messages


@dataclass
class Chat:
    """One engine session and the conversation HF is given for it; ``ask`` checks each turn
    against HF's pipeline on the whole conversation."""

    engine: Engine
    session_id: str
    opening: Image.Image | None
    turns: list[Turn] = field(default_factory=list)

    @classmethod
    def open(cls, engine: Engine, image: Image.Image | None = None) -> Chat:
        return cls(engine, engine.open(image).session_id, image)

    def images(self, turns: list[Turn] | None = None) -> list[Image.Image]:
        turns = self.turns if turns is None else turns
        opening = [self.opening] if self.opening is not None else []
        return opening + [turn.image for turn in turns if turn.image is not None]

    def ask(self, question: str, image: Image.Image | None = None, *, rewind: int = 0, tier=None):
        engine, loaded = self.engine, self.engine.loaded
        asked = [*self.turns[: len(self.turns) - rewind], Turn(question, image, None)]
        answer = engine.ask(
            self.session_id, question, {"max_new_tokens": MAX_NEW}, image=image, rewind_turns=rewind
        )
        inputs = hf_inputs(loaded, messages_of(asked, self.opening))
        canonical = inputs["input_ids"][0].tolist()
        image_id = loaded.model.config.image_token_id
        held = self.images(asked)
        counts = [image_tokens(loaded.processor, *shown.size) for shown in held]
        assert canonical.count(image_id) == sum(counts)  # the oracle's: each image its count
        assert last_prompt(engine, self.session_id, answer) == canonical, question
        assert answer.cached_tokens + answer.new_tokens == len(canonical), question
        prefilled = canonical[len(canonical) - answer.new_tokens :]
        assert answer.image_tokens == prefilled.count(image_id), question
        if image is not None:  # no KV of it can be in the session yet: all its tokens prefilled
            assert answer.image_tokens >= counts[-1], f"{question}: {answer}"
        assert answer.images == len(held), question
        if tier is not None:
            assert answer.tier is tier, question
        assert list(answer.token_ids) == hf_generate(engine, inputs, MAX_NEW), question
        self.turns = [*asked[:-1], Turn(question, image, answer.text)]
        return answer


def moved_to(engine: Engine, session_id: str, tier: Tier) -> None:
    holding = engine.store.session(session_id).holding
    while holding.tier is not tier:
        engine.memory.move_down(holding)


def check_oracle_expands_each_image(loaded, sizes: list[tuple[int, int]]) -> list[int]:
    """HF's processor gives each image part its own count, in order: the oracle's premise."""
    images = pictures(*sizes)
    turns = [Turn(QUESTIONS[n], image, "It is so.") for n, image in enumerate(images)]
    turns[-1].answer = None
    ids = hf_inputs(loaded, messages_of(turns, None))["input_ids"][0].tolist()
    image_id = loaded.model.config.image_token_id
    runs, run = [], 0
    for token in [*ids, None]:
        if token == image_id:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    counts = [image_tokens(loaded.processor, *size) for size in sizes]
    assert runs == counts and ids.count(image_id) == sum(counts)
    return counts


# -- make test-fast ----------------------------------------------------------------------------


def test_llava15_ten_turns_with_three_images_equal_hf_generate(llava15):
    """Images at the open, on turn 4 and on turn 8: every prompt is HF's, every answer too."""
    assert check_oracle_expands_each_image(llava15, [(80, 50), (40, 60), (70, 70)]) == [16] * 3
    engine = new_engine(llava15)
    first, fourth, eighth = pictures((80, 50), (40, 60), (70, 70))
    chat = Chat.open(engine, first)
    for n, question in enumerate(QUESTIONS):
        image = {3: fourth, 7: eighth}.get(n)
        answer = chat.ask(question, image)
        if image is not None:  # the earlier turns' KV kept: only the new image prefilled
            assert answer.image_tokens == 16
        if n == 3:  # the oracle tells the images apart: another image there, another answer
            other = [*chat.turns[:-1], Turn(question, eighth, None)]
            inputs = hf_inputs(llava15, messages_of(other, first))
            assert hf_generate(engine, inputs, MAX_NEW) != list(answer.token_ids)
    assert answer.images == 3 and engine.store.session(chat.session_id).turns == len(QUESTIONS)


# make test-fast keeps Mistral (the checkpoint's own text model); make test runs all three
@pytest.mark.parametrize(
    "family",
    [
        pytest.param(name, marks=() if name == "v1.6-mistral" else pytest.mark.thorough)
        for name in FAMILIES
    ],
)
def test_next_ten_turns_with_images_of_different_aspect_ratios_equal_hf_generate(
    next_models, family
):
    loaded = next_models(family)
    counts = check_oracle_expands_each_image(loaded, [ODD, TALL, WIDE])
    assert len(set(counts)) == 3, counts  # the oracle tells the images apart by their counts
    engine = new_engine(loaded)
    opening, later = pictures(ODD, TALL)
    chat = Chat.open(engine, opening)
    assert engine.store.session(chat.session_id).holding.image_tokens == counts[0]
    for n, question in enumerate(QUESTIONS):
        answer = chat.ask(question, later if n == 4 else None)
        if n == 4:
            assert answer.image_tokens == counts[1]
    assert answer.images == 2


# make test-fast keeps the adoption after a restart (every image's features read back from disk
# and re-prefilled); make test runs the host tier, the features tier and parked too
@pytest.mark.parametrize(
    "move",
    [
        pytest.param("host", marks=pytest.mark.thorough),
        pytest.param("features", marks=pytest.mark.thorough),
        pytest.param("parked", marks=pytest.mark.thorough),
        "adopted",
    ],
)
def test_a_session_with_two_images_moved_down_or_restarted_goes_on_as_hf_generate(
    next_model, tmp_path, move
):
    engine = persistent_engine(next_model, tmp_path / "tier")
    opening, second, third = pictures(ODD, WIDE, TALL)
    chat = Chat.open(engine, opening)
    chat.ask(QUESTIONS[0])
    chat.ask(QUESTIONS[1], second)
    chat.ask(QUESTIONS[2])
    tier = {"host": Tier.HOST, "features": Tier.FEATURES}.get(move, Tier.PERSISTED)
    if move == "adopted":
        engine.stop()  # the worker dies: the next one has only the directory
        engine = chat.engine = persistent_engine(next_model, tmp_path / "tier")
        assert engine.adopted == 1
    else:
        moved_to(engine, chat.session_id, tier)
    answer = chat.ask(QUESTIONS[3], tier=tier)
    assert answer.images == 2
    if move == "adopted":  # a new worker holds no KV: all of it, both images, prefilled again
        both = sum(image_tokens(next_model.processor, *size) for size in (ODD, WIDE))
        assert (answer.cached_tokens, answer.image_tokens) == (0, both)
    chat.ask(QUESTIONS[4], third, tier=Tier.KV)
    assert chat.ask(QUESTIONS[5], tier=Tier.KV).images == 3
    engine.check_integrity()


# -- make test ---------------------------------------------------------------------------------


# make test-fast covers a turn's image after an opening one (test_next_ten_turns_...[v1.6-mistral],
# test_llava15_ten_turns_...); here the rewind's drop of images, on NeXT's different counts
@pytest.mark.thorough
def test_a_rewind_past_an_images_turn_drops_the_image(next_model):
    engine = new_engine(next_model)
    opening, second, third = pictures(ODD, WIDE, TALL)
    chat = Chat.open(engine, opening)
    chat.ask(QUESTIONS[0])
    chat.ask(QUESTIONS[1], second)
    chat.ask(QUESTIONS[2])
    chat.ask(QUESTIONS[3], third)
    assert chat.ask(QUESTIONS[4]).images == 3
    assert chat.ask(QUESTIONS[5], rewind=1).images == 3  # a text turn went: every image stays
    assert chat.ask(QUESTIONS[6], rewind=2).images == 2  # past the third image's turn
    assert chat.ask(QUESTIONS[7], rewind=3).images == 1  # past the second's: the open's stays
    assert [turn.question for turn in chat.turns] == [QUESTIONS[0], QUESTIONS[7]]
    answer = chat.ask(QUESTIONS[8], third)  # a dropped image may come back on a later turn
    assert answer.images == 2
    assert answer.image_tokens == image_tokens(next_model.processor, *TALL)
    chat.ask(QUESTIONS[9])
    engine.check_integrity()


# make test-fast covers a turn's image after an opening image (test_llava15_ten_turns_...);
# here a session with no image at all until its third turn
@pytest.mark.thorough
def test_a_text_only_session_gets_its_first_image_on_turn_three(llava15):
    engine = new_engine(llava15)
    (image,) = pictures((80, 50))
    chat = Chat.open(engine, None)
    assert [chat.ask(q).images for q in QUESTIONS[:2]] == [0, 0]
    answer = chat.ask(QUESTIONS[2], image)
    assert (answer.images, answer.image_tokens) == (1, 16)
    for question in QUESTIONS[3:6]:
        assert chat.ask(question).images == 1


# make test-fast covers an opening image and a turn's image in different messages
# (test_next_ten_turns_...[v1.6-mistral]); here both in the first user message, the open's first
@pytest.mark.thorough
def test_the_opens_image_and_the_first_turns_image_share_the_first_message(next_model):
    engine = new_engine(next_model)
    opening, first_turns = pictures(TALL, ODD)  # different counts: their order shows in the ids
    chat = Chat.open(engine, opening)
    answer = chat.ask(QUESTIONS[0], first_turns)
    assert answer.images == 2
    assert len(chat.turns) == 1 and messages_of(chat.turns, opening)[0]["content"][:2] == [
        {"type": "image", "image": opening},
        {"type": "image", "image": first_turns},
    ]
    for question in QUESTIONS[1:4]:
        chat.ask(question)


# make test-fast covers one session's images (test_next_ten_turns_...[v1.6-mistral]); here
# another session's identical image, whose features are not computed again
@pytest.mark.thorough
def test_two_sessions_with_the_same_second_image_share_its_features(next_model, monkeypatch):
    engine = new_engine(next_model)
    encoded = []
    encode = engine.encode_image
    monkeypatch.setattr(engine, "encode_image", lambda inputs: encoded.append(1) or encode(inputs))
    first_open, second_open, shared = pictures(ODD, TALL, WIDE)
    first = Chat.open(engine, first_open)
    first.ask(QUESTIONS[0], shared)
    assert len(encoded) == 2  # the vision tower ran for each image: the open's, the turn's
    second = Chat.open(engine, second_open)
    assert len(encoded) == 3
    hits = engine.stats().memory.feature_hits
    second.ask(QUESTIONS[0], pictures(ODD, TALL, WIDE)[2])  # equal pixels, another object
    assert len(encoded) == 3, "the shared image's features were computed again"
    assert engine.stats().memory.feature_hits > hits
    third = Chat.open(engine, shared)  # and a session that opens with it
    assert len(encoded) == 3
    for chat in (first, second, third):
        chat.ask(QUESTIONS[1])
    engine.check_integrity()


# make test-fast covers turns that bring images under the limit (test_llava15_ten_turns_...);
# here one past it
@pytest.mark.thorough
def test_an_image_past_the_limit_is_refused_and_the_session_answers_as_before(llava15):
    engine = new_engine(llava15, max_images_per_session=2)
    opening, second, third = pictures((80, 50), (40, 60), (70, 70))
    chat = Chat.open(engine, opening)
    chat.ask(QUESTIONS[0])
    chat.ask(QUESTIONS[1])
    assert chat.ask(QUESTIONS[2], second).images == 2
    session = engine.store.session(chat.session_id)
    before = (list(session.token_ids), list(session.messages), session.turns)
    with pytest.raises(InvalidRequest) as refused:
        engine.ask(chat.session_id, QUESTIONS[3], {"max_new_tokens": MAX_NEW}, image=third)
    assert refused.value.code == "TOO_MANY_IMAGES"
    session = engine.store.session(chat.session_id)
    assert (list(session.token_ids), list(session.messages), session.turns) == before
    assert chat.ask(QUESTIONS[3]).images == 2  # as if the refused turn was never asked
    # a rewind past the second image's turn frees its place (the first turn it drops is a
    # text turn: see the next test for an image brought where a dropped one was)
    assert chat.ask(QUESTIONS[4], third, rewind=3).images == 2
    chat.ask(QUESTIONS[5])
    engine.check_integrity()


# make test-fast covers a turn's image on a session's kept KV (test_llava15_ten_turns_...); here
# the rewound prompt's ids equal the dropped turn's up to past its image's first tokens (the
# same <image> id), but their KV is the dropped image's: none of it may be reused
@pytest.mark.thorough
@pytest.mark.parametrize("model", ["llava-1.5", "v1.6-mistral"])
def test_a_rewind_that_brings_another_image_where_a_dropped_one_was(request, next_models, model):
    loaded = request.getfixturevalue("llava15") if model == "llava-1.5" else next_models(model)
    sizes = [(80, 50), (40, 60), (70, 70)] if model == "llava-1.5" else [ODD, WIDE, TALL]
    engine = new_engine(loaded)
    opening, second, third = pictures(*sizes)
    chat = Chat.open(engine, opening)
    chat.ask(QUESTIONS[0])
    chat.ask(QUESTIONS[1], second)
    chat.ask(QUESTIONS[2])
    answer = chat.ask(QUESTIONS[3], third, rewind=2)
    assert answer.images == 2
    assert answer.image_tokens == image_tokens(loaded.processor, *third.size)
    chat.ask(QUESTIONS[4])
    engine.check_integrity()
