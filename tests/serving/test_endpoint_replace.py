"""Replacing an instance of the local endpoint, as SageMaker replaces one (scale-in, an
UpdateEndpoint, a hardware fault): docs/client.md §Replacing an instance.

Real parts only: boto3 (unmodified) against the local endpoint over two real TorchServe
instances serving the demo model; with a durable store, moto's S3 server on loopback
(``--durable-store s3-local``). Without a durable store the replaced instance's sessions are
lost (SESSION_LOST) and nothing else is; with one, a client with ``recover="resume"`` goes on
with the next ``ask`` as if nothing happened, token for token (greedy) with a twin session that
was never interrupted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from botocore.exceptions import ClientError

from llava_client import LlavaClient
from local_endpoint.launcher import S3_LOCAL_STATE
from tests.conftest import REPO
from tests.endpoint_helpers import ENDPOINT, images_fixture, start_endpoint_on_disk

pytestmark = pytest.mark.torchserve
INSTANCE = "x-local-endpoint-instance"
ERROR_CODE = "x-local-endpoint-error-code"
QUESTIONS = [
    "What shape is it?",
    "And its color?",
    "Say that again.",
    "What color is the shape?",
    "And its shape?",
]
# Long enough (eos held off) that an answer depends on the whole history, token by token.
LONG = {"max_new_tokens": 12, "min_new_tokens": 12}
SHORT = {"max_new_tokens": 4}  # raw turns: many fit in the demo model's 512 tokens
REPLACE_TIMEOUT_S = 240.0  # a graceful stop (≤ 30 s) and a fresh instance's start (≤ 180 s)
# What a worker logs once its SIGTERM flush wrote everything (handlers/llava_handler.py).
FLUSHED_ALL = "SIGTERM: durable store flushed, 0 sessions left unwritten"


images = images_fixture(2)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """No durable store; a persistent tier, so that the replaced instance has a disk to lose."""
    endpoint = start_endpoint_on_disk(tmp_path_factory.mktemp("plain"), instances=2)
    yield endpoint
    endpoint.stop()


@pytest.fixture(scope="module")
def durable(tmp_path_factory):
    endpoint = start_endpoint_on_disk(
        tmp_path_factory.mktemp("durable"), instances=2, durable_store="s3-local"
    )
    yield endpoint
    endpoint.stop()


def invoke(rt, session_id: str, body: dict) -> dict:
    return rt.invoke_endpoint(
        EndpointName=ENDPOINT,
        SessionId=session_id,
        ContentType="application/json",
        Body=json.dumps(body),
    )


def open_raw(rt, url: str) -> tuple[str, str]:
    reply = invoke(rt, "NEW_SESSION", {"requestType": "NEW_SESSION", "image": {"url": url}})
    return reply["NewSessionId"].split(";")[0], reply["ResponseMetadata"]["HTTPHeaders"][INSTANCE]


def ask_raw(rt, session_id: str, question: str) -> tuple[dict, str]:
    body = {"requestType": "SESSION", "inputs": question, "parameters": SHORT}
    reply = invoke(rt, session_id, body)
    return json.loads(reply["Body"].read()), reply["ResponseMetadata"]["HTTPHeaders"][INSTANCE]


def refused(rt, session_id: str) -> ClientError:
    with pytest.raises(ClientError) as raised:
        ask_raw(rt, session_id, "What shape is it?")
    return raised.value


def probe(rt, session_id: str) -> str:
    """``answered``, or the code of the refusal."""
    try:
        ask_raw(rt, session_id, "What shape is it?")
    except ClientError as error:
        return code_of(error)
    return "answered"


def code_of(error: ClientError) -> str:
    """The endpoint's own code (a header), or, for a container's answer passed on as
    ModelError, the container's."""
    response = error.response
    if response["Error"]["Code"] == "ModelError":
        return json.loads(response["OriginalMessage"])["error"]["code"]
    return response["ResponseMetadata"]["HTTPHeaders"][ERROR_CODE]


def opened_across(rt, images, count: int) -> dict[str, list[str]]:
    """``count`` sessions (a turn each), by the instance holding them; both hold some."""
    held: dict[str, list[str]] = {}
    for i in range(count):
        session_id, instance = open_raw(rt, images.url(i % 2))
        ask_raw(rt, session_id, "What shape is it?")
        held.setdefault(instance, []).append(session_id)
    assert set(held) == {"instance-0", "instance-1"}, held
    return held


def replace_cli(endpoint, instance: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "local_endpoint", "replace", "--instance", instance]
        + ["--run-dir", str(endpoint.run_dir), *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_replaced_instance_loses_its_sessions_and_nothing_else(plain, images):
    """`python -m local_endpoint replace --instance 0`: while it runs, instance-1's sessions
    answer and instance-0's get 503 NOT_READY (until it has stopped) or SESSION_LOST; then its
    disk is empty, its ids are SESSION_LOST, and it takes new sessions."""
    rt = plain.runtime()
    held = opened_across(rt, images, 6)
    victims, bystanders = held["instance-0"], held["instance-1"]
    disks = [plain.run_dir / "persist" / "instance-0", plain.run_dir / "instance-0" / "tmp"]
    for disk in disks:
        disk.mkdir(parents=True, exist_ok=True)
        (disk / "left-by-the-old-instance").write_text("")

    replacing = replace_cli(plain, "0")
    answered_meanwhile, victim_codes = 0, set()
    for _ in range(8):  # a few rounds (each a turn more in those sessions' context)
        if replacing.poll() is not None:
            break
        for session_id in bystanders:
            reply, instance = ask_raw(rt, session_id, "And its color?")
            assert instance == "instance-1" and reply["generation"]["text"]
            answered_meanwhile += 1
        victim_codes.add(probe(rt, victims[0]))  # answered until the replace begins
    said = replacing.communicate(timeout=REPLACE_TIMEOUT_S)[0]
    assert replacing.returncode == 0, said
    assert "instance-0 replaced (graceful)" in said and f"{len(victims)} session(s)" in said
    assert answered_meanwhile >= len(bystanders)  # the endpoint served on meanwhile
    assert victim_codes <= {"answered", "NOT_READY", "SESSION_LOST"}, victim_codes

    for session_id in victims:
        error = refused(rt, session_id)
        assert error.response["Error"]["Code"] == "ValidationError"
        assert code_of(error) == "SESSION_LOST"
        assert "which was replaced" in error.response["Error"]["Message"]
    for disk in disks:
        assert not (disk / "left-by-the-old-instance").exists()
    for session_id in bystanders:
        assert ask_raw(rt, session_id, "Say that again.")[1] == "instance-1"
    fresh = [open_raw(rt, images.url(0)) for _ in range(2)]  # the emptier instance first
    assert {instance for _, instance in fresh} == {"instance-0"}
    for session_id, _ in fresh:
        reply, instance = ask_raw(rt, session_id, "What color is the shape?")
        assert (instance, reply["generation"]["text"]) == ("instance-0", images.samples[0].color)


def test_replacing_an_unknown_instance_is_refused_in_one_line(plain):
    said = replace_cli(plain, "7").communicate(timeout=60)[0]
    assert "404 no replaceable instance 'instance-7'" in said and len(said.splitlines()) == 1


def same_tokens(answer, twin) -> None:
    """Greedy answers to the same history: the same text from the same number of tokens, after
    prompts of the same length (the resumed history is the twin's, token for token)."""
    mine, theirs = answer.reply, twin.reply
    assert answer.text == twin.text
    assert mine["generation"]["generatedTokens"] == theirs["generation"]["generatedTokens"]
    prompt = [r["usage"]["newTokens"] + r["usage"]["cachedTokens"] for r in (mine, theirs)]
    assert prompt[0] == prompt[1]


@pytest.mark.parametrize("kill", [False, True], ids=["graceful", "hardware-fault"])
def test_a_session_whose_instance_is_replaced_goes_on_token_equal(durable, images, kill):
    """Five turns, the instance replaced (its disk and memory gone), then the client's next
    ask: resumed from the durable record on whichever instance, answered as the twin that was
    never interrupted answers. A SIGKILL may leave the record a turn behind: the client asks
    that turn again, and the answers still match."""
    client = LlavaClient(ENDPOINT, runtime=durable.runtime(), recover="resume")
    chat, twin = client.open(images.url(1)), client.open(images.url(1))
    for question in QUESTIONS:
        answer, twin_answer = chat.ask(question, **LONG), twin.ask(question, **LONG)
        same_tokens(answer, twin_answer)
    held = answer.metadata["HTTPHeaders"][INSTANCE]
    assert twin_answer.metadata["HTTPHeaders"][INSTANCE] != held  # the twin is not replaced

    done = durable.replace(held, kill=kill, timeout=REPLACE_TIMEOUT_S)
    assert done["killed"] is kill and done["sessionsLost"] >= 1
    old_id = chat.id
    for question in ["What color is the shape?", "And its shape?"]:
        same_tokens(chat.ask(question, **LONG), twin.ask(question, **LONG))
    assert chat.id != old_id and chat.recoveries == 1
    assert [t.answer for t in chat.history] == [t.answer for t in twin.history]
    assert len(chat.history) == len(QUESTIONS) + 2
    chat.close()
    twin.close()


def test_a_graceful_replace_flushes_the_turns_the_store_had_not_taken(durable, images):
    """The store stalls (moto's server stopped) while turns are asked on instance-0's sessions:
    the turns answer anyway, their records stay dirty. The replace's SIGTERM makes the worker
    flush them (the store answers again as the replace begins), before SageMaker's SIGKILL
    would come: every one of those sessions resumes with all its turns."""
    rt = durable.runtime()
    held = opened_across(rt, images, 6)
    victims = held["instance-0"]
    moto = psutil.Process(json.loads((durable.run_dir / S3_LOCAL_STATE).read_text())["pid"])
    console = durable.run_dir / "instance-0" / "torchserve.out"  # its workers' log lines too
    flushed = console.read_text().count(FLUSHED_ALL)
    moto.send_signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(victims)) as pool:  # answered though the store stalls
            asked = list(pool.map(lambda s: ask_raw(rt, s, "And its color?"), victims))
        assert all(instance == "instance-0" for _, instance in asked)
        with ThreadPoolExecutor(1) as pool:
            replacing = pool.submit(durable.replace, "instance-0", False, REPLACE_TIMEOUT_S)
            deadline = time.monotonic() + 30
            while "instance-0: replacing: stopping it" not in durable.log.read_text():
                assert time.monotonic() < deadline and not replacing.done()
                time.sleep(0.02)
            moto.send_signal(signal.SIGCONT)
            done = replacing.result(timeout=REPLACE_TIMEOUT_S)
    finally:
        moto.send_signal(signal.SIGCONT)
    assert done["sessionsLost"] == len(victims) and done["stoppedS"] < 30
    assert console.read_text().count(FLUSHED_ALL) == flushed + 1  # the old worker's last words
    for session_id in victims:
        assert code_of(refused(rt, session_id)) == "SESSION_LOST"
        reply = invoke(rt, "NEW_SESSION", {"requestType": "NEW_SESSION", "resumeFrom": session_id})
        resumed = json.loads(reply["Body"].read())["resumed"]
        assert resumed == {"from": session_id, "turns": 2, "images": 1}
        new_id = reply["NewSessionId"].split(";")[0]
        assert ask_raw(rt, new_id, "Say that again.")[0]["turns"] == 3


def test_make_stop_stops_the_local_s3_after_the_instances(tmp_path):
    """`make endpoint ENDPOINT_DURABLE_STORE=s3-local` and `make stop`, by their launcher."""
    endpoint = start_endpoint_on_disk(tmp_path, instances=1, durable_store="s3-local")
    try:
        state = json.loads((tmp_path / S3_LOCAL_STATE).read_text())
        worker = psutil.Process(endpoint.instances_started[0].worker_pid())
        settings = worker.environ()
        assert settings["LLAVA_DURABLE_STORE"].startswith("s3://")
        assert settings["AWS_ENDPOINT_URL_S3"] == state["url"]
        assert settings["LLAVA_PERSIST_DIR"] == str(tmp_path / "persist" / "instance-0")
    finally:
        endpoint.stop()
    assert not psutil.pid_exists(state["pid"]) or psutil.Process(state["pid"]).status() == "zombie"
    assert not (tmp_path / S3_LOCAL_STATE).exists()
    assert not (tmp_path / "instance-0" / "tmp").exists()
