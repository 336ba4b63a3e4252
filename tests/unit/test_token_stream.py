"""A streamed answer's lines: numbered, in order, never sent from the engine's loop thread, and
coalesced into one chunk while a send is in progress (handlers/token_stream.py)."""

from __future__ import annotations

import json
import threading

from handlers.token_stream import TokenStream
from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.budget import MemoryBudget
from scripts.handler_harness import InProcessWorker

WAIT_S = 10


class GatedSocket:
    """Records every chunk and its thread; the first send waits for ``gate``."""

    def __init__(self):
        self.chunks: list[str] = []
        self.threads: set[str] = set()
        self.gate, self.first_send_started = threading.Event(), threading.Event()

    def send(self, chunk: str) -> None:
        self.threads.add(threading.current_thread().name)
        if not self.chunks:
            self.first_send_started.set()
            assert self.gate.wait(WAIT_S)
        self.chunks.append(chunk)


def lines(chunks: list[str]) -> list[dict]:
    return [json.loads(line) for chunk in chunks for line in chunk.splitlines()]


def test_tokens_queued_during_a_send_go_out_as_one_chunk_numbered_in_order():
    socket = GatedSocket()
    stream = TokenStream(socket.send)
    stream.token("a", 1)
    assert socket.first_send_started.wait(WAIT_S)
    for i in range(2, 50):  # the first send is stuck: these queue without waiting
        stream.token(f"t{i}", i)
    socket.gate.set()
    last = json.loads(stream.end({"generation": {"text": "whole"}}))
    assert len(socket.chunks) == 2  # the first token, then everything queued behind it
    sent = lines(socket.chunks)
    assert [line["seq"] for line in sent] == list(range(49))
    assert [line["token"]["id"] for line in sent] == list(range(1, 50))
    assert last == {"generation": {"text": "whole"}, "seq": 49}
    assert socket.threads == {"token-stream"}  # never the caller's (the engine loop's) thread


def test_a_token_line_starts_with_its_token_so_fronts_still_tell_it_from_the_last_line():
    """serving/interrupted.py ``StreamEnd`` knows a token line by its head ``{"token"``."""
    socket = GatedSocket()
    socket.gate.set()
    stream = TokenStream(socket.send)
    stream.token("x", 7)
    stream.end({})
    assert socket.chunks == ['{"token": {"id": 7, "text": "x"}, "seq": 0}\n']


def test_a_stream_with_no_token_left_ends_at_once_and_a_broken_socket_ends_it_too():
    def broken(chunk: str) -> None:
        raise BrokenPipeError("frontend gone")

    stream = TokenStream(broken)
    stream.token("a", 1)
    stream.token("b", 2)  # the sender may have died already: still queued, never raises
    assert json.loads(stream.end({"error": {"code": "X"}})) == {"error": {"code": "X"}, "seq": 2}


def test_a_streamed_ask_through_the_handler_numbers_every_line_and_its_last(demo_model):
    engine = Engine(demo_model, EngineConfig(model_dir="-"), MemoryBudget(1 << 30))
    worker = InProcessWorker(engine)
    try:
        session_id = worker.invoke({"requestType": "NEW_SESSION"}).json()["sessionId"]
        ask = {"requestType": "SESSION", "inputs": "Hi", "stream": True}
        reply = worker.invoke(
            {**ask, "parameters": {"max_new_tokens": 20, "min_new_tokens": 20}},
            {"X-Amzn-SageMaker-Session-Id": session_id},
        )
    finally:
        worker.stop()
    *tokens, final = [json.loads(line) for line in reply.text.splitlines()]
    assert [line["seq"] for line in tokens] == list(range(len(tokens)))
    assert final["seq"] == len(tokens) >= final["generation"]["generatedTokens"] == 20
    assert "".join(line["token"]["text"] for line in tokens) == final["generation"]["text"]
