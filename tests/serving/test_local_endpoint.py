"""boto3 against the local endpoint over two real TorchServe instances.

The endpoint splits every streamed chunk into 7-byte PayloadParts, so every streaming test also
shows that JSON lines survive arbitrary splits. The instance-killing test runs last: it takes
one instance down for good.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from botocore.exceptions import ClientError

from llava_client import LlavaClient, LlavaError, SessionGone
from serving.torchserve import TorchServeInstance
from tests.conftest import REPO
from tests.endpoint_helpers import ENDPOINT, endpoint_fixture, images_fixture

pytestmark = pytest.mark.torchserve
INSTANCE = "x-local-endpoint-instance"


endpoint = endpoint_fixture("endpoint", instances=2, part_bytes=7)


images = images_fixture(3)


@pytest.fixture(scope="module")
def rt(endpoint):
    return endpoint.runtime()


@pytest.fixture(scope="module")
def client(rt):
    return LlavaClient(ENDPOINT, runtime=rt)


def invoke(rt, session_id, body):
    return rt.invoke_endpoint(
        EndpointName=ENDPOINT,
        SessionId=session_id,
        ContentType="application/json",
        Body=json.dumps(body),
    )


def kill(processes: list[psutil.Process]) -> None:
    for proc in processes:
        proc.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive


def open_raw(rt, url) -> tuple[str, str]:
    """Open with plain boto3; the session id and the instance that holds it."""
    reply = invoke(rt, "NEW_SESSION", {"requestType": "NEW_SESSION", "image": {"url": url}})
    return reply["NewSessionId"].split(";")[0], reply["ResponseMetadata"]["HTTPHeaders"][INSTANCE]


def ask_raw(rt, session_id, question) -> tuple[str, str]:
    reply = invoke(rt, session_id, {"requestType": "SESSION", "inputs": question})
    text = json.loads(reply["Body"].read())["generation"]["text"]
    return text, reply["ResponseMetadata"]["HTTPHeaders"][INSTANCE]


def test_sessions_spread_over_instances_and_stick(rt, images):
    opened = [open_raw(rt, images.url(i % 3)) for i in range(4)]
    assert {instance for _, instance in opened} == {"instance-0", "instance-1"}
    for turn in range(2):
        for i, (session_id, instance) in enumerate(opened):
            question = "What color is the shape?" if turn == 0 else "And its shape?"
            text, answered_by = ask_raw(rt, session_id, question)
            assert answered_by == instance
            truth = images.samples[i % 3]
            assert text == (truth.color if turn == 0 else truth.shape)
    for session_id, _ in opened:
        invoke(rt, session_id, {"requestType": "CLOSE_SESSION"})


def test_interleaved_sessions_answer_about_their_own_image(client, images):
    chats = [client.open(images.url(i)) for i in range(3)]
    for question, attribute in [
        ("What shape is it?", "shape"),
        ("And its color?", "color"),
        ("Say that again.", "color"),
    ]:
        for chat, truth in zip(chats, images.samples, strict=True):
            assert chat.ask(question).text == getattr(truth, attribute)
    for chat in chats:
        chat.close()


def test_close_then_ask_is_the_validation_error_a_sagemaker_caller_gets(rt, images):
    session_id, _ = open_raw(rt, images.url(0))
    closed = invoke(rt, session_id, {"requestType": "CLOSE_SESSION"})
    assert closed["ClosedSessionId"] == session_id
    with pytest.raises(ClientError) as raised:
        ask_raw(rt, session_id, "What shape is it?")
    error = raised.value.response
    assert error["Error"]["Code"] == "ValidationError"
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert session_id in error["Error"]["Message"]


def test_container_errors_arrive_as_model_error_with_the_containers_code(rt, client, images):
    session_id, _ = open_raw(rt, images.url(0))
    with pytest.raises(ClientError) as raised:
        invoke(rt, session_id, {"requestType": "SESSION", "inputs": 42})
    error = raised.value.response
    assert error["Error"]["Code"] == "ModelError"
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 424
    assert error["OriginalStatusCode"] == 400
    assert json.loads(error["OriginalMessage"])["error"]["code"] == "INVALID_REQUEST"
    # the client turns it into an exception carrying the container's code and status
    chat = client.open(images.url(0))
    with pytest.raises(LlavaError) as raised_client:
        chat.ask("")
    assert (raised_client.value.code, raised_client.value.status) == ("INVALID_REQUEST", 400)
    assert not isinstance(raised_client.value, SessionGone)
    chat.close()


def test_a_body_over_6_mb_is_refused_as_sagemaker_refuses_it(rt, images):
    too_big = json.dumps({"requestType": "NEW_SESSION", "image": {"b64": "A" * (6 << 20)}})
    with pytest.raises(ClientError) as raised:
        rt.invoke_endpoint(EndpointName=ENDPOINT, SessionId="NEW_SESSION", Body=too_big)
    error = raised.value.response  # the endpoint's own answer: a container's would be ModelError
    assert error["Error"]["Code"] == "ValidationError"
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert "oversize body" in error["Error"]["Message"]
    session_id, _ = open_raw(rt, images.url(0))  # the endpoint goes on serving
    invoke(rt, session_id, {"requestType": "CLOSE_SESSION"})


def test_unknown_endpoint_name_is_a_validation_error(rt):
    with pytest.raises(ClientError) as raised:
        rt.invoke_endpoint(EndpointName="no-such-endpoint", Body=b"{}")
    assert raised.value.response["Error"]["Code"] == "ValidationError"


def test_streaming_yields_incremental_text(rt, client, images):
    chat = client.open(images.url(1))
    truth = images.samples[1]
    pieces = list(chat.ask_stream("What shape is it?", min_new_tokens=4, max_new_tokens=4))
    assert len(pieces) >= 2  # text arrived piece by piece, not as one final blob
    assert "".join(pieces) == chat.history[-1].answer
    assert chat.history[-1].answer.startswith(truth.shape)
    # the raw events: many 7-byte PayloadParts, token lines before the final reply
    reply = rt.invoke_endpoint_with_response_stream(
        EndpointName=ENDPOINT,
        SessionId=chat.id,
        ContentType="application/json",
        Body=json.dumps({"requestType": "SESSION", "inputs": "And its color?", "stream": True}),
    )
    parts = [event["PayloadPart"]["Bytes"] for event in reply["Body"]]
    assert len(parts) > 10 and max(len(p) for p in parts) <= 7
    lines = [json.loads(line) for line in b"".join(parts).splitlines()]
    assert "token" in lines[0] and lines[-1]["generation"]["text"] == truth.color
    chat.close()


def test_a_caller_hanging_up_mid_stream_stops_its_turn(rt, images):
    """The endpoint sees the caller's socket close and sends CANCEL_TURN (TorchServe never tells
    its worker). The cut turn is kept, so the next turn's prompt shows how short it was."""
    long = {"max_new_tokens": 300, "min_new_tokens": 300}
    body = {"requestType": "SESSION", "inputs": "What shape is it?", "parameters": long}
    next_question = {"requestType": "SESSION", "inputs": "And its color?"}

    def stream(session_id):
        return rt.invoke_endpoint_with_response_stream(
            EndpointName=ENDPOINT, SessionId=session_id, Body=json.dumps({**body, "stream": True})
        )["Body"]

    def next_prompt_tokens(session_id) -> int:
        usage = json.loads(invoke(rt, session_id, next_question)["Body"].read())["usage"]
        return usage["newTokens"] + usage["cachedTokens"]

    (reference, _), (cut, _) = open_raw(rt, images.url(0)), open_raw(rt, images.url(0))
    assert sum(1 for _ in stream(reference)) > 300  # the whole answer, in small parts
    events = stream(cut)
    assert "PayloadPart" in next(iter(events))  # streaming has begun
    events.close()  # the caller hangs up
    assert next_prompt_tokens(cut) < next_prompt_tokens(reference) - 150


def test_opens_at_the_same_moment_spread_over_the_instances(rt, images):
    """Placement counts opens in flight: 24 at once do not all land where nothing was bound."""
    with ThreadPoolExecutor(24) as pool:
        opened = list(pool.map(lambda i: open_raw(rt, images.url(i % 3)), range(24)))
    per_instance = [sum(1 for _, name in opened if name == f"instance-{i}") for i in (0, 1)]
    assert abs(per_instance[0] - per_instance[1]) <= 2, per_instance
    for session_id, _ in opened:
        invoke(rt, session_id, {"requestType": "CLOSE_SESSION"})


def refusal(rt, session_id) -> dict:
    """The endpoint's 400 for an ask on ``session_id``, its code (a header: botocore drops an
    unmodelled error's extra body fields) as ``ErrorCode``."""
    with pytest.raises(ClientError) as raised:
        ask_raw(rt, session_id, "What shape is it?")
    response = raised.value.response
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 400
    headers = response["ResponseMetadata"]["HTTPHeaders"]
    return {**response, "ErrorCode": headers.get("x-local-endpoint-error-code")}


def test_bad_session_ids_are_refused_without_being_echoed_whole(rt, images):
    """botocore checks neither the pattern nor the length of SessionId: the endpoint does."""
    error = refusal(rt, "a" * 10_000)
    assert error["Error"]["Code"] == "ValidationError"
    assert error["ErrorCode"] == "INVALID_SESSION_ID" and len(error["Error"]["Message"]) < 300
    session_id, _ = open_raw(rt, images.url(0))
    error = refusal(rt, f"{session_id}; Expires=2030-01-01T00:00:00Z")  # the header sent back
    assert (
        "drop the suffix" in error["Error"]["Message"] and session_id in error["Error"]["Message"]
    )
    invoke(rt, session_id, {"requestType": "CLOSE_SESSION"})
    error = refusal(rt, session_id)
    assert error["ErrorCode"] == "SESSION_NOT_FOUND"


def test_a_stream_cannot_open_a_session(rt):
    with pytest.raises(ClientError) as raised:
        rt.invoke_endpoint_with_response_stream(
            EndpointName=ENDPOINT, SessionId="NEW_SESSION", Body=b'{"requestType": "NEW_SESSION"}'
        )
    assert raised.value.response["Error"]["Code"] == "ValidationError"


def test_each_worker_runs_torch_on_its_share_of_the_cores(endpoint):
    """Through TorchServe's Java to the Python worker: instances that each ran a thread per
    core fought over them (docs/performance.md §Endpoint instances and cores)."""
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    workers = [psutil.Process(ts.worker_pid()) for ts in endpoint.instances_started]
    assert [worker.environ()["OMP_NUM_THREADS"] for worker in workers] == [share, share]


ATTACH_AND_EDIT = """
import json, sys
from llava_client import LlavaClient
from tests.endpoint_helpers import DUMMY_CREDENTIALS, ENDPOINT
url, session_id, question = sys.argv[1:]
chat = LlavaClient(ENDPOINT, endpoint_url=url, **DUMMY_CREDENTIALS).attach(session_id)
answer = chat.edit_last(question, max_new_tokens=8)
print(json.dumps({"text": answer.text, "turns": chat.turns}))
"""


def test_a_session_is_regenerated_here_and_edited_from_another_process(endpoint, client, images):
    """A backend's second web worker attaches by id alone; every rewound answer equals the
    one a session that never had the dropped turn gives (greedy)."""
    chat = client.open(images.url(0))
    chat.ask("What shape is it?", max_new_tokens=8)
    chat.ask("Say that again.", max_new_tokens=8, temperature=8.0, seed=3)  # astray
    control = client.open(images.url(0))
    control.ask("What shape is it?", max_new_tokens=8)

    regenerated = chat.regenerate(max_new_tokens=8)
    assert regenerated.text == control.ask("Say that again.", max_new_tokens=8).text
    assert regenerated.reply["turns"] == 2 and regenerated.reply["usage"]["cachedTokens"] > 0

    question = "What color is the shape?"
    worker = subprocess.run(
        [sys.executable, "-c", ATTACH_AND_EDIT, endpoint.url, chat.id, question],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    edited = json.loads(worker.stdout)
    control.close()
    control = client.open(images.url(0))
    control.ask("What shape is it?", max_new_tokens=8)
    expected = control.ask(question, max_new_tokens=8).text
    assert edited == {"text": expected, "turns": 2} and expected == images.samples[0].color

    streamed = "".join(chat.ask_stream("And its shape?", rewind_turns=1, max_new_tokens=8))
    assert streamed == control.edit_last("And its shape?", max_new_tokens=8).text
    with pytest.raises(LlavaError) as refused:
        chat.ask("Hi", rewind_turns=3)
    assert (refused.value.code, refused.value.status) == ("REWIND_PAST_START", 400)
    chat.close()
    control.close()


def test_a_lost_session_fails_cleanly_and_the_client_recovers_it(endpoint, rt, images):
    """Two ways to lose sessions, the client's recovery, and the bystanders untouched.

    A. instance-0 dies altogether: the endpoint forgets its sessions (ValidationError with
       ErrorCode SESSION_LOST, each told how many went with it; closing one is a 200);
       instance-1's sessions go on as if nothing happened.
    B. then instance-1's worker dies: the endpoint's supervisor restarts the instance empty
       (serving/supervisor.py) and the router counts its sessions lost at once.
    """
    truths = [images.samples[i % 3] for i in range(4)]
    client = LlavaClient(ENDPOINT, runtime=rt, recover="replay")
    chats = [client.open(images.url(i % 3)) for i in range(4)]
    answers = [chat.ask("What color is the shape?") for chat in chats]
    assert [a.text for a in answers] == [t.color for t in truths]
    held = {id(c): a.metadata["HTTPHeaders"][INSTANCE] for c, a in zip(chats, answers, strict=True)}
    assert set(held.values()) == {"instance-0", "instance-1"}

    # A. instance-0 dies
    kill(TorchServeInstance(endpoint.run_dir / "instance-0").processes())
    victims = [chat for chat in chats if held[id(chat)] == "instance-0"]
    told = set()
    for victim in victims:  # whichever request notices the death, each is told the same count
        error = refusal(rt, victim.id)
        assert (error["Error"]["Code"], error["ErrorCode"]) == ("ValidationError", "SESSION_LOST")
        told.add(int(re.search(r"\((\d+) sessions lost", error["Error"]["Message"])[1]))
    assert len(told) == 1 and told.pop() >= len(victims)
    closed = invoke(rt, victims[-1].id, {"requestType": "CLOSE_SESSION"})  # idempotent close
    assert closed["ClosedSessionId"] == victims[-1].id
    assert json.loads(closed["Body"].read())["alreadyGone"] == "lost"
    for chat, truth in zip(chats, truths, strict=True):
        old_id, was_victim = chat.id, chat in victims
        answer = chat.ask("And its shape?")
        assert answer.text == truth.shape
        assert answer.metadata["HTTPHeaders"][INSTANCE] == "instance-1"
        assert chat.replay_mismatches == 0
        if was_victim:  # re-opened and replayed on the surviving instance
            assert chat.recoveries == 1 and chat.id != old_id
        else:  # untouched: same session, its KV cache still there
            assert chat.recoveries == 0 and chat.id == old_id
            assert answer.reply["usage"]["tier"] == "kv"
            assert answer.reply["usage"]["cachedTokens"] > answers[0].reply["usage"]["cachedTokens"]
        assert [turn.answer for turn in chat.history] == [truth.color, truth.shape]

    # B. instance-1's worker dies and comes back empty
    ts1 = endpoint.instances_started[1]
    old = ts1.worker_pid()
    kill([psutil.Process(old)])
    # Ready as the endpoint sees it: its supervisor logs this line once it routes there again
    # (a READY worker on TorchServe's management API can show up a poll earlier).
    back = "instance-1: supervisor: READY again"
    deadline = time.monotonic() + 120
    while back not in endpoint.log.read_text():  # the whole instance restarts meanwhile
        assert time.monotonic() < deadline, endpoint.log.read_text()[-3000:]
        time.sleep(0.2)
    assert f"instance-1: supervisor: worker {old} died" in endpoint.log.read_text()
    assert ts1.worker_pid() not in (None, old)
    error = refusal(rt, chats[0].id)
    assert (error["Error"]["Code"], error["ErrorCode"]) == ("ValidationError", "SESSION_LOST")
    assert "lost with instance-1, whose worker died" in error["Error"]["Message"]
    for chat, truth in zip(chats, truths, strict=True):
        recoveries = chat.recoveries
        assert chat.ask("Say that again.").text == truth.shape  # needs the replayed turns
        assert chat.recoveries == recoveries + 1 and chat.replay_mismatches == 0
    for chat in chats:
        chat.close()
