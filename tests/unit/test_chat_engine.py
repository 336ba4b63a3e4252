"""Conversations given whole (``Engine.chat``), as chat-completions clients resend them: the
same answers, token for token, as the same conversation asked turn by turn on a session,
with a session, without one, and after an edit; what each reuses; what is refused.

The control is the engine's own turn-by-turn protocol (``open`` then ``ask``), whose greedy
answers equal a full recompute (tests/unit/test_multi_image_fidelity.py)."""

from __future__ import annotations

import pytest

from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import InvalidRequest, SessionChanged
from llava.kv.budget import MemoryBudget
from llava.sched.conversation import ChatImage, ChatTurn, Conversation
from tests.conftest import recognized_samples

GREEDY = {"max_new_tokens": 6}
QUESTIONS = ("What is this?", "What color is it?", "And this one?", "Which is larger?")


@pytest.fixture(scope="module")
def images(demo_model):
    return [sample.image for sample in recognized_samples(demo_model, 2)]


def new_engine(demo_model, **settings) -> Engine:
    config = EngineConfig(model_dir="-", session_ttl_s=600, **settings)
    return Engine(demo_model, config, MemoryBudget(1 << 30, host_bytes=1 << 28))


@pytest.fixture(scope="module")
def engine(demo_model):
    return new_engine(demo_model)


def shown(turn: int, images) -> tuple[ChatImage, ...]:
    """The images turn ``turn`` shows: the first image on the first, the second on the third."""
    return {0: (ChatImage("first", images[0]),), 2: (ChatImage("second", images[1]),)}.get(turn, ())


def conversation(images, answers: list[str], questions=QUESTIONS) -> Conversation:
    """The conversation a client resends after ``answers``, ending with the next question."""
    turns = [
        ChatTurn(q, shown(i, images), a)
        for i, (q, a) in enumerate(zip(questions, answers, strict=False))
    ]
    next_turn = len(answers)
    turns.append(ChatTurn(questions[next_turn], shown(next_turn, images)))
    return Conversation(tuple(turns))


@pytest.fixture(scope="module")
def control(engine, images):
    """The conversation asked turn by turn: each answer, in order."""
    session = engine.open(images[0]).session_id
    answers = []
    for i, question in enumerate(QUESTIONS):
        image = images[1] if i == 2 else None
        answers.append(engine.ask(session, question, GREEDY, image=image))
    engine.close(session)
    return answers


def test_stateless_answers_equal_the_turn_by_turn_ones(engine, images, control):
    sessions, opened = engine.stats().sessions, engine.stats().store.opened
    texts = []
    for expected in control:
        answer = engine.chat(conversation(images, texts), parameters=GREEDY)
        assert answer.token_ids == expected.token_ids
        texts.append(answer.text)
    assert engine.stats().sessions == sessions  # each stateless answer's session went
    assert engine.stats().store.opened == opened  # and no session was opened, to the metrics
    engine.check_integrity()


def test_a_session_prefills_only_the_new_message_and_answers_alike(engine, images, control):
    texts: list[str] = []
    first = engine.chat(conversation(images, texts), parameters=GREEDY, new_session=True)
    assert first.token_ids == control[0].token_ids
    session, texts = first.session_id, [first.text]
    for turn, expected in enumerate(control[1:], start=1):
        resent = conversation(images, texts)
        # the session holds the images shown so far: only a new one is fetched
        assert engine.images_to_fetch(resent, session) == ([1] if turn == 2 else [])
        if turn != 2:  # the client's images need not even be loaded
            resent = unloaded_images(resent)
        answer = engine.chat(resent, session, GREEDY)
        assert answer.token_ids == expected.token_ids
        assert answer.new_tokens == expected.new_tokens  # only the new message
        assert answer.cached_tokens == expected.cached_tokens
        texts.append(answer.text)
    assert answer.turns == len(QUESTIONS)
    engine.close(session)
    engine.check_integrity()


def unloaded_images(resent: Conversation) -> Conversation:
    """The conversation with its images named, not loaded (as the session holds them)."""
    turns = (
        ChatTurn(t.question, tuple(ChatImage(i.ref) for i in t.images), t.answer)
        for t in resent.turns
    )
    return Conversation(tuple(turns))


def test_an_edited_earlier_message_rewinds_the_session(engine, images, control):
    texts = [answer.text for answer in control[:3]]
    session = engine.chat(conversation(images, []), parameters=GREEDY, new_session=True)
    for turn in (1, 2):
        engine.chat(conversation(images, texts[:turn]), session.session_id, GREEDY)
    edited = ("What is this?", "What shape is it?", "And this one?", "Which is larger?")
    fresh = engine.chat(conversation(images, texts[:1], edited), parameters=GREEDY)
    rewound = engine.chat(conversation(images, texts[:1], edited), session.session_id, GREEDY)
    assert rewound.token_ids == fresh.token_ids
    assert rewound.turns == 2
    assert 0 < rewound.cached_tokens < fresh.new_tokens + fresh.cached_tokens
    assert engine.stats().sessions >= 1
    assert len(engine.store.session(session.session_id).holding.images) == 1  # the second went
    engine.close(session.session_id)
    engine.check_integrity()


def test_stateless_reuse_stays_within_the_sharing_scope(demo_model, images, control):
    texts = [answer.text for answer in control[:2]]
    for sharing, reuses_text in (("opening", False), ("all", True)):
        engine = new_engine(demo_model, prefix_sharing=sharing)
        before = engine.chat(conversation(images, texts[:1]), parameters=GREEDY)
        again = engine.chat(conversation(images, texts), parameters=GREEDY)
        assert again.token_ids == control[2].token_ids
        opening = len(engine.loaded.prompt.opening_ids(True, before.image_tokens))
        block = engine.memory.pool.block_tokens
        assert again.cached_tokens >= opening // block * block  # the image's opening, at least
        prompt = before.new_tokens + before.cached_tokens  # what the last call resends
        assert (again.cached_tokens >= prompt // block * block) is reuses_text, sharing
        other = engine.chat(conversation(images, texts), parameters=GREEDY, tenant="other")
        assert other.cached_tokens == 0 and other.token_ids == again.token_ids
        engine.stop()


def test_a_session_keeps_its_system_prompt(engine, images):
    opened = engine.chat(conversation(images, []), parameters=GREEDY, new_session=True)
    changed = Conversation(conversation(images, [opened.text]).turns, system="Be brief.")
    with pytest.raises(InvalidRequest) as refused:
        engine.chat(changed, opened.session_id, GREEDY)
    assert refused.value.code == "SYSTEM_CHANGED"
    engine.close(opened.session_id)


def test_a_session_that_moved_on_is_refused_not_misread(engine, images):
    opened = engine.chat(conversation(images, []), parameters=GREEDY, new_session=True)
    resent = conversation(images, [opened.text])
    assert engine.images_to_fetch(resent, opened.session_id) == []
    engine.ask(opened.session_id, "Something else", GREEDY, rewind_turns=1)  # drops the image
    as_planned = unloaded_images(resent)
    with pytest.raises(SessionChanged):  # not an answer about no image
        engine.chat(as_planned, opened.session_id, GREEDY)
    engine.close(opened.session_id)
    engine.check_integrity()


def test_a_conversation_must_end_with_a_question():
    with pytest.raises(InvalidRequest):
        Conversation((ChatTurn("Hi", answer="Hello"),))
    with pytest.raises(InvalidRequest):
        Conversation((ChatTurn("Hi"), ChatTurn("Again")))
    with pytest.raises(InvalidRequest):
        Conversation(())


def test_a_restarted_worker_knows_the_images_of_a_chat_session(
    demo_model, images, control, tmp_path
):
    directory = str(tmp_path / "tier")
    first = new_engine(demo_model, persist_dir=directory)
    texts = [answer.text for answer in control[:3]]
    opened = first.chat(conversation(images, []), parameters=GREEDY, new_session=True)
    for turn in (1, 2):
        first.chat(conversation(images, texts[:turn]), opened.session_id, GREEDY)
    first.stop()
    second = new_engine(demo_model, persist_dir=directory)
    resent = conversation(images, texts)
    assert second.images_to_fetch(resent, opened.session_id) == []  # refs kept on disk
    answer = second.chat(unloaded_images(resent), opened.session_id, GREEDY)
    assert answer.token_ids == control[3].token_ids
    second.stop()


def test_a_stateless_answer_writes_nothing_to_the_persistent_tier(demo_model, images, tmp_path):
    engine = new_engine(demo_model, persist_dir=str(tmp_path / "tier"))
    engine.chat(conversation(images, []), parameters=GREEDY)
    assert [
        p.name for p in (tmp_path / "tier").iterdir() if p.suffix in (".state", ".features")
    ] == []
    assert engine.stats().sessions == 0
    engine.stop()
