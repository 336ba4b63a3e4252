"""Rewinding turns: an answer after ``rewind_turns=N`` is the one a session that never had its
last N turns gives, token for token, wherever the session's memory was."""

from __future__ import annotations

import pytest

from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import InvalidRequest
from llava.kv.budget import MemoryBudget
from llava.sessions.session import Tier

GREEDY = {"max_new_tokens": 6}
# A sampled answer off the rails: what a user regenerates (it spoils the turns after it).
SPOILED = {"max_new_tokens": 6, "temperature": 5.0, "seed": 3}
ASKED = ["What shape is it?", "And its color?", "Say that again."]
INSTEAD = "What color is the shape?"
FOLLOW_UP = "And its shape?"


def new_engine(demo_model, tmp_path, name: str, share: bool = False) -> Engine:
    """``share``: every block is shared ("all"), so another session's turns can be the very
    blocks a rewind crops into; else nothing is."""
    config = EngineConfig(
        model_dir="-",
        prefix_sharing="all" if share else "off",
        persist_dir=str(tmp_path / name),
        session_ttl_s=600,
    )
    return Engine(demo_model, config, MemoryBudget(1 << 30, host_bytes=1 << 28))


def moved_to(engine: Engine, session_id: str, tier: Tier) -> None:
    holding = engine.store.session(session_id).holding
    if tier is Tier.FEATURES:  # past the host tier, which has room
        engine.memory.move_down(holding)
    while holding.tier is not tier:
        engine.memory.move_down(holding)


def ask_all(engine: Engine, session_id: str, questions: list[str]) -> None:
    for question in questions:
        engine.ask(session_id, question, GREEDY)


# make test-fast keeps three that rewind one, two and every turn, from the device, the features
# and the disk, shared and not; make test runs all six
@pytest.mark.parametrize(
    ("rewind", "tier", "share"),
    [
        (1, Tier.KV, False),
        pytest.param(1, Tier.KV, True, marks=pytest.mark.thorough),
        pytest.param(2, Tier.HOST, False, marks=pytest.mark.thorough),
        (2, Tier.FEATURES, True),
        # every turn: the image goes with the new first question
        pytest.param(3, Tier.KV, True, marks=pytest.mark.thorough),
        (3, Tier.PERSISTED, False),
    ],
    ids=str,
)
def test_a_rewound_session_answers_as_one_that_never_had_the_turns(
    demo_model, sample, tmp_path, rewind, tier, share
):
    engine = new_engine(demo_model, tmp_path, "rewound", share)
    if share:  # another session holds the same image and opening: the crop meets shared blocks
        ask_all(engine, engine.open(sample.image).session_id, ASKED)
    session_id = engine.open(sample.image).session_id
    ask_all(engine, session_id, ASKED[:-1])
    engine.ask(session_id, ASKED[-1], SPOILED)
    moved_to(engine, session_id, tier)

    control = new_engine(demo_model, tmp_path, "control")
    never = control.open(sample.image).session_id
    ask_all(control, never, ASKED[: len(ASKED) - rewind])

    streamed = []
    answer = engine.ask(
        session_id, INSTEAD, GREEDY, lambda text, _: streamed.append(text), rewind_turns=rewind
    )
    expected = control.ask(never, INSTEAD, GREEDY)
    assert answer.tier is tier
    assert answer.token_ids == expected.token_ids and "".join(streamed) == answer.text
    assert answer.turns == expected.turns == len(ASKED) - rewind + 1
    rewound, clean = engine.store.session(session_id), control.store.session(never)
    assert (rewound.token_ids, rewound.messages) == (clean.token_ids, clean.messages)
    follow_up = engine.ask(session_id, FOLLOW_UP, GREEDY)
    assert follow_up.token_ids == control.ask(never, FOLLOW_UP, GREEDY).token_ids
    if tier is Tier.KV:  # the KV kept the prefix the new prompt shares: only the rest is new
        assert 0 < answer.cached_tokens < len(clean.token_ids)
    engine.check_integrity()


def test_a_rewind_is_persisted_and_a_restarted_engine_goes_on_from_it(demo_model, sample, tmp_path):
    engine = new_engine(demo_model, tmp_path, "tier")
    session_id = engine.open(sample.image).session_id
    ask_all(engine, session_id, ASKED)
    engine.ask(session_id, INSTEAD, GREEDY, rewind_turns=2)
    kept = engine.store.session(session_id).messages
    engine.stop()

    restarted = new_engine(demo_model, tmp_path, "tier")
    adopted = restarted.store.session(session_id)
    assert (adopted.messages, adopted.turns) == (kept, 2)
    answer = restarted.ask(session_id, FOLLOW_UP, GREEDY)
    assert answer.turns == 3 and answer.tier is Tier.PERSISTED


@pytest.mark.parametrize("rewind", [2, 5])
def test_rewinding_past_the_first_turn_is_refused_and_the_session_is_untouched(
    demo_model, sample, tmp_path, rewind
):
    engine = new_engine(demo_model, tmp_path, "tier")
    session_id = engine.open(sample.image).session_id
    ask_all(engine, session_id, ASKED[:1])
    before = list(engine.store.session(session_id).token_ids)
    with pytest.raises(InvalidRequest) as err:
        engine.ask(session_id, INSTEAD, GREEDY, rewind_turns=rewind)
    assert err.value.code == "REWIND_PAST_START"
    assert f"'rewind_turns' is {rewind} but the session holds 1 turns" in err.value.message
    assert engine.store.session(session_id).token_ids == before
    assert engine.ask(session_id, INSTEAD, GREEDY, rewind_turns=1).turns == 1
    engine.check_integrity()


@pytest.mark.parametrize("value", [-1, 1.0, "1", True, None])
def test_a_rewind_that_is_no_count_is_refused_before_the_session_is_touched(
    demo_model, sample, tmp_path, value
):
    engine = new_engine(demo_model, tmp_path, "tier")
    session_id = engine.open(sample.image).session_id
    with pytest.raises(InvalidRequest, match="'rewind_turns' must be an integer >= 0"):
        engine.ask(session_id, INSTEAD, GREEDY, rewind_turns=value)
    assert engine.store.session(session_id).turns == 0
