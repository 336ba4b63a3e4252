"""No session lost before its TTL: with the persistent tier on, sessions the device cannot
hold are parked (their features and history on disk only) and come back exactly on their
next turn, also after a worker restart; only sessions no tier keeps are evicted, each logged
with why (docs/engine/memory.md §Memory policy)."""

from __future__ import annotations

import logging

import pytest

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import SessionNotFound, log_id
from llava.kv.budget import MemoryBudget
from llava.kv.holding import Tier

SESSIONS = 20
SHORT = {"max_new_tokens": 4}
QUESTIONS = ["What color is the shape?", "And its shape?", "Say that again."]


class Control:
    """The sessions on a device that holds them all: their answers there, worked out for as many
    sessions as the tests have asked for so far, and one session's bytes and a block (every
    session holds as many: the same opening, four-token answers)."""

    def __init__(self, demo_model):
        self.engine = Engine(demo_model, EngineConfig("-"), MemoryBudget(1 << 30))
        self.images = [s.image for s in held_out_samples(SESSIONS, seed=20_400)]
        self.answers: list[list[tuple[int, ...]]] = []
        self.one_session = 0
        self.expected(1)

    def expected(self, sessions: int) -> list[list[tuple[int, ...]]]:
        """The first ``sessions`` sessions' answers to QUESTIONS."""
        engine = self.engine
        for image in self.images[len(self.answers) : sessions]:
            session_id = engine.open(image).session_id
            self.answers.append([engine.ask(session_id, q, SHORT).token_ids for q in QUESTIONS])
            held = engine.memory.held_bytes(engine.store.session(session_id).holding)
            held += engine.memory.pool.bytes_per_block
            assert self.one_session in (0, held), "sessions that hold different bytes"
            self.one_session = held
        return self.answers[:sessions]


@pytest.fixture(scope="module")
def control(demo_model):
    control = Control(demo_model)
    yield control
    control.engine.stop()


def engine_for_one_session(demo_model, control, directory=None, host_sessions=0, **settings):
    one_session = control.one_session
    persist_dir = None if directory is None else str(directory)
    config = EngineConfig("-", persist_dir=persist_dir, **settings)
    return Engine(demo_model, config, MemoryBudget(one_session, host_sessions * one_session))


def round_robin(engine: Engine, ids: list[str], questions: list[str]) -> list[list]:
    """Each question asked of every session in turn: each turn finds its session moved down.
    An answer's token ids, or the error code of a session that was lost."""
    answers = [[] for _ in ids]
    for question in questions:
        for answered, session_id in zip(answers, ids, strict=True):
            try:
                answered.append(engine.ask(session_id, question, SHORT))
            except SessionNotFound as gone:
                answered.append(gone.code)
    return answers


# Twenty sessions round-robin through parking, a restart, and back (seconds): make test-fast
# keeps test_a_full_directory_stops_parking_and_never_fails_a_turn (sessions parked and back,
# every turn) and test_persist.py's
# test_a_restarted_worker_adopts_more_sessions_than_its_device_holds_and_loses_none.
@pytest.mark.thorough
@pytest.mark.parametrize("host_sessions", [0, 3], ids=["no-host-tier", "host-tier"])
def test_twenty_sessions_on_a_one_session_device_all_answer_and_none_is_evicted(
    demo_model, control, tmp_path, host_sessions
):
    images, expected = control.images, control.expected(SESSIONS)
    engine = engine_for_one_session(demo_model, control, tmp_path, host_sessions)
    ids = [engine.open(image).session_id for image in images]
    answers = round_robin(engine, ids, QUESTIONS[:2])
    counters = engine.stats().memory
    assert counters.evicted == 0 and counters.parked >= SESSIONS - 1
    assert Tier.PERSISTED in {answer.tier for answered in answers for answer in answered}
    engine.check_integrity()
    engine.stop()  # the worker dies with sessions parked: the next one continues them all
    restarted = engine_for_one_session(demo_model, control, tmp_path, host_sessions)
    assert restarted.adopted == SESSIONS
    answers = [
        a + b for a, b in zip(answers, round_robin(restarted, ids, QUESTIONS[2:]), strict=True)
    ]
    assert all(answered[-1].tier is Tier.PERSISTED for answered in answers)
    assert [[answer.token_ids for answer in answered] for answered in answers] == expected
    assert restarted.stats().memory.evicted == 0
    restarted.check_integrity()


def test_without_the_persistent_tier_the_same_sessions_are_evicted_and_told_so(
    demo_model, control, caplog
):
    """What parking saves: with no tier to keep them, sessions go whole, each logged."""
    images = control.images
    engine = engine_for_one_session(demo_model, control)
    ids = [engine.open(image).session_id for image in images[:4]]
    with caplog.at_level(logging.WARNING, "llava.kv.memory"):
        answers = round_robin(engine, ids, QUESTIONS[:2])
    lost = [i for i, answered in zip(ids, answers, strict=True) if "SESSION_EVICTED" in answered]
    assert lost and engine.stats().memory.evicted >= len(lost)
    assert engine.stats().memory.parked == 0
    assert all(f"session {log_id(i)} evicted to free device memory" in caplog.text for i in lost)
    assert not any(i in caplog.text for i in ids)  # a log names a session by its hash only


def test_a_parked_session_whose_entry_is_unreadable_is_evicted_alone(
    demo_model, control, tmp_path, caplog
):
    images, expected = control.images, control.expected(2)
    # nothing shared: a parked session's features stay reusable in the pool until their room
    # is needed, under their image's key, and would come back from there
    engine = engine_for_one_session(demo_model, control, tmp_path, prefix_sharing="off")
    damaged, kept = (engine.open(image).session_id for image in images[:2])
    holding = engine.store.session(damaged).holding
    while holding.tier is not Tier.PERSISTED:
        engine.memory.move_down(holding)
    features = tmp_path / f"{damaged}.features"
    features.write_bytes(features.read_bytes()[:-1] + b"\x00")
    with (
        caplog.at_level(logging.WARNING, "llava.sessions.store"),
        pytest.raises(SessionNotFound) as gone,
    ):
        engine.ask(damaged, QUESTIONS[0], SHORT)
    assert gone.value.code == "SESSION_EVICTED"
    assert (
        f"session {log_id(damaged)} evicted: its persisted features are unreadable" in caplog.text
    )
    assert engine.close(damaged) == "SESSION_EVICTED"
    assert engine.ask(kept, QUESTIONS[0], SHORT).token_ids == expected[1][0]
    engine.check_integrity()


def test_a_full_directory_stops_parking_and_never_fails_a_turn(
    demo_model, control, tmp_path, caplog
):
    """Entries past the cap are not kept (logged): those sessions are evicted when their
    room is needed, as with no tier; every open and turn of the others answers."""
    images, expected = control.images, control.expected(2)
    probe = engine_for_one_session(demo_model, control, tmp_path / "probe")
    probe.open(images[0])
    entry = probe.persistent.journal.total_bytes
    probe.stop()
    engine = engine_for_one_session(
        demo_model, control, tmp_path / "full", persist_max_bytes=2 * entry + entry // 2
    )
    with caplog.at_level(logging.WARNING):
        ids = [engine.open(image).session_id for image in images[:4]]
    assert "the directory is full" in caplog.text
    kept = [engine.store.session(i).holding.persisted for i in ids]
    assert kept == [True, True, False, False]
    answers = round_robin(engine, ids, QUESTIONS[:2])
    for index in (0, 1):  # parked and back, every turn
        assert [a.token_ids for a in answers[index]] == expected[index][:2]
    lost = sum("SESSION_EVICTED" in answered for answered in answers[2:])
    assert lost >= 1 and engine.stats().memory.evicted >= lost
    engine.check_integrity()
