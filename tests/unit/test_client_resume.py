"""``LlavaClient(recover="resume")``, the default: a session lost with its instance is rebuilt
by the server from its durable record under a new id, and the call goes on there.

What the client sends and how it reads the answers is checked where a container gets them:
scripted containers (two instances) behind the real local endpoint, whose router refuses an id
lost with its instance as SageMaker's does. Then against the real handler and engine: two
in-process instances sharing a durable store (a directory), behind the same endpoint.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import boto3
import pytest

from llava_client import LlavaClient, SessionGone
from llava_wire import CUSTOM_ATTRIBUTES_HEADER, SESSION_HEADER
from local_endpoint.router import Backend, Router
from local_endpoint.server import EndpointServer
from tests import loopback
from tests.endpoint_helpers import DUMMY_CREDENTIALS, ENDPOINT
from tests.scripted_container import OPENED, ScriptedContainer

EXPIRES = "2030-01-01T00:00:00Z"


def answered(text: str, turns: int) -> tuple[int, dict, dict]:
    return 200, {}, {"generation": {"text": text}, "usage": {}, "turns": turns}


def resumed(new_id: str, old_id: str = "s-1", turns: int = 2) -> tuple[int, dict, dict]:
    """The open's reply to ``{"resumeFrom": old_id}`` (docs/wire.md §Resuming a session)."""
    headers = {"X-Amzn-SageMaker-New-Session-Id": f"{new_id}; Expires={EXPIRES}"}
    body = {"sessionId": new_id, "resumed": {"from": old_id, "turns": turns, "images": 1}}
    return 200, headers, body


def refused(status: int, code: str, **extra) -> tuple[int, dict, dict]:
    return status, {}, {"error": {"code": code, "message": f"{code.lower()} here", **extra}}


def streamed(text: str, turns: int) -> tuple[int, dict, bytes]:
    lines = [{"token": {"id": 0, "text": text}, "seq": 0}]
    lines.append({"generation": {"text": text}, "usage": {}, "turns": turns, "seq": 1})
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    return 200, {"Content-Type": "application/jsonlines"}, body


class TwoInstances:
    """Two scripted instances behind the real local endpoint; ``lose(0)`` takes instance-0
    away with its sessions, as SageMaker's router forgets a replaced instance's."""

    def __init__(self):
        self.containers = [ScriptedContainer(), ScriptedContainer()]
        self.serving = [True, True]
        self.backends = [
            Backend(f"instance-{i}", c.url, ready=lambda i=i: self.serving[i])
            for i, c in enumerate(self.containers)
        ]
        self.router = Router(self.backends)
        self.endpoint = EndpointServer(("127.0.0.1", 0), ENDPOINT, self.router)
        self.url = f"http://127.0.0.1:{self.endpoint.server_address[1]}"

    def lose(self, i: int) -> None:
        self.serving[i] = False
        self.router.mark_dead(self.backends[i])

    def client(self, **options) -> LlavaClient:
        rt = boto3.client("sagemaker-runtime", endpoint_url=self.url, **DUMMY_CREDENTIALS)
        return LlavaClient(ENDPOINT, runtime=rt, **options)


@pytest.fixture
def instances() -> Iterator[TwoInstances]:
    two = TwoInstances()  # its scripted containers serve from their start
    loopback.start(two.endpoint)
    try:
        yield two
    finally:
        with contextlib.suppress(Exception):
            loopback.stop(two.endpoint)
        for container in two.containers:
            loopback.stop(container.httpd)


def opened_on_instance_0(instances: TwoInstances, **options):
    """A session "s-1" with two turns on instance-0 (instance-1 is kept free for the open)."""
    tenant = options.pop("tenant", None)
    instances.serving[1] = False
    instances.containers[0].script = [OPENED, answered("a circle", 1), answered("red", 2)]
    chat = instances.client(**options).open(tenant=tenant)
    chat.ask("What shape?")
    chat.ask("And its color?")
    instances.serving[1] = True
    return chat


def test_a_session_lost_with_its_instance_goes_on_under_a_new_id_with_nothing_re_asked(
    instances,
):
    chat = opened_on_instance_0(instances)
    instances.lose(0)
    survivor = instances.containers[1]
    survivor.script = [resumed("s-2"), answered("a red circle", 3)]
    answer = chat.ask("Say it all.", max_new_tokens=8)
    assert answer.text == "a red circle"
    assert (chat.id, chat.expires_at, chat.recoveries, chat.turns) == ("s-2", EXPIRES, 1, 3)
    resume, ask = survivor.bodies
    assert resume == {"requestType": "NEW_SESSION", "resumeFrom": "s-1"}
    assert survivor.headers[0][SESSION_HEADER] == "NEW_SESSION"
    assert ask == {
        "requestType": "SESSION",
        "inputs": "Say it all.",
        "parameters": {"max_new_tokens": 8},
    }
    assert survivor.headers[1][SESSION_HEADER] == "s-2"
    assert [(t.question, t.answer) for t in chat.history] == [
        ("What shape?", "a circle"),
        ("And its color?", "red"),
        ("Say it all.", "a red circle"),
    ]
    assert chat.replay_mismatches == 0 and instances.containers[0].calls == 3  # nothing re-asked


def test_resume_is_the_default_and_carries_the_tenant_as_the_open_did(instances):
    chat = opened_on_instance_0(instances, tenant="acme")
    assert chat.client.recover == "resume"
    assert instances.containers[0].headers[0][CUSTOM_ATTRIBUTES_HEADER] == "tenant=acme"
    instances.lose(0)
    survivor = instances.containers[1]
    survivor.script = [resumed("s-2"), answered("a red circle", 3)]
    chat.ask("Say it all.")
    sent = [h.get(CUSTOM_ATTRIBUTES_HEADER) for h in survivor.headers]
    assert sent == ["tenant=acme", None]  # on the resume, as on an open; not on the ask


@pytest.mark.parametrize("call", ["regenerate", "edit_last", "ask_stream"])
def test_regenerate_edit_last_and_a_stream_go_on_after_a_resume(instances, call):
    chat = opened_on_instance_0(instances)
    instances.lose(0)
    survivor = instances.containers[1]
    if call == "ask_stream":
        survivor.script = [resumed("s-2"), streamed("a red circle", 3)]
        assert "".join(chat.ask_stream("Say it all.")) == "a red circle"
        expected = {"requestType": "SESSION", "inputs": "Say it all.", "stream": True}
    else:
        survivor.script = [resumed("s-2"), answered("blue", 2)]
        answer = chat.regenerate() if call == "regenerate" else chat.edit_last("Its hue?")
        assert answer.text == "blue"
        question = "And its color?" if call == "regenerate" else "Its hue?"
        expected = {"requestType": "SESSION", "inputs": question, "rewind_turns": 1}
    assert survivor.bodies == [{"requestType": "NEW_SESSION", "resumeFrom": "s-1"}, expected]
    assert chat.id == "s-2" and chat.recoveries == 1
    assert chat.history[0].question == "What shape?" and chat.history[-1].answer in (
        "blue",
        "a red circle",
    )


def test_a_record_one_turn_behind_gets_that_turn_asked_again_first(instances):
    """A write-behind record lacks the last turn when its instance died before writing it:
    the client asks that turn again (its answer regenerated), then the call."""
    chat = opened_on_instance_0(instances)
    instances.lose(0)
    survivor = instances.containers[1]
    survivor.script = [resumed("s-2", turns=1), answered("red", 2), answered("a red circle", 3)]
    assert chat.ask("Say it all.").text == "a red circle"
    asked = [body.get("inputs") for body in survivor.bodies]
    assert asked == [None, "And its color?", "Say it all."]
    assert chat.turns == 3 and chat.replay_mismatches == 0
    assert [t.question for t in chat.history] == ["What shape?", "And its color?", "Say it all."]


@pytest.mark.parametrize(
    "status, code",
    [
        (400, "DURABLE_STORE_OFF"),
        (404, "SESSION_RECORD_NOT_FOUND"),
        (410, "SESSION_RECORD_EXPIRED"),
        (422, "SESSION_RECORD_CORRUPT"),
        (409, "SESSION_RECORD_FOREIGN"),
        (400, "UNKNOWN_KEY"),  # a server from before resume
    ],
)
def test_a_server_that_cannot_resume_raises_session_gone_with_the_original_code(
    instances, status, code
):
    chat = opened_on_instance_0(instances)
    instances.lose(0)
    survivor = instances.containers[1]
    survivor.script = [refused(status, code)]
    with pytest.raises(SessionGone) as raised:
        chat.ask("Say it all.")
    gone = raised.value
    assert gone.code == "SESSION_LOST"  # what said the session was gone, not the refusal
    assert (gone.session_id, gone.turns, len(gone.history)) == ("s-1", 2, 2)
    assert gone.resume_error.code == code and gone.resume_error.status == status
    assert f"resuming it failed: {code}" in gone.message and "gone with 2 turns" in gone.message
    assert survivor.calls == 1 and chat.id == "s-1" and chat.recoveries == 0  # nothing else


def test_a_store_that_does_not_answer_now_is_retried_after_its_wait(instances):
    chat = opened_on_instance_0(instances, sleep=lambda s: None)
    instances.lose(0)
    survivor = instances.containers[1]
    unavailable = refused(503, "DURABLE_STORE_UNAVAILABLE", retryAfterS=1)
    survivor.script = [unavailable, resumed("s-2"), answered("a red circle", 3)]
    assert chat.ask("Say it all.").text == "a red circle"
    assert [b.get("resumeFrom") for b in survivor.bodies] == ["s-1", "s-1", None]
    assert chat.client.busy_retried == 1


@pytest.mark.parametrize("code", ["SESSION_CLOSED", "SESSION_EXPIRED", "SESSION_RECORD_CORRUPT"])
def test_closed_expired_and_refused_sessions_are_never_resumed(instances, code):
    chat = opened_on_instance_0(instances)
    instances.containers[0].script = [refused(410, code)]
    with pytest.raises(SessionGone) as raised:
        chat.ask("Say it all.")
    assert raised.value.code == code and raised.value.resume_error is None
    assert "is not resumed" in raised.value.message or "cannot be resumed" in raised.value.message
    assert instances.containers[1].calls == 0
    assert [b["requestType"] for b in instances.containers[0].bodies].count("NEW_SESSION") == 1


def test_a_session_this_client_closed_is_not_resumed(instances):
    chat = opened_on_instance_0(instances)
    instances.containers[0].script = [(200, {}, {"sessionId": "s-1", "closed": True})]
    chat.close()
    with pytest.raises(SessionGone, match="closed by this client"):
        chat.ask("Say it all.")
    assert instances.containers[0].calls == 4 and instances.containers[1].calls == 0


def test_an_attached_session_resumes_with_only_its_id(instances):
    opener = opened_on_instance_0(instances)
    instances.lose(0)
    survivor = instances.containers[1]
    survivor.script = [resumed("s-2"), answered("a red circle", 3), answered("round", 4)]
    other_worker = instances.client().attach(opener.id, tenant="acme")
    assert other_worker.ask("Say it all.").text == "a red circle"
    assert (other_worker.id, other_worker.turns, other_worker.recoveries) == ("s-2", 3, 1)
    assert survivor.headers[0][CUSTOM_ATTRIBUTES_HEADER] == "tenant=acme"
    assert other_worker.ask("Its outline?").text == "round"
    assert survivor.headers[-1][SESSION_HEADER] == "s-2"


def test_raise_sends_no_resume(instances):
    chat = opened_on_instance_0(instances, recover="raise")
    instances.lose(0)
    with pytest.raises(SessionGone, match='recover="replay"'):
        chat.ask("Say it all.")
    assert instances.containers[1].calls == 0


def test_replay_sends_no_resume(instances):
    replaying = opened_on_instance_0(instances, recover="replay")
    instances.lose(0)
    survivor = instances.containers[1]
    survivor.script = [OPENED, answered("a circle", 1), answered("red", 2), answered("ok", 3)]
    assert replaying.ask("Say it all.").text == "ok"
    assert all("resumeFrom" not in body for body in survivor.bodies)


# -- against the real handler and engine -----------------------------------------------------


class InProcessContainer:
    """The real handler (scripts/handler_harness.py's in-process worker) and engine on the demo
    model, answering POST /invocations on loopback as a container does: an instance."""

    def __init__(self, engine):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from scripts.handler_harness import InProcessWorker

        self.engine = engine
        self.worker = InProcessWorker(engine)
        worker = self.worker

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                reply = worker.invoke(body, dict(self.headers.items()))
                loopback.send(self, reply.status, reply.headers, reply.text.encode())

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        loopback.start(self.httpd)

    def stop(self) -> None:
        loopback.stop(self.httpd)
        self.worker.stop()
        self.engine.stop()


@contextlib.contextmanager
def two_real_instances(demo_model, tmp_path, survivor_store: bool = True):
    """instance-0 and instance-1 on their own disks, sharing a durable store (a directory,
    as a shared file system would be; the S3 one: tests of the engine's store)."""
    from llava.config import EngineConfig
    from llava.engine import Engine
    from llava.kv.budget import MemoryBudget

    store = str(tmp_path / "store")
    containers = []
    for i, durable in enumerate([True, survivor_store]):
        config = EngineConfig(
            model_dir="-",
            persist_dir=str(tmp_path / f"instance-{i}"),
            durable_store=store if durable else None,
        )
        containers.append(InProcessContainer(Engine(demo_model, config, MemoryBudget(1 << 30))))
    two = TwoInstances.__new__(TwoInstances)
    two.containers, two.serving = containers, [True, True]
    two.backends = [
        Backend(f"instance-{i}", c.url, ready=lambda i=i: two.serving[i])
        for i, c in enumerate(containers)
    ]
    two.router = Router(two.backends)
    two.endpoint = EndpointServer(("127.0.0.1", 0), ENDPOINT, two.router)
    two.url = f"http://127.0.0.1:{two.endpoint.server_address[1]}"
    loopback.start(two.endpoint)
    try:
        yield two
    finally:
        loopback.stop(two.endpoint)
        for container in containers:
            with contextlib.suppress(Exception):
                container.stop()


def replace_instance_0(two) -> None:
    """As a scale-in does: SIGTERM's flush of its dirty sessions, then the instance is gone,
    and the router forgets its sessions."""
    first = two.containers[0]
    assert first.engine.flush_durable(10.0) == []
    two.serving[0] = False
    two.router.mark_dead(two.backends[0])
    first.stop()


QUESTIONS = ["What shape is it?", "What color is it?", "Describe it."]


def test_a_real_session_resumes_on_another_instance_and_answers_as_if_never_lost(
    demo_model, tmp_path
):
    from demo_model.synthetic import held_out_samples
    from tests.intake_servers import image_bytes

    image = image_bytes(held_out_samples(1)[0].image)
    with two_real_instances(demo_model, tmp_path) as two:
        client = two.client()
        two.serving[1] = False  # the session opens on instance-0
        chat = client.open(image, tenant="acme")
        two.serving[0], two.serving[1] = False, True  # the control on instance-1
        control = client.open(image, tenant="acme")
        two.serving[0] = True
        for question in QUESTIONS[:2]:
            chat.ask(question, max_new_tokens=12)
            control.ask(question, max_new_tokens=12)
        old_id = chat.id
        replace_instance_0(two)

        answer = chat.ask(QUESTIONS[2], max_new_tokens=12)  # resumed on instance-1
        assert answer.metadata["HTTPHeaders"]["x-local-endpoint-instance"] == "instance-1"
        assert answer.text and answer.text == control.ask(QUESTIONS[2], max_new_tokens=12).text
        assert chat.id != old_id and chat.recoveries == 1 and chat.turns == 3
        assert chat.replay_mismatches == 0 and [t.question for t in chat.history] == QUESTIONS
        streamed = "".join(chat.ask_stream("Again?", max_new_tokens=8))
        assert streamed == "".join(control.ask_stream("Again?", max_new_tokens=8))
        chat.close()
        control.close()


def test_a_real_attached_session_resumes_and_a_closed_one_does_not(demo_model, tmp_path):
    with two_real_instances(demo_model, tmp_path) as two:
        two.serving[1] = False
        opener = two.client().open(None)
        opener.ask("Hello.", max_new_tokens=4)
        closed = two.client().open(None)
        closed.ask("Hello.", max_new_tokens=4)
        two.serving[1] = True
        two.containers[0].engine.close(closed.id)  # closed by the server: its record goes
        replace_instance_0(two)

        other_worker = two.client().attach(opener.id)
        assert other_worker.ask("And now?", max_new_tokens=4).text
        assert other_worker.id != opener.id and other_worker.turns == 2
        gone_id = closed.id
        with pytest.raises(SessionGone) as raised:
            two.client().attach(gone_id).ask("And now?", max_new_tokens=4)
        assert raised.value.code == "SESSION_LOST"
        assert raised.value.resume_error.code == "SESSION_RECORD_NOT_FOUND"


def test_a_real_server_without_a_durable_store_raises_the_original_code(demo_model, tmp_path):
    with two_real_instances(demo_model, tmp_path, survivor_store=False) as two:
        two.serving[1] = False
        chat = two.client().open(None)
        chat.ask("Hello.", max_new_tokens=4)
        two.serving[1] = True
        replace_instance_0(two)
        with pytest.raises(SessionGone) as raised:
            chat.ask("And now?", max_new_tokens=4)
        gone = raised.value
        assert (gone.code, gone.resume_error.code, gone.resume_error.status) == (
            "SESSION_LOST",
            "DURABLE_STORE_OFF",
            400,
        )
        assert "resuming it failed: DURABLE_STORE_OFF" in gone.message and gone.turns == 1
