"""Fidelity across the LLaVA family: LLaVA-NeXT's anyres images on Mistral, Vicuna and Yi shapes.

Each family is a tiny random ``LlavaNextForConditionalGeneration`` built from
llava-v1.6-mistral-7b-hf's own ``config.json`` (tests/fixtures) with the family's text model
(reduced sizes, the family's KV-head grouping and rope) and the family's chat template; the
tiling rules are the checkpoint's, at a 42-px tile (its 336 px / 8: the pinpoints shrink alike).
The Mistral family has the checkpoint's own tokenizer, built from Mistral's SentencePiece model in
the fixture (tests/mistral_tokenizer.py: legacy handling, so ``<image>\n`` is followed by ``▁``,
and ``</s> [INST]`` by ``▁``, ``▁[``). Vicuna and Yi have llava-1.5's LLaMA tokenizer (Vicuna's
vocabulary; a stand-in for Yi's, whose files are not reachable here): Yi's ids of text differ
from that checkpoint's, its template and every image rule do not.

The oracle is Hugging Face's own pipeline on the whole conversation each turn:
``processor.apply_chat_template(..., tokenize=True)`` (which expands ``<image>`` as the
checkpoint's processor counts it) and ``model.generate``. Greedy answers must equal it token for
token over 10 turns, for images of six aspect ratios that pick different pinpoints.
"""

from __future__ import annotations

import base64

import pytest

from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.budget import MemoryBudget
from llava.kv.holding import Tier
from llava.model.loading import load_model
from llava.model.vision import image_tokens, most_image_tokens
from scripts.handler_harness import InProcessWorker
from tests.families import FAMILIES, build_family, picture
from tests.intake_servers import image_bytes
from tests.unit.test_checkpoint_fidelity import conversation, hf_generate, hf_inputs, last_prompt

MAX_NEW = 6
QUESTIONS = [
    "What is in the image?",
    "Where is the red part?",
    "  Describe the left side.  ",
    "How many shapes? 2 or 3",
    "Café au lait, naïve?",
    "这是什么？",
    'He said "hi" and left.',
    "What is at the top?",
    "And the bottom?",
    "Say it again, shorter.",
]
# (width, height): square, 2:1, 1:2, 3:1, 1:3, and an odd one between pinpoints
IMAGE_SIZES = [(100, 100), (160, 80), (80, 160), (150, 50), (50, 150), (97, 61)]


# make test-fast keeps one family, Mistral (the checkpoint's own text model, GQA); make test runs
# all three: Vicuna's one KV head per query head and Yi's ChatML join it.
@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=() if name == "v1.6-mistral" else pytest.mark.thorough)
        for name in FAMILIES
    ],
)
def loaded(request, tmp_path_factory):
    family = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    build_family(out, family)
    loaded = load_model(str(out), device="cpu", dtype="float32")
    # the engine reads back the family's own tokenizer (Mistral's ids of text are not LLaMA's)
    probe = "[INST] <image>\nHello,  world! [/INST] Hi.</s> [INST]"
    assert loaded.tokenizer(probe).input_ids == family.tokenizer()(probe).input_ids
    return loaded


def new_engine(loaded) -> Engine:
    return Engine(loaded, EngineConfig(model_dir="-"), MemoryBudget(1 << 28, host_bytes=1 << 26))


# make test-fast keeps the odd, non-square size (of its one family); make test runs all six
@pytest.mark.parametrize(
    "size",
    [
        pytest.param(size, marks=() if size == (97, 61) else pytest.mark.thorough)
        for size in IMAGE_SIZES
    ],
    ids=[f"{w}x{h}" for w, h in IMAGE_SIZES],
)
def test_ten_turns_equal_hf_generate_token_for_token(loaded, size):
    engine = new_engine(loaded)
    image = picture(*size)
    opened = engine.open(image)
    counted = image_tokens(loaded.processor, *size)
    assert opened.image_tokens == counted  # the features' rows are the processor's count
    held = engine.store.session(opened.session_id).holding
    assert held.image_tokens == counted  # and the memory manager accounts for that many
    turns: list[tuple[str, str]] = []
    before: list[int] = []  # the previous turn's prompt
    for question in QUESTIONS:
        answer = engine.ask(opened.session_id, question, {"max_new_tokens": MAX_NEW})
        inputs = hf_inputs(loaded, conversation(turns, question, image))
        canonical = inputs["input_ids"][0].tolist()
        assert canonical.count(loaded.model.config.image_token_id) == counted
        assert last_prompt(engine, opened.session_id, answer) == canonical, question
        assert list(answer.token_ids) == hf_generate(engine, inputs, MAX_NEW), question
        # the KV of the previous prompt was reused, but for the pool block where the history
        # and the new prompt part (a random model's answer may start without a space, which
        # the template's " " + answer then tokenizes otherwise)
        assert answer.cached_tokens > len(before) - engine.memory.pool.block_tokens, question
        turns.append((question, answer.text))
        before = canonical


def test_the_six_images_pick_different_pinpoints(loaded):
    counts = [image_tokens(loaded.processor, *size) for size in IMAGE_SIZES]
    assert len(set(counts)) >= 5, counts
    assert max(counts) <= most_image_tokens(loaded.processor)


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.FEATURES], ids=["host", "features"])
def test_a_session_moved_down_a_tier_goes_on_as_hf_generate(loaded, tier):
    """The tiers keep the real per-session count: restored KV, or features re-prefilled."""
    engine = new_engine(loaded)
    image = picture(*IMAGE_SIZES[3])
    session_id = engine.open(image).session_id
    turns: list[tuple[str, str]] = []
    for n, question in enumerate(QUESTIONS[:4]):
        if n == 2:
            holding = engine.store.session(session_id).holding
            while holding.tier is not tier:
                engine.memory.move_down(holding)
        answer = engine.ask(session_id, question, {"max_new_tokens": MAX_NEW})
        inputs = hf_inputs(loaded, conversation(turns, question, image))
        assert list(answer.token_ids) == hf_generate(engine, inputs, MAX_NEW), question
        assert answer.tier is (tier if n == 2 else Tier.KV)
        turns.append((question, answer.text))


def test_two_sessions_on_one_image_share_its_features(loaded):
    engine = Engine(
        loaded, EngineConfig(model_dir="-", prefix_sharing="opening"), MemoryBudget(1 << 28)
    )
    image = picture(*IMAGE_SIZES[1])
    first = engine.open(image)
    second = engine.open(image)
    assert second.cached_tokens >= first.image_tokens  # the image's tokens were not redone
    a = engine.ask(first.session_id, QUESTIONS[0], {"max_new_tokens": MAX_NEW})
    b = engine.ask(second.session_id, QUESTIONS[0], {"max_new_tokens": MAX_NEW})
    assert a.token_ids == b.token_ids


def test_the_handler_serves_a_session_over_the_wire(loaded):
    """Through the handler (in process): the image as PNG bytes, intake's decode, the reply's
    imageTokens, and the answer HF generate gives."""
    engine = new_engine(loaded)
    worker = InProcessWorker(engine)
    try:
        image = picture(*IMAGE_SIZES[2])
        png = base64.b64encode(image_bytes(image)).decode()
        opened = worker.invoke({"requestType": "NEW_SESSION", "image": {"b64": png}})
        assert opened.status == 200, opened.text
        assert opened.json()["imageTokens"] == image_tokens(loaded.processor, *IMAGE_SIZES[2])
        session = {"X-Amzn-SageMaker-Session-Id": opened.json()["sessionId"]}
        body = {"requestType": "SESSION", "inputs": QUESTIONS[0]}
        reply = worker.invoke({**body, "parameters": {"max_new_tokens": MAX_NEW}}, session)
        assert reply.status == 200, reply.text
        inputs = hf_inputs(loaded, conversation([], QUESTIONS[0], image))
        expected = hf_generate(engine, inputs, MAX_NEW)
        text = loaded.tokenizer.decode(expected, skip_special_tokens=True)
        assert reply.json()["generation"]["text"] == text
    finally:
        worker.stop()
