"""The engine on the demo model: KV reuse equals full recompute, tiers, lifecycle, errors."""

from __future__ import annotations

import logging
from itertools import islice

import pytest
import torch

import llava.exec.graphs
import llava.exec.runner
from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig, SettingsError
from llava.engine import Engine
from llava.errors import InvalidRequest, SessionNotFound
from llava.exec.attention import PAGED
from llava.exec.runner import RunnerCounters
from llava.kv.budget import MemoryBudget
from llava.sessions.session import Tier
from tests.conftest import recognized
from tests.memory_helpers import FakeClock

# Six+ turns mixing first questions, follow-ups that need the history, and free text.
CONVERSATION = [
    "What shape is it?",
    "And its color?",
    "Say that again.",
    "What color is the shape?",
    "And its shape?",
    "Say that again.",
    "What is in the picture?",
]
MAX_NEW = 6
SMALL_BUDGET = MemoryBudget(64 << 20)  # hundreds of demo sessions


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def engine(demo_model, clock):
    config = EngineConfig(model_dir="unused", session_ttl_s=60)
    return Engine(demo_model, config, MemoryBudget(1 << 30), clock=clock)


def full_recompute(engine: Engine, prompt_ids: list[int], image, max_new: int) -> list[int]:
    """Greedy answer computed from scratch by transformers' own generate: no session state."""
    loaded = engine.loaded
    inputs = {"input_ids": torch.tensor([prompt_ids], device=loaded.device)}
    if image is not None:
        pixels = loaded.processor.image_processor(images=image, return_tensors="pt").pixel_values
        inputs["pixel_values"] = pixels.to(loaded.device, loaded.dtype)
    out = loaded.model.generate(**inputs, do_sample=False, max_new_tokens=max_new)
    return out[0, len(prompt_ids) :].tolist()


def prompt_of_last_turn(engine: Engine, session_id: str, answer) -> list[int]:
    """The history starts with the turn's prompt: the ids reused from the cache + prefilled."""
    history = engine.store.session(session_id).token_ids
    return history[: answer.cached_tokens + answer.new_tokens]


# make test-fast keeps the image session; a text-only one is checked against HF's generate
# there by test_checkpoint_fidelity.py's
# test_a_system_prompt_is_rendered_as_the_checkpoints_template_renders_it[text-only]
@pytest.mark.parametrize(
    "with_image",
    [True, pytest.param(False, marks=pytest.mark.thorough)],
    ids=["image", "text-only"],
)
def test_kv_reuse_equals_full_recompute_over_many_turns(engine, sample, with_image):
    image = sample.image if with_image else None
    session_id = engine.open(image).session_id
    cached_before = []
    for question in CONVERSATION:
        answer = engine.ask(session_id, question, {"max_new_tokens": MAX_NEW})
        cached_before.append(answer.cached_tokens)
        prompt = prompt_of_last_turn(engine, session_id, answer)
        assert list(answer.token_ids) == full_recompute(engine, prompt, image, MAX_NEW), question
        assert answer.tier is Tier.KV
        # only the new turn was prefilled: the cache held everything before it
        assert answer.cached_tokens + answer.new_tokens == len(prompt)
    assert cached_before == sorted(cached_before) and cached_before[0] > 0


@pytest.mark.parametrize(  # make test-fast keeps the default setting, "opening"
    "sharing",
    [
        pytest.param("off", marks=pytest.mark.thorough),
        "opening",
        pytest.param("all", marks=pytest.mark.thorough),
    ],
)
def test_answer_after_demotion_to_features_is_unchanged(demo_model, sample, sharing):
    """Recomputed from its features; with sharing on, on the blocks it (and, as far as the
    setting allows, the hot session) published, which stay reusable after it let go of them."""
    share = sharing != "off"
    config = EngineConfig(model_dir="-", prefix_sharing=sharing, check_memory_when_idle=True)
    engine = Engine(demo_model, config, SMALL_BUDGET)  # the idle checks walk every block
    hot = engine.open(sample.image).session_id
    cold = engine.open(sample.image).session_id
    for question in CONVERSATION[:3]:
        for session_id in (hot, cold):
            engine.ask(session_id, question, {"max_new_tokens": MAX_NEW})
    assert engine.memory.move_down(engine.store.session(cold).holding) is Tier.FEATURES
    hot_answer = engine.ask(hot, "What color is the shape?", {"max_new_tokens": MAX_NEW})
    cold_answer = engine.ask(cold, "What color is the shape?", {"max_new_tokens": MAX_NEW})
    assert cold_answer.tier is Tier.FEATURES and (cold_answer.cached_tokens > 0) == share
    if not share:  # everything computed again
        assert cold_answer.new_tokens > hot_answer.new_tokens
    assert cold_answer.token_ids == hot_answer.token_ids
    assert cold_answer.text == sample.color


def test_budget_pressure_demotes_and_the_next_turn_still_answers(demo_model, sample):
    probe = Engine(demo_model, EngineConfig(model_dir="-"), MemoryBudget(1 << 30))
    first = probe.open(sample.image)
    one_session = probe.stats().total_bytes
    tight = MemoryBudget(int(1.5 * one_session))
    engine = Engine(demo_model, EngineConfig(model_dir="-"), tight)
    a = engine.open(sample.image).session_id
    b = engine.open(held_out_samples(1, seed=30_000)[0].image).session_id
    assert engine.stats().memory.demoted >= 1 and b in engine.store
    # a turn reserves KV for its prompt + max_new_tokens up front: keep it within the budget
    answer = engine.ask(a, "What color is the shape?", {"max_new_tokens": MAX_NEW})
    assert answer.tier is Tier.FEATURES and answer.text == sample.color
    assert engine.stats().total_bytes <= tight.device_bytes
    probe.close(first.session_id)


def test_expiry_and_close_free_every_byte(engine, clock, sample):
    expiring = engine.open(sample.image).session_id
    closing = engine.open(None).session_id
    engine.ask(closing, "What shape is it?")
    assert engine.stats().total_bytes > 0
    engine.close(closing)
    clock.now += 61
    stats = engine.stats()
    assert (stats.sessions, stats.total_bytes) == (0, 0)
    assert (stats.store.closed, stats.store.expired) == (1, 1)
    with pytest.raises(SessionNotFound) as err:
        engine.ask(expiring, "What shape is it?")
    assert err.value.code == "SESSION_EXPIRED"


def test_interleaved_sessions_each_answer_about_their_own_image(engine, demo_model):
    # a, and the first of the next eleven that differs from it in colour and shape, so answers
    # tell them apart (each image tried only when needed)
    candidates = recognized(demo_model, seed=40_000)
    a = next(candidates)
    b = next(c for c in islice(candidates, 11) if c.color != a.color and c.shape != a.shape)
    ids = {engine.open(s.image).session_id: s for s in (a, b)}
    turns = [
        ("What color is the shape?", "color"),
        ("And its shape?", "shape"),
        ("Say that again.", "shape"),
        ("What shape is it?", "shape"),
        ("And its color?", "color"),
    ]
    for question, attribute in turns:
        for session_id, truth in ids.items():
            answer = engine.ask(session_id, question)
            assert answer.text == getattr(truth, attribute), (question, truth)


def test_streamed_text_concatenates_to_the_answer(engine, sample):
    session_id = engine.open(sample.image).session_id
    chunks: list[tuple[str, int | None]] = []
    answer = engine.ask(session_id, "What shape is it?", on_token=lambda *c: chunks.append(c))
    assert [token_id for _, token_id in chunks] == list(answer.token_ids)
    assert "".join(text for text, _ in chunks) == answer.text == sample.shape


def test_seeded_sampling_is_reproducible(engine, sample):
    params = {"do_sample": True, "temperature": 1.5, "top_k": 5, "top_p": 0.9, "seed": 7}
    answers = []
    for _ in range(2):
        session_id = engine.open(sample.image).session_id
        answers.append(engine.ask(session_id, "What is in the picture?", params).token_ids)
    assert answers[0] == answers[1]


def test_a_temperature_alone_samples_and_do_sample_false_stays_greedy(engine, sample):
    """OpenAI-style clients send ``temperature`` alone and expect sampling."""

    def answer(params):
        session_id = engine.open(sample.image).session_id
        return engine.ask(session_id, "What is in the picture?", params | {"seed": 5}).token_ids

    hot = {"temperature": 8.0, "max_new_tokens": 8}
    greedy = answer({"max_new_tokens": 8})
    assert answer(hot) == answer(hot | {"do_sample": True}) != greedy
    assert answer(hot | {"do_sample": False}) == greedy


@pytest.mark.parametrize(
    "question, parameters",
    [
        ("", None),
        ("   ", None),
        (None, None),
        (42, None),
        ("x" * 9000, None),
        ("What shape is it?", {"max_new_tokens": 10**9}),
        ("What shape is it?", {"max_new_tokens": 0}),
        ("What shape is it?", {"max_new_tokens": "5"}),
        ("What shape is it?", {"temperature": -1}),
        ("What shape is it?", {"temperature": float("nan")}),
        ("What shape is it?", {"top_p": 2}),
        ("What shape is it?", {"do_sample": "yes"}),
        ("What shape is it?", {"beams": 4}),
        ("What shape is it?", ["max_new_tokens", 5]),
    ],
)
def test_bad_input_is_a_typed_error_and_the_session_survives(engine, sample, question, parameters):
    session_id = engine.open(sample.image).session_id
    with pytest.raises(InvalidRequest):
        engine.ask(session_id, question, parameters)
    assert engine.ask(session_id, "What shape is it?").text == sample.shape


def test_a_conversation_past_the_context_window_is_refused(engine, sample):
    session_id = engine.open(sample.image).session_id
    limit = engine.loaded.max_positions
    with pytest.raises(InvalidRequest) as err:
        engine.ask(session_id, "What shape is it?", {"max_new_tokens": limit})
    assert err.value.code == "CONVERSATION_TOO_LONG"


def test_unknown_session_is_not_found(engine):
    with pytest.raises(SessionNotFound) as err:
        engine.ask("0123-abcd", "What shape is it?")
    assert err.value.code == "SESSION_NOT_FOUND"


def test_warm_up_touches_no_session_or_counter(engine):
    before = engine.stats()
    assert engine.warm_up() > 0
    assert engine.stats() == before


def test_each_turn_announces_an_expiry_one_ttl_after_it(engine, clock, sample):
    from datetime import UTC, datetime, timedelta

    session_id = engine.open(sample.image).session_id
    clock.now += 45  # idle for most of the 60 s TTL, then a turn
    answer = engine.ask(session_id, "What shape is it?")
    expected = datetime.now(UTC) + timedelta(seconds=60)
    assert abs((answer.expires_at - expected).total_seconds()) <= 2


# -- the attention and cuda_graphs settings, and degrading instead of dying -----------------


def answers_of(engine: Engine, image, questions=CONVERSATION[:3]) -> list[tuple[int, ...]]:
    """The greedy ids of a few turns of one session about ``image``."""
    session_id = engine.open(image).session_id
    return [engine.ask(session_id, q, {"max_new_tokens": MAX_NEW}).token_ids for q in questions]


@pytest.fixture(scope="module")
def image():
    return held_out_samples(1, seed=35_000)[0].image


@pytest.fixture(scope="module")
def engine_for(demo_model):
    """The module's engine for these settings, built once per distinct config: the default
    one answers for default_answers, then again, warmed up, as "auto"."""
    built: list[tuple[EngineConfig, Engine]] = []

    def engine_for(**settings) -> Engine:
        config = EngineConfig(model_dir="-", **settings)
        for known, engine in built:
            if known == config:
                return engine
        built.append((config, Engine(demo_model, config, SMALL_BUDGET)))
        return built[-1][1]

    return engine_for


@pytest.fixture(scope="module")
def default_answers(engine_for, image):
    return answers_of(engine_for(), image)


@pytest.mark.parametrize(
    ("settings", "paged_on_cuda"),
    [({"attention": "sdpa"}, False), ({"cuda_graphs": False}, True), ({}, True)],
    ids=["sdpa", "no-graphs", "auto"],
)
def test_attention_and_graph_settings_answer_as_the_default(
    demo_model, image, engine_for, default_answers, settings, paged_on_cuda
):
    engine = engine_for(**settings)
    engine.warm_up()
    if demo_model.device.type == "cpu" or not paged_on_cuda:  # auto is sdpa on CPU
        assert engine.runner.attention == "sdpa" and engine.runner.graphs is None
    else:  # on CUDA auto keeps the faster paged path, and captures graphs if asked
        assert engine.runner.attention in PAGED
        assert (engine.runner.graphs is None) == (settings.get("cuda_graphs") is False)
    assert answers_of(engine, image) == default_answers


# Seconds on a CPU: flex compiles for a whole engine; triton runs every decode step through
# Triton's interpreter (~20 s).
@pytest.mark.thorough
@pytest.mark.parametrize("attention", ["flex", "triton"])
def test_a_forced_paged_path_answers_as_the_default(demo_model, image, default_answers, attention):
    engine = Engine(demo_model, EngineConfig(model_dir="-", attention=attention), SMALL_BUDGET)
    engine.warm_up()
    assert engine.runner.attention == attention
    assert answers_of(engine, image) == default_answers
    assert engine.stats().runner == RunnerCounters()


def broken_flex(calls: list):
    """A stand-in for llava.exec.attention.attend_paged whose compile fails, every time."""

    def attend_paged(*args):
        calls.append(len(args))
        raise RuntimeError("flex_attention failed to compile\n<the compiler's long log>")

    return attend_paged


@pytest.mark.parametrize("warm", [True, False], ids=["at-warm-up", "at-a-turn"])
def test_a_failing_flex_under_auto_falls_back_to_sdpa_once(
    demo_model, image, default_answers, monkeypatch, caplog, warm
):
    calls: list = []
    monkeypatch.setattr(llava.exec.runner, "attend_paged", broken_flex(calls))
    monkeypatch.setattr(llava.exec.graphs, "capturable", lambda device: True)  # as on CUDA
    engine = Engine(demo_model, EngineConfig(model_dir="-"), SMALL_BUDGET)
    engine.runner.attention = "flex"  # what auto resolves to on CUDA
    with caplog.at_level(logging.WARNING, logger="llava.exec.runner"):
        if warm:
            engine.warm_up()
            assert engine.runner.attention == "sdpa"
        answers = answers_of(engine, image)
    assert answers == default_answers  # the step that failed ran again, on sdpa
    assert engine.runner.attention == "sdpa" and len(calls) == 1
    assert engine.runner.graphs is None  # a graph would replay the flex call
    assert engine.stats().runner == RunnerCounters(attention_fallbacks=1)
    warnings = [r.getMessage() for r in caplog.records if r.name == "llava.exec.runner"]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "sdpa" in warnings[0] and "RuntimeError: flex_attention failed to compile" in warnings[0]
    engine.check_integrity()


def test_a_failing_forced_flex_fails_the_warm_up_in_one_line(demo_model, monkeypatch):
    calls: list = []
    monkeypatch.setattr(llava.exec.runner, "attend_paged", broken_flex(calls))
    engine = Engine(demo_model, EngineConfig(model_dir="-", attention="flex"), SMALL_BUDGET)
    with pytest.raises(SettingsError) as failure:
        engine.warm_up()
    message = str(failure.value.from_source("LLAVA_ATTENTION"))  # as the handler names it
    assert message.startswith(
        "bad setting LLAVA_ATTENTION: flex on cpu: paged flex attention failed: "
        "RuntimeError: flex_attention failed to compile"
    )
    assert "\n" not in message and len(calls) == 1
    assert engine.runner.attention == "flex" and engine.stats().runner == RunnerCounters()
    assert engine.stats().total_bytes == 0  # the warm-up's holding went back
    engine.stop()
