"""The client's session object: attach from another process, what a gone session raises or
replays, regenerate and edit_last. What each call sends is read where the container gets it
(a scripted one behind the real local endpoint); against the real model:
tests/serving/test_local_endpoint.py."""

from __future__ import annotations

import pytest

from llava_client import LlavaClient, SessionGone
from tests.scripted_container import OPENED, behind_an_endpoint, client_for

GONE = (400, {}, {"error": {"code": "SESSION_EXPIRED", "message": "session s-1 expired"}})


def answered(text: str, turns: int) -> tuple[int, dict, dict]:
    return 200, {}, {"generation": {"text": text}, "usage": {}, "turns": turns}


@pytest.fixture
def container():
    with behind_an_endpoint() as container:
        yield container


def test_a_gone_session_raises_what_was_lost_and_opens_nothing_by_default(container):
    container.script = [OPENED, answered("a circle", 1), answered("red", 2), GONE]
    chat = client_for(container).open()
    chat.ask("What shape?")
    chat.ask("And its color?", max_new_tokens=4)
    with pytest.raises(SessionGone) as err:
        chat.ask("Say that again.")
    gone = err.value
    assert (gone.code, gone.session_id, gone.turns) == ("SESSION_EXPIRED", "s-1", 2)
    assert [turn.question for turn in gone.history] == ["What shape?", "And its color?"]
    assert "gone with 2 turns" in gone.message and 'recover="replay"' in gone.message
    assert [body["requestType"] for body in container.bodies].count("NEW_SESSION") == 1


def test_replay_is_asked_for_and_re_asks_every_question_in_order(container):
    container.script = [OPENED, answered("a circle", 1), GONE, OPENED]
    container.script += [answered("a circle", 1), answered("red", 2)]
    chat = client_for(container, recover="replay").open()
    chat.ask("What shape?")
    assert chat.ask("And its color?").text == "red"
    asked = [body.get("inputs") for body in container.bodies]
    assert asked == [None, "What shape?", "And its color?", None, "What shape?", "And its color?"]
    assert chat.recoveries == 1 and chat.turns == 2


def test_recover_takes_only_its_named_choices():
    with pytest.raises(ValueError, match="recover must be one of raise, replay, not True"):
        LlavaClient("x", runtime=object(), recover=True)


def test_an_attached_session_is_the_openers_and_is_never_replayed(container):
    container.script = [OPENED]
    opener = client_for(container).open()
    container.script = [answered("a circle", 1), GONE]
    other_worker = client_for(container, recover="replay").attach(opener.id)
    assert other_worker.ask("What shape?").text == "a circle" and other_worker.turns == 1
    with pytest.raises(SessionGone, match="it was attached, so only its opener knows its image"):
        other_worker.ask("And its color?")
    assert [body["requestType"] for body in container.bodies] == ["NEW_SESSION"] + ["SESSION"] * 2


def test_regenerate_and_edit_last_rewind_one_turn_and_replace_it_in_the_history(container):
    container.script = [OPENED, answered("a circle", 1), answered("blue?", 2)]
    container.script += [answered("red", 2), answered("a circle", 2)]
    chat = client_for(container).open()
    chat.ask("What shape?")
    chat.ask("And its color?", temperature=1.5)
    assert chat.regenerate().text == "red"
    assert chat.edit_last("And its shape?", max_new_tokens=3).text == "a circle"
    regenerated, edited = container.bodies[-2:]
    assert regenerated == {"requestType": "SESSION", "inputs": "And its color?", "rewind_turns": 1}
    assert edited["rewind_turns"] == 1 and edited["parameters"] == {"max_new_tokens": 3}
    assert [(t.question, t.answer) for t in chat.history] == [
        ("What shape?", "a circle"),
        ("And its shape?", "a circle"),
    ]
    assert chat.turns == 2


def test_regenerate_needs_a_question_asked_through_the_object(container):
    attached = client_for(container).attach("s-1")
    with pytest.raises(ValueError, match=r"use edit_last\(question\)"):
        attached.regenerate()
    assert container.calls == 0
