"""The client's session object: attach from another process, what a gone session raises or
replays, regenerate and edit_last. What each call sends is read where the container gets it
(a scripted one behind the real local endpoint); against the real model:
tests/serving/test_local_endpoint.py."""

from __future__ import annotations

import base64
import json

import pytest

from llava_client import LlavaClient, SessionGone, StreamGap
from llava_wire import CUSTOM_ATTRIBUTES_HEADER
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


def test_a_tenant_goes_as_a_custom_attribute_on_the_open_and_on_its_replay(container):
    container.script = [OPENED, GONE, OPENED, answered("a circle", 1)]
    chat = client_for(container, recover="replay").open(tenant="acme")
    chat.ask("What shape?")
    sent = [
        (body.get("requestType"), headers.get(CUSTOM_ATTRIBUTES_HEADER))
        for headers, body in zip(container.headers, container.bodies, strict=True)
    ]
    assert sent == [("NEW_SESSION", "tenant=acme"), ("SESSION", None)] * 2


def answered_with_image(text: str, turns: int, images: int) -> tuple[int, dict, dict]:
    usage = {"newTokens": 80, "cachedTokens": 40, "imageTokens": 64, "images": images}
    return 200, {}, {"generation": {"text": text}, "usage": usage, "turns": turns}


DOG_PNG = b"\x89PNG dog"
DOG = {"b64": base64.b64encode(DOG_PNG).decode()}


def test_a_turns_image_goes_in_its_ask_and_the_answer_shows_its_usage(container, tmp_path):
    container.script = [OPENED, answered("a circle", 1), answered_with_image("a square", 2, 2)]
    container.script += [answered_with_image("a star", 3, 3), streamed(["a ", "cat"])]
    chat = client_for(container).open("https://x.test/cat.png")
    assert chat.ask("What shape?").image_tokens is None  # the reply did not say
    answer = chat.ask("And this one?", image=DOG_PNG, max_new_tokens=4)
    assert (answer.text, answer.image_tokens, answer.images) == ("a square", 64, 2)
    (tmp_path / "star.png").write_bytes(b"\x89PNG star")
    assert chat.ask("And this?", image=tmp_path / "star.png").images == 3
    assert "".join(chat.ask_stream("Which one?", image="s3://b/cat.png")) == "a cat"
    opened, plain, dog, star, streamed_ask = container.bodies
    assert opened["image"] == {"url": "https://x.test/cat.png"} and "image" not in plain
    assert dog == {
        "requestType": "SESSION",
        "inputs": "And this one?",
        "image": DOG,
        "parameters": {"max_new_tokens": 4},
    }
    assert base64.b64decode(star["image"]["b64"]) == b"\x89PNG star"
    assert streamed_ask["image"] == {"s3": "s3://b/cat.png"} and streamed_ask["stream"] is True
    assert [turn.image for turn in chat.history] == [
        None,
        DOG,
        star["image"],
        streamed_ask["image"],
    ]
    with pytest.raises(ValueError, match="pathlib.Path"):
        chat.ask("And this?", image="dog.png")  # refused here: nothing sent
    assert container.calls == 5


def test_replay_sends_each_turns_image_again_with_its_turn(container):
    """The re-opened session gets the open's image, then each question with the image its
    turn sent, in order; then the call that met the gone session, with its own image."""
    container.script = [OPENED, answered("a circle", 1), answered_with_image("a dog", 2, 2)]
    container.script += [GONE, OPENED, answered("a circle", 1), answered_with_image("a dog", 2, 2)]
    container.script += [answered_with_image("a star", 3, 3)]
    chat = client_for(container, recover="replay").open("https://x.test/cat.png")
    chat.ask("What shape?")
    chat.ask("And this one?", image=DOG_PNG)
    assert chat.ask("And this?", image="https://x.test/star.png").text == "a star"
    sent = [(body.get("inputs"), body.get("image")) for body in container.bodies]
    cat, star = {"url": "https://x.test/cat.png"}, {"url": "https://x.test/star.png"}
    first_life = [(None, cat), ("What shape?", None), ("And this one?", DOG)]
    assert sent == first_life + [("And this?", star)] + first_life + [("And this?", star)]
    assert chat.recoveries == 1 and chat.turns == 3 and chat.replay_mismatches == 0
    assert [turn.image for turn in chat.history] == [None, DOG, star]


def test_regenerate_and_edit_last_send_the_replaced_turns_image_again(container):
    """A rewound turn takes its image along on the server, so the turn that replaces it
    brings it again; edit_last sends another image, or none, when told."""
    container.script = [OPENED, answered_with_image("a dog", 1, 2)]
    container.script += [answered_with_image(text, 1, n) for text, n in [("a puppy", 2)] * 3]
    container.script += [answered("nothing", 1)]
    chat = client_for(container).open("https://x.test/cat.png")
    chat.ask("And this one?", image=DOG_PNG)
    chat.regenerate()
    chat.edit_last("What breed is this one?")
    chat.edit_last("And this?", image="https://x.test/star.png")
    chat.edit_last("And now?", image=None)
    sent = [(b["inputs"], b.get("image"), b.get("rewind_turns")) for b in container.bodies[1:]]
    assert sent == [
        ("And this one?", DOG, None),
        ("And this one?", DOG, 1),
        ("What breed is this one?", DOG, 1),
        ("And this?", {"url": "https://x.test/star.png"}, 1),
        ("And now?", None, 1),
    ]
    assert [(turn.question, turn.image) for turn in chat.history] == [("And now?", None)]


def test_recover_takes_only_its_named_choices():
    with pytest.raises(ValueError, match="recover must be one of raise, replay, resume, not True"):
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


def streamed(texts: list[str], lost: set[int] = frozenset()) -> tuple[int, dict, bytes]:
    """A streamed reply as the handler numbers it, less the token lines in ``lost``."""
    lines = [{"token": {"id": i, "text": text}, "seq": i} for i, text in enumerate(texts)]
    final = {"generation": {"text": "".join(texts)}, "usage": {}, "turns": 1, "seq": len(texts)}
    kept = [line for line in lines if line["seq"] not in lost] + [final]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in kept)
    return 200, {"Content-Type": "application/jsonlines"}, body


def test_a_whole_stream_yields_every_piece_in_order(container):
    container.script = [OPENED, streamed(["a ", "red ", "circle"])]
    chat = client_for(container).open()
    assert list(chat.ask_stream("What is it?")) == ["a ", "red ", "circle"]
    assert chat.history[-1].answer == "a red circle"


@pytest.mark.parametrize("lost", [{1}, {2}], ids=["a middle line", "the last token line"])
def test_a_stream_with_a_lost_line_raises_with_the_whole_text_after_yielding_no_hole(
    container, lost
):
    container.script = [OPENED, streamed(["a ", "red ", "circle"], lost)]
    chat = client_for(container).open()
    pieces = []
    with pytest.raises(StreamGap) as raised:
        pieces.extend(chat.ask_stream("What is it?"))
    assert pieces == ["a "] if lost == {1} else ["a ", "red "]  # nothing after the hole
    assert raised.value.code == "STREAM_GAP" and raised.value.text == "a red circle"
    assert f"1 line(s) of the stream never arrived (from line {min(lost)})" in raised.value.message
    assert chat.history[-1].answer == "a red circle" and chat.turns == 1  # the session holds it
