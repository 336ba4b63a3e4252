"""Fidelity to llava-hf/llava-1.5-7b-hf: its real tokenizer, processor and chat template.

The model is a tiny random ``LlavaForConditionalGeneration`` built from the checkpoint's own
``config.json`` shrunk (few layers, small hidden, 56 px images → 16 image tokens); everything
else is the production checkpoint's files (tests/fixtures/llava-1.5-7b-hf). The oracle is
Hugging Face's own pipeline: ``processor.apply_chat_template(..., tokenize=True)`` on the whole
conversation and ``model.generate`` on it, never the engine's own history.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaConfig, LlavaForConditionalGeneration

from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import InvalidRequest
from llava.kv.budget import MemoryBudget
from llava.model.loading import load_model
from llava.model.prompt import ChatPrompt, assistant_message, system_message, user_message

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "llava-1.5-7b-hf"
IMAGE_PX = 56  # 4 x 4 patches of 14 px
MAX_NEW = 8
QUESTIONS = [
    "What is in the image?",
    "  Describe it, please!  ",
    "How many? 12 or 3.5 — say 7",
    "Café au lait, naïve façade?",
    "这是什么？请用中文回答。",
    "He said \"hi\" and 'bye'. Emoji 😀?",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny-llava-1.5")
    build_tiny_llava15(out)
    return str(out)


def build_tiny_llava15(out: Path, seed: int = 0) -> None:
    """llava-1.5-7b-hf's config shrunk (IMAGE_PX images), random weights, its processor."""
    raw = json.loads((FIXTURE / "config.json").read_text())
    raw["text_config"].update(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4,
    )  # fmt: skip
    raw["vision_config"].update(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_PX, projection_dim=32,
    )  # fmt: skip
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(LlavaConfig(**raw)).save_pretrained(out)
    processor = AutoProcessor.from_pretrained(FIXTURE)
    processor.image_processor.crop_size = {"height": IMAGE_PX, "width": IMAGE_PX}
    processor.image_processor.size = {"shortest_edge": IMAGE_PX}
    processor.save_pretrained(out)


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load_model(tiny_dir, device="cpu", dtype="float32")


@pytest.fixture
def engine(loaded):
    return Engine(loaded, EngineConfig(model_dir="-"), MemoryBudget(1 << 30))


@pytest.fixture(scope="module")
def image():
    return Image.new("RGB", (80, 50), (200, 40, 90))


def conversation(
    turns: list[tuple[str, str]], question: str, image, system: str | None = None
) -> list[dict]:
    """The chat so far as HF's pipeline takes it: the image object inside the first message."""
    messages = [system_message(system)] if system else []
    for asked, answered in [*turns, (question, None)]:
        first = not any(m["role"] == "user" for m in messages)
        message = user_message(asked.strip(), int(image is not None and first))
        if message["content"][0]["type"] == "image":
            message["content"][0]["image"] = image
        messages.append(message)
        if answered is not None:
            messages.append(assistant_message(answered))
    return messages


def hf_inputs(loaded, messages) -> dict:
    return loaded.processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )


def hf_generate(engine: Engine, inputs: dict, max_new: int = MAX_NEW) -> list[int]:
    """HF's own greedy answer, the engine's banned ids suppressed as the engine does."""
    out = engine.loaded.model.generate(
        **inputs, do_sample=False, max_new_tokens=max_new, suppress_tokens=engine.context.banned_ids
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def last_prompt(engine: Engine, session_id: str, answer) -> list[int]:
    """The history holds the last prompt, then the answer's ids without its end token."""
    history = engine.store.session(session_id).token_ids
    kept = len(answer.token_ids) - (1 if answer.finished else 0)
    return history[: len(history) - kept]


# make test-fast keeps the image session; a text-only one's prompts are checked there by
# test_a_system_prompt_is_rendered_as_the_checkpoints_template_renders_it[text-only]
@pytest.mark.parametrize(
    "with_image",
    [True, pytest.param(False, marks=pytest.mark.thorough)],
    ids=["image", "text-only"],
)
def test_every_turn_prompt_is_the_canonical_tokenization(engine, image, with_image):
    img = image if with_image else None
    session_id = engine.open(img).session_id
    turns: list[tuple[str, str]] = []
    for question in QUESTIONS:
        answer = engine.ask(session_id, question, {"max_new_tokens": MAX_NEW})
        inputs = hf_inputs(engine.loaded, conversation(turns, question, img))
        canonical = inputs["input_ids"][0].tolist()
        assert last_prompt(engine, session_id, answer) == canonical, question
        assert answer.cached_tokens + answer.new_tokens == len(canonical)  # usage adds up
        assert list(answer.token_ids) == hf_generate(engine, inputs), question
        turns.append((question, answer.text))
    assert engine.store.session(session_id).turns == len(QUESTIONS)


def test_image_session_prompt_expands_the_image_like_the_processor(engine, image):
    opened = engine.open(image)
    assert opened.image_tokens == (IMAGE_PX // 14) ** 2
    canonical = hf_inputs(engine.loaded, conversation([], QUESTIONS[0], image))["input_ids"][0]
    assert canonical.tolist()[: opened.prefill_tokens] == engine.loaded.prompt.opening_ids(
        True, opened.image_tokens
    )


SPECIAL_QUESTIONS = ["What is <image> here?", "End </s> now", "<pad><pad>", "<s> <unk> hi"]
SYSTEM = "You are a careful assistant. Describe only what the image shows."


@pytest.mark.parametrize("with_image", [True, False], ids=["image", "text-only"])
def test_a_system_prompt_is_rendered_as_the_checkpoints_template_renders_it(
    engine, image, with_image
):
    img = image if with_image else None
    opened = engine.open(img, system=SYSTEM)
    turns: list[tuple[str, str]] = []
    for question in QUESTIONS[:3]:
        answer = engine.ask(opened.session_id, question, {"max_new_tokens": MAX_NEW})
        inputs = hf_inputs(engine.loaded, conversation(turns, question, img, SYSTEM))
        assert last_prompt(engine, opened.session_id, answer) == inputs["input_ids"][0].tolist()
        assert list(answer.token_ids) == hf_generate(engine, inputs), question
        turns.append((question, answer.text))


def test_the_system_prompt_setting_is_every_sessions_default(loaded, image):
    config = EngineConfig(model_dir="-", system_prompt=SYSTEM)
    engine = Engine(loaded, config, MemoryBudget(1 << 30))
    for system, expected in ((None, SYSTEM), ("", None)):
        session_id = engine.open(image, system=system).session_id
        answer = engine.ask(session_id, QUESTIONS[0], {"max_new_tokens": MAX_NEW})
        inputs = hf_inputs(engine.loaded, conversation([], QUESTIONS[0], image, expected))
        assert last_prompt(engine, session_id, answer) == inputs["input_ids"][0].tolist()


def test_a_system_prompt_with_control_token_text_is_plain_text(engine, image):
    opened = engine.open(image, system="Ignore <image> and </s> <s> markers.")
    prompt = engine.store.session(opened.session_id).token_ids
    image_id = engine.loaded.model.config.image_token_id
    specials = set(engine.loaded.tokenizer.all_special_ids)
    assert prompt.count(image_id) == opened.image_tokens  # the image's own, no more
    assert [i for i in prompt if i in specials and i != image_id] == prompt[:1]  # BOS only


@pytest.mark.parametrize("system", [42, ["a"], "x" * 8001], ids=["number", "list", "too-long"])
def test_a_bad_system_prompt_is_refused_before_any_work(engine, image, system):
    with pytest.raises(InvalidRequest, match="system"):
        engine.open(image, system=system)
    assert len(engine.store) == 0


def test_special_token_strings_in_questions_are_plain_text(engine, image):
    session_id = engine.open(image).session_id
    image_id = engine.loaded.model.config.image_token_id
    specials = set(engine.loaded.tokenizer.all_special_ids)
    for question in SPECIAL_QUESTIONS:
        answer = engine.ask(session_id, question, {"max_new_tokens": 4})
        prompt = last_prompt(engine, session_id, answer)
        assert prompt.count(image_id) == (IMAGE_PX // 14) ** 2  # the image's own, no more
        assert [i for i in prompt if i in specials and i != image_id] == prompt[:1]  # BOS only


def collect_into(chunks: list[str]):
    return lambda text, _token_id: chunks.append(text)


@pytest.mark.thorough
def test_fifty_hot_sampled_turns_never_break_the_session(engine, image):
    session_id = engine.open(image).session_id
    banned = set(engine.context.banned_ids)
    params = {"do_sample": True, "temperature": 5.0, "seed": 1234, "max_new_tokens": 6}
    for turn in range(50):
        question = SPECIAL_QUESTIONS[turn % len(SPECIAL_QUESTIONS)] + f" #{turn}"
        chunks: list[str] = []
        answer = engine.ask(session_id, question, params, on_token=collect_into(chunks))
        assert not banned & set(answer.token_ids)
        assert "".join(chunks) == answer.text
    assert engine.store.session(session_id).turns == 50


class Boom(RuntimeError):
    pass


def fail_after(n: int):
    calls = []

    def on_token(_text, _token_id):
        calls.append(_token_id)
        if len(calls) == n:
            raise Boom

    return on_token


@pytest.mark.parametrize("fail_at", [2, MAX_NEW], ids=["mid-turn", "last-token"])
def test_a_failing_callback_leaves_the_session_as_before(engine, image, fail_at):
    session_id = engine.open(image).session_id
    first = engine.ask(session_id, QUESTIONS[0], {"max_new_tokens": MAX_NEW})
    session = engine.store.session(session_id)
    before = (list(session.token_ids), list(session.messages), session.turns)
    with pytest.raises(Boom):
        engine.ask(session_id, QUESTIONS[1], {"max_new_tokens": MAX_NEW}, fail_after(fail_at))
    assert (session.token_ids, session.messages, session.turns) == before
    answer = engine.ask(session_id, QUESTIONS[2], {"max_new_tokens": MAX_NEW})
    turns = [(QUESTIONS[0], first.text)]
    inputs = hf_inputs(engine.loaded, conversation(turns, QUESTIONS[2], image))
    assert list(answer.token_ids) == hf_generate(engine, inputs)


def test_banned_ids_cover_added_specials_and_padding_rows_but_not_eos(loaded):
    tokenizer = loaded.tokenizer
    banned = set(Engine(loaded, EngineConfig("-"), MemoryBudget(1 << 20)).context.banned_ids)
    assert {0, 1, 32000, 32001} <= banned  # <unk>, <s>, <image>, <pad>
    assert set(range(len(tokenizer), 32064)) <= banned  # embedding rows with no token
    assert tokenizer.eos_token_id not in banned and 29871 not in banned


def test_a_template_that_rewrites_earlier_turns_is_refused(loaded):
    class LastMessageOnly:
        tokenizer = loaded.processor.tokenizer
        image_token = loaded.processor.image_token
        chat_template = (
            "{{ 'USER: ' + messages[-1]['content'][-1]['text'] + ' ' }}"
            "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
        )

        def apply_chat_template(self, messages, **kwargs):
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, **kwargs
            )

    with pytest.raises(ValueError, match="rewrites the earlier prompt"):
        ChatPrompt(LastMessageOnly()).check_stateful()
