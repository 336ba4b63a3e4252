"""Chat about an image through a SageMaker endpoint with sticky sessions (boto3 only).

    client = LlavaClient("stateful-llava", region_name="us-east-1")  # or endpoint_url=...
    with client.open(image="https://example.com/cat.png") as chat:
        print(chat.ask("What is in the picture?").text)
        for text in chat.ask_stream("Describe it in detail."):
            print(text, end="")
        print(chat.ask("And this one?", image="https://example.com/dog.png").text)

The session id is the one the endpoint issues (``NewSessionId``), or the caller's own
(``client.open(image, session_id="ticket-4711")``, with a random part the server adds to an
id under 128 bits: use ``Session.id``); ``client.attach(id)`` continues a session
another process opened. A 503 that says when to retry (the container's ``KV_MEMORY_FULL``, with
``Retry-After``; ``NOT_READY`` while its worker restarts) is sent again after that wait, with
jitter, at most ``busy_retries`` times (0: never); a turn whose worker died under it
(``TURN_INTERRUPTED``) at most once of those. A session lost with its instance (or evicted) is
resumed by default (``recover="resume"``): the server rebuilds it from its durable record
under a new id and the call goes on there, nothing re-asked; where the server cannot (no
durable store, no record), and for a closed or expired session, ``SessionGone`` says how many
turns went with it. With ``recover="replay"`` it is re-opened on the same image instead and its
questions are asked again in order, each with the image its turn sent (hidden latency and
cost: the answers are regenerated, identical under greedy decoding; ``replay_mismatches``
counts those that came out different).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import boto3
from botocore.exceptions import ClientError

from llava_client.errors import (
    LlavaError,
    SessionGone,
    StreamGap,
    from_client_error,
    from_stream_error,
)
from llava_client.images import image_source
from llava_client.jsonlines import JsonLines
from llava_client.limits import request_body
from llava_client.stream_order import stream_gap
from llava_wire import (
    CLOSE_SESSION,
    NEW_SESSION,
    RESUME_REFUSED_CODES,
    SESSION,
    SESSION_CLOSED,
    SESSION_EXPIRED,
    TURN_INTERRUPTED,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
# What a session that is gone does (docs/client.md §The client (`llava_client/`)).
RECOVERY = ("raise", "replay", "resume")
# Gone for good, never resumed: a close deletes the durable record, an expired one is
# refused, and a record the server refused once would be again (docs/client.md §Resuming a
# lost session).
NOT_RESUMABLE = frozenset({SESSION_CLOSED, SESSION_EXPIRED}) | RESUME_REFUSED_CODES
# edit_last's default: the replaced turn's image goes again with the new question.
SAME_IMAGE = object()


@dataclass(frozen=True)
class Answer:
    text: str
    reply: dict  # the container's whole reply: usage (cached/new tokens), timing, expiresAt
    metadata: dict  # boto3's ResponseMetadata: request id, HTTP headers

    @property
    def image_tokens(self) -> int | None:
        """The image tokens this turn prefilled (0 unless it sent an image; None: not said)."""
        return self.reply.get("usage", {}).get("imageTokens")

    @property
    def images(self) -> int | None:
        """The images the session holds with this turn's (None: the reply did not say)."""
        return self.reply.get("usage", {}).get("images")


@dataclass(frozen=True)
class Turn:
    question: str
    answer: str
    parameters: dict
    image: dict | None = None  # the image source this turn sent (a replay sends it again)


class LlavaClient:
    """One SageMaker endpoint. ``runtime``: a ready ``sagemaker-runtime`` client, else one is
    made from ``client_kwargs`` (``region_name``, ``endpoint_url`` for a local endpoint...).

    ``busy_retries``: how many times a call refused with a 503 and a ``Retry-After`` is sent
    again (0 turns it off); each wait is the server's ``Retry-After``, at most
    ``max_retry_wait_s``, stretched by up to half again at random so that callers refused
    together do not all come back at the same instant; ``sleep(seconds)`` waits (a test's
    stand-in records the waits instead).

    ``recover``: what a call does when its session is gone. ``"resume"`` (the default) asks
    the server to rebuild a session that was lost or evicted from its durable record
    (``{"requestType": "NEW_SESSION", "resumeFrom": <old id>}``), takes the new id and sends
    the call again there: the history is the server's, nothing is re-asked (but the turns the
    record had not caught up with, when this object asked them) and nothing is regenerated;
    a closed or expired session, or one the server cannot resume (no durable store there:
    ``DURABLE_STORE_OFF``; a record missing, expired, corrupt or another model's), raises
    ``SessionGone`` as ``"raise"`` does. ``"raise"`` raises ``SessionGone`` at once.
    ``"replay"`` re-opens it on its image and asks its questions again first, each with the
    image its turn sent (hidden decoding, answers regenerated).

    Why ``"resume"`` by default: it costs one prefill on the server and changes nothing the
    caller sees; against a server without a store it costs one refused call and ends where
    ``"raise"`` does, so it never hides a regeneration (the reason replay is not the default)."""

    def __init__(
        self,
        endpoint_name: str,
        runtime=None,
        recover: str = "resume",
        busy_retries: int = 3,
        max_retry_wait_s: float = 10.0,
        sleep: Callable[[float], object] = time.sleep,
        **client_kwargs,
    ):
        if busy_retries < 0 or max_retry_wait_s < 0:
            raise ValueError("busy_retries and max_retry_wait_s must be >= 0")
        if recover not in RECOVERY:
            raise ValueError(f"recover must be one of {', '.join(RECOVERY)}, not {recover!r}")
        self.endpoint_name = endpoint_name
        self.runtime = runtime or boto3.client("sagemaker-runtime", **client_kwargs)
        self.recover = recover
        self.busy_retries = busy_retries
        self.max_retry_wait_s = max_retry_wait_s
        self._sleep = sleep
        self.busy_retried = 0  # calls sent again after a 503 with Retry-After, in all

    def open(
        self,
        image: Any = None,
        session_id: str | None = None,
        system: str | None = None,
        tenant: str | None = None,
    ) -> Session:
        """Open a session on ``image`` (URL, ``s3://`` URI, bytes, file path, PIL image, None).

        ``session_id``: your own id for it (SageMaker's pattern, at most 256 characters); the
        server refuses one that is live or was used recently, and adds "-" and a random part to
        one under 128 bits (the session's ``id`` is the full one; docs/wire.md §Session ids are
        bearer secrets). By default the server picks one.
        ``system``: the session's system prompt (by default the server's ``system_prompt``).
        ``tenant``: the backend's tenant key, sent as ``tenant=<key>`` in SageMaker's custom
        attributes: sessions of different tenants share nothing (docs/security.md §What
        sessions share).
        """
        source = image_source(image)
        opened = self._open(source, session_id, system, tenant)
        return Session(self, *opened, source, system, tenant=tenant)

    def attach(
        self, session_id: str, expires_at: str | None = None, tenant: str | None = None
    ) -> Session:
        """The session ``session_id``, opened by another process (another web worker of the
        same backend): ask, stream, rewind and close it from here. Nothing is sent until its
        first call. A resume needs only the id (``tenant``: its open's, sent with the resume
        as ``open`` sends it), so with ``recover="resume"`` a lost one goes on under a new id
        (``Session.id``: share it with the other workers); its image and earlier turns are
        unknown here, so it is never replayed."""
        return Session(self, session_id, expires_at, image=None, attached=True, tenant=tenant)

    def _open(
        self,
        source: dict | None,
        session_id: str | None = None,
        system: str | None = None,
        tenant: str | None = None,
    ) -> tuple[str, str]:
        body = {"requestType": NEW_SESSION} | ({"image": source} if source else {})
        if session_id is not None:
            body["extSessionID"] = session_id
        if system is not None:
            body["system"] = system
        return _announced(self._invoke(body, NEW_SESSION, **_tenant_attributes(tenant)))

    def _resume(self, from_session_id: str, tenant: str | None) -> tuple[str, str, dict]:
        """A new session rebuilt from ``from_session_id``'s durable record, on whichever
        instance the open lands (docs/client.md §Resuming a lost session): its id, its expiry
        and the reply's ``resumed`` ({"from", "turns", "images"})."""
        body = {"requestType": NEW_SESSION, "resumeFrom": from_session_id}
        reply = self._invoke(body, NEW_SESSION, **_tenant_attributes(tenant))
        session_id, expires = _announced(reply)
        payload = json.loads(reply["Body"].read())
        return session_id, expires, payload.get("resumed") or {}

    def _invoke(self, body: dict, session_id: str, **options: str) -> dict:
        payload = request_body(body)  # too large for SageMaker: refused before any call
        return self._retrying_busy(
            lambda: self.runtime.invoke_endpoint(
                EndpointName=self.endpoint_name,
                SessionId=session_id,
                ContentType="application/json",
                Accept="application/json",
                Body=payload,
                **options,
            ),
            with_session=session_id != NEW_SESSION,
        )

    def _stream(self, body: dict, session_id: str):
        payload = request_body(body)
        reply = self._retrying_busy(
            lambda: self.runtime.invoke_endpoint_with_response_stream(
                EndpointName=self.endpoint_name,
                SessionId=session_id,
                ContentType="application/json",
                Body=payload,
            ),
            with_session=True,
        )
        return reply["Body"]

    def _retrying_busy(self, call: Callable[[], T], with_session: bool) -> T:
        """``call()``; a refusal that says when to retry is retried (a stream's too: a busy
        turn is refused before its first token, docs/client.md §Client retries on 503)."""
        attempt, interrupted = 0, 0
        while True:
            try:
                return call()
            except ClientError as err:
                error = from_client_error(err, with_session)
                # A turn its worker died under is sent again once: the session goes on from
                # its last answered turn on the restarted worker (docs/engine/sessions.md
                # §Persistent tier).
                interrupted += error.code == TURN_INTERRUPTED
                if error.retry_after_s is None or attempt == self.busy_retries or interrupted > 1:
                    raise error from err
            attempt += 1
            self.busy_retried += 1
            wait = min(error.retry_after_s, self.max_retry_wait_s) * random.uniform(1.0, 1.5)
            logger.info("%s: retry %d in %.2f s", error.code, attempt, wait)
            self._sleep(wait)


class Session:
    """A conversation about its open's image and any a turn sends; not thread-safe (its turns
    are sequential anyway)."""

    def __init__(
        self,
        client: LlavaClient,
        session_id: str,
        expires_at: str,
        image: dict | None,
        system: str | None = None,
        attached: bool = False,
        tenant: str | None = None,
    ):
        self.client = client
        self.id = session_id
        self.expires_at = expires_at
        self.history: list[Turn] = []  # the turns asked through this object that the session holds
        # the turns the session holds, as its last reply said (an attached one's: unknown yet)
        self.turns: int | None = None if attached else 0
        self.recoveries = 0
        self.replay_mismatches = 0
        self.closed = False
        self._image, self._system, self._tenant = image, system, tenant  # to re-open on recovery
        self._attached = attached  # opened elsewhere: its image is its opener's, never replayed

    def ask(
        self, question: str, *, image: Any = None, rewind_turns: int = 0, **parameters
    ) -> Answer:
        """Ask and wait for the whole answer (``parameters``: max_new_tokens, temperature...).
        ``image``: another image for the session, placed before this question (the forms
        ``LlavaClient.open`` takes: URL, ``s3://``, bytes, file path, PIL image; at most the
        server's ``max_images_per_session`` in a session, its open's included).
        ``rewind_turns``: drop the session's last N turns first (see ``edit_last``)."""
        return self._ask_source(question, image_source(image), rewind_turns, parameters)

    def regenerate(self, **parameters) -> Answer:
        """Answer the last question again, as if its first answer had never been given (with
        sampling parameters, or after a sampled answer went astray)."""
        if not self.history:
            raise ValueError(
                f"no question was asked through this object in session {self.id}: "
                "use edit_last(question) to ask one in place of the session's last"
            )
        last = self.history[-1]  # its image went with its turn: it is sent again
        return self._ask_source(last.question, last.image, 1, parameters)

    def edit_last(self, question: str, *, image: Any = SAME_IMAGE, **parameters) -> Answer:
        """Ask ``question`` in place of the last question: its turn is dropped first, with any
        image it sent; that image is sent again with ``question`` unless ``image`` says
        another (``None``: none)."""
        if image is not SAME_IMAGE:
            return self.ask(question, image=image, rewind_turns=1, **parameters)
        last = self.history[-1].image if self.history else None
        return self._ask_source(question, last, 1, parameters)

    def ask_stream(
        self, question: str, *, image: Any = None, rewind_turns: int = 0, **parameters
    ) -> Iterator[str]:
        """Ask and yield the answer's text as it arrives (InvokeEndpointWithResponseStream);
        ``image`` as ``ask`` takes it.

        Lines lost on the way (their numbers skip) raise ``StreamGap`` once the stream ends:
        nothing after the gap is yielded, and the error carries the whole answer, which the
        session holds like any other."""
        source = image_source(image)
        body = _ask_body(question, parameters, rewind_turns, source) | {"stream": True}
        events = self._recovering(lambda: self.client._stream(body, self._live_id()))
        lines, final, received, gap = JsonLines(), None, 0, None
        try:
            for event in events:
                for line in lines.feed(event.get("PayloadPart", {}).get("Bytes", b"")):
                    if "error" in line:
                        raise from_stream_error(line)
                    gap = gap or stream_gap(line, received)
                    received += 1
                    if "token" not in line:
                        final = line
                    elif line["token"]["text"] and gap is None:
                        yield line["token"]["text"]
        except ClientError as err:  # a ModelStreamError event: the stream broke midway
            raise from_client_error(err, with_session=True) from err
        lines.close()
        if final is None:
            raise LlavaError("STREAM_INCOMPLETE", "the stream ended without the final reply")
        text = final["generation"]["text"]
        self._record(Turn(question, text, parameters, source), rewind_turns, final)
        if gap is not None:
            raise StreamGap(f"{gap}; the text yielded stops there, this error's is whole", text)

    def close(self) -> None:
        """End the session and free its memory on the server; closing twice is fine."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(SessionGone):  # already gone: nothing left to free
            self.client._invoke({"requestType": CLOSE_SESSION}, self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _ask_source(
        self, question: str, source: dict | None, rewind_turns: int, parameters: dict
    ) -> Answer:
        """``ask`` with an image source already made (a recorded turn's)."""
        answer = self._recovering(
            lambda: self._ask_once(question, parameters, rewind_turns, source)
        )
        self._record(Turn(question, answer.text, parameters, source), rewind_turns, answer.reply)
        return answer

    def _ask_once(
        self,
        question: str,
        parameters: dict,
        rewind_turns: int = 0,
        image: dict | None = None,
    ) -> Answer:
        body = _ask_body(question, parameters, rewind_turns, image)
        reply = self.client._invoke(body, self._live_id())
        payload = json.loads(reply["Body"].read())
        return Answer(payload["generation"]["text"], payload, reply["ResponseMetadata"])

    def _record(self, turn: Turn, rewind_turns: int, reply: dict) -> None:
        """The session dropped its last ``rewind_turns`` turns, then took ``turn``."""
        if rewind_turns:
            del self.history[max(len(self.history) - rewind_turns, 0) :]
        self.history.append(turn)
        self.turns = reply.get("turns", self.turns)
        self.expires_at = reply.get("expiresAt", self.expires_at)

    def _live_id(self) -> str:
        if self.closed:
            raise SessionGone(SESSION_CLOSED, f"session {self.id} was closed by this client")
        return self.id

    def _recovering(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except SessionGone as gone:
            if self.closed:
                raise
            if self.client.recover == "resume" and gone.code not in NOT_RESUMABLE:
                self._resume(gone)
                return call()
            if self.client.recover != "replay" or self._attached:
                raise self._what_was_lost(gone) from gone
            logger.warning("session %s is gone (%s): re-opening and replaying", self.id, gone)
            self._reopen()
            return call()

    def _what_was_lost(self, gone: SessionGone, refused: LlavaError | None = None) -> SessionGone:
        turns = self.turns if self.turns is not None else "its"
        how = (
            "it was attached, so only its opener knows its image"
            if self._attached
            else 'LlavaClient(recover="replay") re-opens it and asks its questions again'
        )
        if refused is not None:
            why = f"; resuming it failed: {refused}"
        elif gone.code in RESUME_REFUSED_CODES:
            why = "; the server refused its durable record, so it cannot be resumed"
        elif self.client.recover == "resume" and gone.code in NOT_RESUMABLE:
            why = "; a closed or expired session is not resumed"
        else:
            why = ""
        lost = SessionGone(
            gone.code,
            f"{gone.message}; session {self.id} is gone with {turns} turns{why}: open a new "
            f"session ({how})",
            gone.status,
        )
        lost.session_id, lost.turns, lost.history = self.id, self.turns, tuple(self.history)
        lost.resume_error = refused
        return lost

    def _resume(self, gone: SessionGone) -> None:
        """Rebuilt by the server from its durable record under a new id; ``SessionGone`` with
        ``gone``'s code when the server cannot (docs/client.md §Resuming a lost session)."""
        try:
            self.id, self.expires_at, resumed = self.client._resume(self.id, self._tenant)
        except LlavaError as refused:
            raise self._what_was_lost(gone, refused) from refused
        logger.warning("session gone (%s): resumed from its durable record", gone.code)
        self.recoveries += 1
        self._catch_up(resumed.get("turns"))

    def _catch_up(self, held: int | None) -> None:
        """The resumed session holds ``held`` turns. Its record is written behind the turns
        (at most one behind, lost only when the instance died before writing it): the turns it
        lacks are asked again, in order, when this object asked them all (their answers
        regenerated, ``replay_mismatches`` counts those that differ); otherwise the session
        goes on without them and ``history`` is emptied (an attached session's case)."""
        if held is None:  # the reply did not say: the record is taken as whole
            return
        missing = 0 if self.turns is None else self.turns - held
        self.turns = held
        if missing <= 0:
            return
        lagging = self.history[-missing:] if missing <= len(self.history) else []
        del self.history[-missing:]  # all of it when more are missing than it holds
        logger.warning(
            "the resumed session lacks its last %d turn(s): %d asked again", missing, len(lagging)
        )
        for turn in lagging:
            answer = self._ask_once(turn.question, turn.parameters, image=turn.image)
            self.replay_mismatches += answer.text != turn.answer
            again = Turn(turn.question, answer.text, turn.parameters, turn.image)
            self._record(again, 0, answer.reply)

    def _reopen(self) -> None:
        self.id, self.expires_at = self.client._open(
            self._image, system=self._system, tenant=self._tenant
        )
        replayed = []
        for turn in self.history:  # each with the image its turn sent
            answer = self._ask_once(turn.question, turn.parameters, image=turn.image)
            self.replay_mismatches += answer.text != turn.answer
            replayed.append(Turn(turn.question, answer.text, turn.parameters, turn.image))
        self.history, self.turns = replayed, len(replayed)  # what the new session now holds
        self.recoveries += 1


def _ask_body(
    question: str, parameters: dict, rewind_turns: int = 0, image: dict | None = None
) -> dict:
    body = {"requestType": SESSION, "inputs": question}
    if image is not None:
        body["image"] = image
    if parameters:
        body["parameters"] = parameters
    if rewind_turns:
        body["rewind_turns"] = rewind_turns
    return body


def _tenant_attributes(tenant: str | None) -> dict[str, str]:
    """An open's tenant, as SageMaker's custom attributes carry it (a resume sends it too)."""
    return {} if tenant is None else {"CustomAttributes": f"tenant={tenant}"}


def _announced(reply: dict) -> tuple[str, str]:
    """The new session's id and expiry from an open's ``NewSessionId`` (``<id>; Expires=…``)."""
    announced = reply.get("NewSessionId")
    if not announced:
        raise LlavaError(
            "NO_SESSION", "the endpoint started no session (no NewSessionId): is it stateful?"
        )
    session_id, _, expires = announced.partition(";")
    return session_id.strip(), expires.strip().removeprefix("Expires=")
