"""What the engine admits (docs/security.md §Admission limits): one ask in flight per session,
``max_sessions``, ``max_session_tokens``; and the ids an open makes (docs/wire.md §Session ids
are bearer secrets)."""

from __future__ import annotations

import threading

import pytest

from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import (
    EngineError,
    InvalidRequest,
    NoCapacity,
    SessionBusy,
    SessionIdInUse,
    SessionNotFound,
)
from llava.kv.budget import MemoryBudget

LONG_ID = "conversation-1a2b3c4d5e6f7a8b9c0d1e2f"  # 36 of [a-z0-9]: 186 bits, kept as it is


def new_engine(demo_model, **settings) -> Engine:
    config = EngineConfig("-", session_ttl_s=60, **settings)
    return Engine(demo_model, config, MemoryBudget(1 << 30))


def count_steps(engine: Engine) -> list[int]:
    steps: list[int] = []
    step = engine.runner.step
    engine.runner.step = lambda batch, *a, **k: steps.append(len(batch)) or step(batch, *a, **k)
    return steps


def test_a_second_ask_while_one_is_generating_is_refused_at_once(demo_model):
    """With none allowed to wait: from inside the first ask's first token, a second ask that
    waited for it could not return before it ends, so the thread that sends it is given 30 s
    only to tell."""
    engine = new_engine(demo_model, max_waiting_asks=0)
    session_id = engine.open().session_id
    during: list[str] = []

    def second_ask():
        try:
            engine.ask(session_id, "And again?", {"max_new_tokens": 2})
            during.append("answered")
        except EngineError as e:
            during.append(e.code)

    def on_token(text, token_id):
        if token_id is not None and not during:
            asker = threading.Thread(target=second_ask)
            asker.start()
            asker.join(30)
            if asker.is_alive():
                during.append("waited")

    params = {"max_new_tokens": 3, "min_new_tokens": 3}
    answer = engine.ask(session_id, "What is in the picture?", params, on_token)
    assert during == [SessionBusy.code] and len(answer.token_ids) == 3
    assert engine.ask(session_id, "And again?", {"max_new_tokens": 2}).token_ids


def test_an_open_past_max_sessions_evicts_the_lru_idle_text_only_session(demo_model, sample):
    engine = new_engine(demo_model, max_sessions=3)
    text_old = engine.open().session_id
    image = engine.open(sample.image).session_id
    text_new = engine.open().session_id
    engine.ask(text_old, "Hi", {"max_new_tokens": 1})  # now text_new is the least recent
    engine.open()
    with pytest.raises(SessionNotFound) as err:
        engine.ask(text_new, "Hi")
    assert err.value.code == "SESSION_EVICTED"
    assert engine.ask(image, "What shape is it?").text == sample.shape
    assert len(engine.store) == 3 and engine.stats().memory.evicted == 1
    engine.check_integrity()


def test_an_open_past_max_sessions_with_only_image_sessions_is_no_capacity(demo_model, sample):
    engine = new_engine(demo_model, max_sessions=1)
    held = engine.open(sample.image).session_id
    steps = count_steps(engine)
    with pytest.raises(NoCapacity) as err:
        engine.open(sample.image)
    assert err.value.code == "NO_CAPACITY" and steps == []
    assert engine.ask(held, "What shape is it?").text == sample.shape


def test_a_turn_past_max_session_tokens_is_refused_before_any_step(demo_model, sample):
    opening = new_engine(demo_model).open(sample.image).prefill_tokens
    engine = new_engine(demo_model, max_session_tokens=opening + 40)
    session_id = engine.open(sample.image).session_id
    steps = count_steps(engine)
    with pytest.raises(InvalidRequest) as err:
        engine.ask(session_id, "What shape is it?", {"max_new_tokens": 40})
    assert err.value.code == "CONVERSATION_TOO_LONG" and steps == []
    assert f"max_session_tokens, {opening + 40}" in err.value.message
    assert engine.ask(session_id, "What shape is it?", {"max_new_tokens": 8}).text == sample.shape


def test_an_open_whose_prefill_passes_max_session_tokens_is_refused(demo_model, sample):
    opening = new_engine(demo_model).open(sample.image).prefill_tokens
    engine = new_engine(demo_model, max_session_tokens=opening - 1)
    with pytest.raises(InvalidRequest) as err:
        engine.open(sample.image)
    assert err.value.code == "CONVERSATION_TOO_LONG"
    assert len(engine.store) == 0
    engine.check_integrity()  # nothing held for it
    assert engine.open().session_id  # a text-only opening is shorter


def test_a_short_chosen_id_opens_with_a_random_part_so_a_refusal_is_no_oracle(demo_model):
    engine = new_engine(demo_model)
    first, second = (engine.open(None, "x").session_id for _ in range(2))
    assert first != second and first.startswith("x-") and second.startswith("x-")
    with pytest.raises(SessionNotFound):
        engine.ask("x", "Hi")
    assert engine.open(None, LONG_ID).session_id == LONG_ID
    with pytest.raises(SessionIdInUse):  # a 128-bit id only its holder can know
        engine.open(None, LONG_ID)
