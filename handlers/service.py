"""The requests of one worker: parse, dispatch to ``llava.Engine``, shape the reply.

``LlavaService.serve`` handles one request, blocking, in a thread of its own (the async entry
point, handlers/llava_handler.py, runs each request in its pool): the wait on the engine and
on the image fetch and decode (on threads of their own, llava.intake.loader) happen there,
never on TorchServe's event loop (docs/architecture.md §Architecture).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from ts.handler_utils.utils import send_intermediate_predict_response

from handlers.chat_protocol import ChatBody, is_chat
from handlers.chat_replies import ChatChunks, Completion, completion
from handlers.errors import error_response, openai_error
from handlers.metrics import SessionMetrics
from handlers.protocol import (
    AskSession,
    CancelTurn,
    ChatCompletion,
    CloseSession,
    OpenSession,
    parse_body,
    parse_request,
    session_header_value,
)
from handlers.token_stream import LineFormat, TokenStream
from handlers.turns import TurnsInFlight
from llava.config import EngineConfig, SettingsError, load_config, setting_source
from llava.engine import Answer
from llava.intake import IntakePolicy
from llava.intake.loader import ImageLoader
from llava.sched.conversation import ChatImage, ChatTurn, Conversation
from llava.sessions.reaper import Reaper
from llava.sessions.store import full_session_id
from llava.shards import ShardedEngine
from llava_wire import CLOSED_SESSION_HEADER, NEW_SESSION_HEADER, SESSION_HEADER

logger = logging.getLogger(__name__)
JSON = "application/json"
JSON_LINES = "application/jsonlines"
EVENT_STREAM = "text/event-stream"  # the chat-completions API's stream


class LlavaService:
    def __init__(self, engine: ShardedEngine, config: EngineConfig, metrics: SessionMetrics):
        self.engine = engine
        self.config = config  # what the handler sizes its request threads from
        self.images = ImageLoader(IntakePolicy.from_mapping(config.intake), config.image_workers)
        self.metrics = metrics
        self.turns = TurnsInFlight()
        # Expired sessions are freed, and the gauges follow, with no request arriving.
        self.reaper = Reaper(engine, on_reap=lambda _count: self.publish()).start()

    @classmethod
    def from_context(cls, context) -> LlavaService:
        archived = (context.model_yaml_config or {}).get("handler", {})
        # Every setting is checked before anything loads: a bad one fails the start with one
        # line (SettingsError) that serving/torchserve.py shows at once.
        # One engine shard per device (docs/engine/scheduling.md §Engine shards): TorchServe's
        # gpu_id is not used, this one worker drives every device its setting names.
        config = load_config(archived, os.environ, context.system_properties["model_dir"])
        try:  # the devices, memory and attention settings are checked against this machine
            engine = ShardedEngine.from_config(config)
            warm_s = engine.warm_up()  # a forced flex attention that fails: SettingsError
        except SettingsError as e:
            raise e.from_source(setting_source(e.setting, os.environ)) from None
        logger.info(
            "loaded %s on %s (%s); warm-up %.2f s",
            config.model_dir,
            ", ".join(str(shard.loaded.device) for shard in engine.shards),
            engine.shards[0].loaded.dtype,
            warm_s,
        )
        return cls(engine, config, SessionMetrics(context.metrics))

    def serve(self, idx: int, body, context) -> str:
        """The reply to request ``idx``: what TorchServe sends as the final response."""
        reply = _Reply(context, idx)
        chat = False  # a chat-completions body: its errors in OpenAI's shape
        try:
            reply.content_type(JSON)
            payload = parse_body(body)
            chat = is_chat(payload)
            request = parse_request(payload, context.get_all_request_header(idx) or {})
            if isinstance(request, ChatCompletion):
                payload = self._chat(request, reply)
            elif isinstance(request, OpenSession):
                payload = self._open(request, reply)
            elif isinstance(request, CloseSession):
                payload = self._close(request, reply)
            elif isinstance(request, CancelTurn):
                payload = self._cancel(request)
            else:
                payload = self._ask(request, reply)
        except Exception as exc:  # every failure becomes a JSON error; the worker lives on
            error = error_response(exc)
            if chat:
                error = openai_error(error, getattr(exc, "param", None))
            payload = error.payload
            if not reply.streaming:  # once streaming, headers are gone: the last line says it
                reply.status(error.status)
                reply.content_type(JSON)
                for name, value in error.headers.items():
                    reply.header(name, value)
        self.publish()
        return reply.finish(payload)

    def publish(self) -> None:
        """Gauges from every shard's totals (after every request, and from the reaper)."""
        _metrics_never_fail(lambda: self.metrics.store(self.engine.stats()))

    def _open(self, request: OpenSession, reply: _Reply) -> dict:
        if request.resume_from is not None:  # docs/wire.md §Resuming a session
            opened = self.engine.resume(request.resume_from, request.session_id, request.tenant)
        else:
            image = None
            if request.image is not None:
                image = self.images.load(request.image, fit=self.engine.image_side)
            opened = self.engine.open(image, request.session_id, request.system, request.tenant)
        _announce(reply, opened.session_id, opened.expires_at)
        payload = {
            "sessionId": opened.session_id,
            "expiresAt": _iso(opened.expires_at),
            "imageTokens": opened.image_tokens,
            "prefillTokens": opened.prefill_tokens,
            "usage": {"newTokens": opened.prefill_tokens, "cachedTokens": opened.cached_tokens},
        }
        if opened.resumed is not None:
            resumed = opened.resumed
            payload["resumed"] = {
                "from": resumed.from_session_id,
                "turns": resumed.turns,
                "images": resumed.images,
            }
        return payload

    def _close(self, request: CloseSession, reply: _Reply) -> dict:
        """Idempotent: a session already closed, expired or evicted is acknowledged too, so
        the router drops its binding; ``alreadyGone`` says why it was gone (or null)."""
        already_gone = self.engine.close(request.session_id)
        reply.header(CLOSED_SESSION_HEADER, request.session_id)
        return {"sessionId": request.session_id, "closed": True, "alreadyGone": already_gone}

    def _cancel(self, request: CancelTurn) -> dict:
        """Sent by the front or the local endpoint when a client hung up mid-stream."""
        cancelled = self.turns.cancel(request.session_id)
        return {"sessionId": request.session_id, "cancelledTurns": cancelled}

    def _ask(self, request: AskSession, reply: _Reply) -> dict:
        # A turn's image is fetched and decoded before the engine sees the turn: a fetch that
        # fails answers the intake's error and the session stays as it was (docs/wire.md
        # §Images on a turn).
        image = None
        if request.image is not None:
            image = self.images.load(request.image, fit=self.engine.image_side)
        on_token = None
        if request.stream:
            reply.content_type(JSON_LINES)
            on_token = reply.send_token
        with self.turns.track(request.session_id) as cancelled:
            answer = self.engine.ask(
                request.session_id,
                request.question,
                request.parameters,
                on_token,
                cancelled=cancelled.is_set,
                rewind_turns=request.rewind_turns,
                image=image,
            )
        _metrics_never_fail(lambda: self.metrics.turn(answer))
        return _answer_payload(answer)

    def _chat(self, request: ChatCompletion, reply: _Reply) -> dict:
        """A chat-completions body: its images fetched but for those the session holds
        (``images_to_fetch``), then the engine's ``chat`` (docs/wire.md §Chat completions).
        A new session's id is chosen here, so that a stream's head can announce it (headers
        set after the first chunk are lost) and a hang-up can cancel it."""
        body = request.body
        new_id = full_session_id(None) if request.new_session else None
        session_id = new_id or request.session_id
        conversation = self._conversation(body, None if new_id else session_id)
        shape = Completion(body.model)
        on_token = None
        if body.stream:
            reply.content_type(EVENT_STREAM)
            reply.lines = ChatChunks(shape, body.include_usage)
            on_token = self._announcing(reply, new_id)
        options = dict(tenant=request.tenant, new_session=new_id is not None)
        parameters = body.parameters
        if session_id is None:
            answer = self.engine.chat(conversation, None, parameters, on_token, **options)
        else:
            with self.turns.track(session_id) as cancelled:
                answer = self.engine.chat(
                    conversation,
                    session_id,
                    parameters,
                    on_token,
                    cancelled=cancelled.is_set,
                    **options,
                )
        _metrics_never_fail(lambda: self.metrics.turn(answer))
        if body.stream and not reply.streaming:  # no token came: the stream still starts
            on_token("", None)
        if new_id is not None and not reply.streaming:
            _announce(reply, new_id, answer.expires_at)
        session = {}
        if session_id is not None:
            session = {"session_id": answer.session_id, "expires_at": _iso(answer.expires_at)}
        return completion(shape, answer, session)

    def _announcing(self, reply: _Reply, new_id: str | None) -> Callable[[str, int | None], None]:
        """``reply.send_token``, announcing a new session in the stream's head: its expiry
        then is the TTL from now (the session's idle clock starts at its commit, a little
        later)."""

        def on_token(text: str, token_id: int | None) -> None:
            if new_id is not None and not reply.streaming:
                expires_at = datetime.now(UTC) + timedelta(seconds=self.config.session_ttl_s)
                _announce(reply, new_id, expires_at)
            reply.send_token(text, token_id)

        return on_token

    def _conversation(self, body: ChatBody, session_id: str | None) -> Conversation:
        """The body's conversation, with the images the session does not hold loaded."""
        named = tuple(
            ChatTurn(t.question, tuple(ChatImage(i.ref) for i in t.images), t.answer)
            for t in body.turns
        )
        conversation = Conversation(named, body.system)
        sources = [image.source for turn in body.turns for image in turn.images]
        loaded = {
            index: self.images.load(sources[index], fit=self.engine.image_side)
            for index in self.engine.images_to_fetch(conversation, session_id)
        }
        return conversation.with_images(loaded)


class _Reply:
    """Headers, status and streamed chunks of one request."""

    def __init__(self, context, idx: int):
        self.context = context
        self.idx = idx
        self.code = 200
        self.lines: LineFormat | None = None  # a streamed reply's lines (default: JSON lines)
        self._stream: TokenStream | None = None  # from the first token on

    @property
    def streaming(self) -> bool:
        """A token line is on its way: status and headers are fixed, the stream must end."""
        return self._stream is not None

    def header(self, name: str, value: str) -> None:
        self.context.set_response_header(self.idx, name, value)

    def content_type(self, value: str) -> None:
        self.context.set_response_content_type(self.idx, value)

    def status(self, code: int) -> None:
        self.code = code
        self.context.set_response_status(code, "", self.idx)

    def send_token(self, text: str, token_id: int | None) -> None:
        """The engine's ``on_token`` (its loop thread): queued, sent by the stream's thread."""
        if self._stream is None:
            self._stream = TokenStream(self._send, self.lines)
        self._stream.token(text, token_id)

    def finish(self, payload: dict) -> str:
        """What to return as the final reply: a stream's last line, numbered after its tokens
        once they are all out, or ``payload`` whole.

        TorchServe 0.12 in async mode drops a request from its frontend's job table only on a
        reply marked as the end of a stream; a plain 200 stays there for ever, holding its
        request (docs/serving.md §TorchServe 0.12 facts). So a 200 goes out as one chunk and
        the final reply is empty. Not an error: the frontend closes the client's connection
        after a streamed head with a status >= 400.
        """
        if self._stream is not None:
            return self._stream.end(payload)
        body = json.dumps(payload)
        if self.code >= 400:
            return body
        self._send(body)
        return ""

    def _send(self, chunk: str) -> None:
        send_intermediate_predict_response(
            [chunk], self.context.request_ids, "Intermediate response", 200, self.context
        )


def _metrics_never_fail(emit: Callable[[], None]) -> None:
    """A request (or the reaper) never fails because its metrics could not be published."""
    try:
        emit()
    except Exception:
        logger.exception("publishing session metrics failed")


def _announce(reply: _Reply, session_id: str, expires_at: datetime) -> None:
    """A new session's headers, as an open's (SageMaker binds the id to this instance)."""
    value = session_header_value(session_id, expires_at)
    reply.header(SESSION_HEADER, value)
    reply.header(NEW_SESSION_HEADER, value)


def _iso(moment) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _answer_payload(answer: Answer) -> dict:
    return {
        "sessionId": answer.session_id,
        "generation": {
            "text": answer.text,
            "finished": answer.finished,
            "finishReason": answer.stop_reason,
            "generatedTokens": len(answer.token_ids),
        },
        "usage": {
            "newTokens": answer.new_tokens,
            "cachedTokens": answer.cached_tokens,
            "tier": answer.tier.value,
            "imageTokens": answer.image_tokens,  # this turn's image tokens among newTokens
            "images": answer.images,  # the session's images with this turn's
        },
        "timing": {
            "ttftMs": round(answer.ttft_s * 1000, 2),
            "totalMs": round(answer.total_s * 1000, 2),
        },
        "turns": answer.turns,
        "expiresAt": _iso(answer.expires_at),
    }
