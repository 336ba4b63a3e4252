"""The client honours Retry-After: a container's 503 (KV_MEMORY_FULL, ``Retry-After: 1``) reaches
real boto3 through the real local endpoint as SageMaker wraps it, and the client sends the call
again after the wait, a bounded number of times, or not at all when told not to.

The container is a stand-in on loopback that answers from a script: a real one refuses a turn
only while other turns hold the KV pool, which no test can time
(docs/client.md §Client retries on 503).
"""

from __future__ import annotations

import json

import boto3
import pytest

from llava_client import LlavaError
from local_endpoint.router import Backend, Router
from local_endpoint.server import EndpointServer
from serving.torchserve import free_ports
from tests import loopback
from tests.endpoint_helpers import DUMMY_CREDENTIALS, ENDPOINT
from tests.scripted_container import (
    ANSWERED,
    BAD,
    BUSY,
    OPENED,
    ScriptedContainer,
    behind_an_endpoint,
    client_for,
)


@pytest.fixture
def container():
    with behind_an_endpoint() as container:
        yield container


def test_a_busy_turn_is_sent_again_after_the_wait_the_server_gave(container):
    container.script = [OPENED, BUSY, BUSY, ANSWERED]
    waits = []
    client = client_for(container, sleep=waits.append)
    chat = client.open()
    assert chat.ask("What shape?").text == "a circle"
    assert container.calls == 4 and client.busy_retried == 2
    # the body's retryAfterS (0.2 s, stretched by at most half), not the header's 1 s
    assert len(waits) == 2 and all(0.2 <= wait <= 0.2 * 1.5 for wait in waits), waits


def test_retries_are_bounded_and_the_last_refusal_is_raised(container):
    container.script = [OPENED, BUSY, BUSY, BUSY]
    waits = []
    client = client_for(container, busy_retries=2, sleep=waits.append)
    chat = client.open()
    with pytest.raises(LlavaError) as refused:
        chat.ask("What shape?")
    assert (refused.value.code, refused.value.status) == ("KV_MEMORY_FULL", 503)
    assert refused.value.retry_after_s == 0.2
    assert container.calls == 4  # the open, then three tries
    assert len(waits) == 2  # a wait between tries, none after the last


def test_retrying_can_be_turned_off(container):
    container.script = [OPENED, BUSY]
    waits = []
    chat = client_for(container, busy_retries=0, sleep=waits.append).open()
    with pytest.raises(LlavaError, match="KV_MEMORY_FULL"):
        chat.ask("What shape?")
    assert container.calls == 2 and waits == []


def test_an_error_that_names_no_wait_is_not_retried(container):
    container.script = [BAD]
    with pytest.raises(LlavaError, match="IMAGE_TOO_LARGE"):
        client_for(container).open(b"\x89PNG")
    assert container.calls == 1


def test_an_open_that_meets_a_restarting_instance_leaves_its_sessions_alone():
    """An open placed on an instance whose worker just died (nothing listens yet, its
    supervisor not told) goes on to the other instance, and the dead one's sessions are not
    marked lost: it is supervised with the persistent tier (coming back), so they continue
    once it is READY (the soak lost them here before: docs/client.md §The local endpoint)."""
    live = ScriptedContainer()
    live.script = [OPENED]
    restarting = Backend(
        "instance-0",
        f"http://127.0.0.1:{free_ports(1)[0]}",  # nothing listens there
        ready=lambda: True,
        supervised=lambda: True,
    )
    other = Backend("instance-1", live.url, ready=lambda: True)
    router = Router([restarting, other])
    router.bind("held", restarting)
    for session_id in ("a", "b"):  # the other instance is busier: the open tries instance-0
        router.bind(session_id, other)
    endpoint = EndpointServer(("127.0.0.1", 0), ENDPOINT, router)
    loopback.start(endpoint)
    try:
        url = f"http://127.0.0.1:{endpoint.server_address[1]}"
        rt = boto3.client("sagemaker-runtime", endpoint_url=url, **DUMMY_CREDENTIALS)
        reply = rt.invoke_endpoint(
            EndpointName=ENDPOINT,
            Body=json.dumps({"requestType": "NEW_SESSION"}),
            ContentType="application/json",
            SessionId="NEW_SESSION",
        )
        assert reply["ResponseMetadata"]["HTTPHeaders"]["x-local-endpoint-instance"] == "instance-1"
        assert router.for_session("held") is restarting and router.lost("held") is None
    finally:
        loopback.stop(endpoint)
        loopback.stop(live.httpd)


def test_a_system_prompt_is_sent_at_open_and_again_when_the_session_is_reopened(container):
    gone = (400, {}, {"error": {"code": "SESSION_EXPIRED", "message": "expired"}})
    container.script = [OPENED, gone, OPENED, ANSWERED]
    chat = client_for(container, recover="replay").open(system="Be brief.")
    chat.ask("Hi")
    opens = [b for b in container.bodies if b["requestType"] == "NEW_SESSION"]
    assert [b.get("system") for b in opens] == ["Be brief.", "Be brief."]
    assert chat.recoveries == 1
