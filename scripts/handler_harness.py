"""The real handler called in-process, with TorchServe's own ``Context`` and metrics cache but
no frontend: what the handler itself answers and costs, for benchmarks and tests.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import struct
import uuid
from dataclasses import dataclass

import ts
from ts.context import Context, RequestProcessor
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

from handlers.metrics import SessionMetrics
from handlers.service import LlavaService
from llava.engine import Engine
from llava.shards import ShardedEngine

# The metrics file a TorchServe 0.12 worker is started with.
TS_METRICS_YAML = os.path.join(os.path.dirname(ts.__file__), "configs", "metrics.yaml")


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    text: str
    head: dict[str, str] | None = None  # the headers the first streamed frame carried

    def json(self):
        return json.loads(self.text)


class InProcessWorker:
    """One worker's LlavaService, with its engine's settings; ``invoke`` is one request of a
    batch of one. An ``Engine`` is served as the worker's one shard."""

    def __init__(self, engine: Engine | ShardedEngine, intake: dict | None = None):
        metrics = MetricsCacheYamlImpl(config_file_path=TS_METRICS_YAML)
        metrics.initialize_cache()
        self.context = Context("llava", ".", {}, 1, None, ts.__version__, metrics=metrics)
        self.context.cl_socket = self.sent = _SentFrames()
        if isinstance(engine, Engine):
            engine = ShardedEngine([engine])
        config = engine.shards[0].config
        if intake is not None:
            config = dataclasses.replace(config, intake=intake)
        self.service = LlavaService(engine, config, SessionMetrics(metrics))

    def request_context(self, headers: dict[str, str] | None = None) -> Context:
        """A context for one request, as TorchServe's async mode gives each its own copy."""
        context = copy.copy(self.context)
        context.request_processor = [RequestProcessor(headers or {})]
        context.request_ids = {0: str(uuid.uuid4())}
        return context

    def invoke(self, body, headers: dict[str, str] | None = None) -> Reply:
        """``body`` as TorchServe hands it over: parsed JSON (a JSON content type) or bytes."""
        context = self.request_context(headers)
        self.sent.bodies.clear()
        self.sent.heads.clear()
        final = self.service.serve(0, body, context)
        status, _phrase = context.get_response_status(0)
        text = b"".join(self.sent.bodies).decode() + final  # chunks (a 200's body), then final
        head = self.sent.heads[0] if self.sent.heads else None
        return Reply(status, context.get_response_headers(0), text, head)

    def stop(self) -> None:
        self.service.reaper.stop()


class _SentFrames:
    """The worker socket: keeps the body of every frame sent (one request per frame)."""

    def __init__(self):
        self.bodies: list[bytes] = []
        self.heads: list[dict[str, str]] = []

    def sendall(self, frame: bytes) -> None:
        head, body = _frame(bytes(frame))
        self.heads.append(head)
        self.bodies.append(body)


def _frame(frame: bytes) -> tuple[dict[str, str], bytes]:
    """The headers and body of a one-request frame
    (ts.protocol.otf_message_handler.create_predict_response): code, message, then request id,
    content type, status, phrase, headers, body."""
    at = 4  # the batch's code

    def sized() -> bytes:
        nonlocal at
        (size,) = struct.unpack_from("!i", frame, at)
        at += 4 + size
        return frame[at - size : at]

    sized(), sized(), sized()  # message, request id, content type
    at += 4  # status
    sized()  # phrase
    (count,) = struct.unpack_from("!i", frame, at)
    at += 4
    headers = {}
    for _ in range(count):
        name = sized().decode()
        headers[name] = sized().decode()
    return headers, sized()
