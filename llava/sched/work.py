"""What the engine loop runs for one request: an opening prefill, or a question's turn.

Each request takes its session's lease when the loop admits it (llava.sessions.lease: the
session, its KV blocks, in one call), feeds its ids to the steps the scheduler plans, and ends
by committing the lease (``finish``) or aborting it (``fail``); either way its caller's future
is resolved exactly once. Prompts, chunks, the choice of ids, detokenizing and the futures are
this module's; the session's state is the lease's. A turn commits exactly
as a turn alone did: canonical prompt, cache reuse by common prefix, no end token in the
history, and a failure demotes its session but leaves its history
(docs/engine/prompt-fidelity.md §Canonical prompt; docs/engine/scheduling.md §Engine loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime

import torch

from llava.errors import InvalidRequest, SessionChanged
from llava.exec.runner import StepInput
from llava.kv.holding import Tier
from llava.kv.memory import Shortfall
from llava.model.prompt import (
    ChatPrompt,
    assistant_message,
    images_shown,
    opening_messages,
    questions_asked,
    user_message,
    without_last_turns,
)
from llava.sampling.chooser import Chooser
from llava.sampling.detokenizer import Detokenizer
from llava.sampling.params import GenerationParams
from llava.sampling.stop_text import StopText
from llava.sched.conversation import Conversation, held_refs, images_kept, system_of
from llava.sessions.lease import AddedImage, Leases, OpeningLease, TurnLease, TurnPrompt
from llava.sessions.session import Session


@dataclass(frozen=True)
class RequestContext:
    """What a request may use: no engine, so requests and the engine do not import each
    other; the session's state only through ``leases`` (llava.sessions.lease)."""

    leases: Leases
    prompt: ChatPrompt
    tokenizer: object
    eos_token_ids: frozenset[int]
    banned_ids: object  # llava.sampling.logits_mask.banned_token_ids
    image_token_id: int
    max_positions: int
    max_session_tokens: int | None = None  # EngineConfig.max_session_tokens; None: no limit
    max_images: int | None = None  # EngineConfig.max_images_per_session; None: no limit

    def feed(self, lease, held: list[int], pending: list[int]) -> Feed:
        """A feed of ``pending`` ids after the ``held`` ones the lease's KV holds. The image
        features leave their blocks only for a prefill that feeds image tokens."""
        images_fed = held.count(self.image_token_id)
        features = None
        if pending and images_fed < lease.image_tokens:
            features = lease.features()
        return Feed(lease, pending, features, self.image_token_id, images_fed)

    def check_length(self, needed: int) -> None:
        """Refuse a conversation that would pass the model's positions or the
        ``max_session_tokens`` setting, before anything of it is computed."""
        limit, whose = self.max_positions, "the model's"
        if self.max_session_tokens is not None and self.max_session_tokens < limit:
            limit, whose = self.max_session_tokens, "max_session_tokens,"
        if needed > limit:
            raise InvalidRequest(
                f"the conversation would reach {needed} tokens, past {whose} {limit}; lower "
                "max_new_tokens or open a new session",
                code="CONVERSATION_TOO_LONG",
            )

    def check_images(self, images: int) -> None:
        """Refuse a turn that would make its session hold more than ``max_images``."""
        if self.max_images is not None and images > self.max_images:
            raise InvalidRequest(
                f"this image would make {images} in the session; a session holds at most "
                f"max_images_per_session ({self.max_images}): open a new session for it, or "
                "rewind past a turn that brought one",
                code="TOO_MANY_IMAGES",
            )


# Why a turn ended; "eos" and "stop_sequence" are finished answers.
EOS, MAX_NEW_TOKENS, DEADLINE, CANCELLED = "eos", "max_new_tokens", "deadline", "cancelled"
STOP_SEQUENCE = "stop_sequence"  # the text reached one of the parameters' ``stop``


@dataclass(frozen=True)
class Opened:
    session_id: str
    expires_at: datetime
    prefill_tokens: int  # computed by this open
    image_tokens: int
    cached_tokens: int = 0  # of the opening prompt, reused from blocks others computed
    resumed: Resumed | None = None  # a session resumed from the durable store: from what


@dataclass(frozen=True)
class Resumed:
    """What a resume continued (llava.engine.Engine.resume)."""

    from_session_id: str
    turns: int
    images: int


@dataclass(frozen=True)
class Answer:
    session_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool  # True only when the answer ended: an end token or a stop sequence
    stop_reason: str  # eos, stop_sequence, max_new_tokens, deadline or cancelled
    new_tokens: int  # prefilled this turn
    cached_tokens: int  # reused from the session's KV cache
    tier: Tier  # the session's tier when the turn started
    turns: int  # the session's turns with this one (fewer than before after a rewind)
    image_tokens: int  # image tokens among the new tokens (the image it brought, or more)
    images: int  # the session's images with this turn's
    ttft_s: float  # from the ask to its first token
    total_s: float
    expires_at: datetime


class Feed:
    """A sequence's ids still to be fed, in chunks, each chunk with the image features of the
    image tokens it holds (so a prefill may be split anywhere, even inside the image)."""

    def __init__(self, lease, ids: list[int], features, image_token_id: int, images_fed=0):
        self.lease = lease  # llava.sessions.lease: its KV, and the undo of a failed step
        self.ids = ids
        self.features = features
        self.image_token_id = image_token_id
        self.fed = 0
        self.images_fed = images_fed  # image tokens of the prompt already in the KV
        self._undo = (0, 0, 0)

    @property
    def pending(self) -> int:
        return len(self.ids) - self.fed

    def next_input(self, n: int, chooser: Chooser | None) -> StepInput:
        kv = self.lease.kv
        self._undo = (self.fed, self.images_fed, kv.length)
        chunk = self.ids[self.fed : self.fed + n]
        self.fed += len(chunk)
        features = None
        images = chunk.count(self.image_token_id) if self.features is not None else 0
        if images:
            features = self.features[self.images_fed : self.images_fed + images]
            self.images_fed += images
        return StepInput(kv=kv, ids=chunk, image_features=features, chooser=chooser)

    def rewind(self) -> None:
        self.fed, self.images_fed, length = self._undo
        self.lease.rewind(length)

    def append(self, token_id: int) -> None:
        self.ids.append(token_id)


class _Request:
    order_key: str | None = None
    chooser: Chooser | None = None  # an open's one step needs no id: greedy, ignored

    def __init__(self, context: RequestContext, deadline_s: float):
        self.context = context
        self.arrived = time.monotonic()
        self.deadline = self.arrived + deadline_s
        self.future: Future = Future()
        self.feed: Feed | None = None

    @property
    def pending(self) -> int:
        return 0 if self.feed is None else self.feed.pending

    def step_input(self, n: int) -> StepInput:
        return self.feed.next_input(n, self.chooser)

    def rewind(self) -> None:
        self.feed.rewind()


class OpenRequest(_Request):
    """The vision tower once (not at all when the image's features are held), then the
    opening's prefill past the blocks other sessions computed for it; the session starts hot.
    When those blocks cover all but the opening's last partial block, nothing is computed:
    that tail is prefilled with the first question, in the step that question takes anyway
    (docs/engine/memory.md §Shared prefixes)."""

    prefilling = True

    def __init__(
        self,
        context: RequestContext,
        deadline_s: float,
        session_id: str,  # the id it opens under (llava.sessions.store.full_session_id)
        image_key: bytes | None = None,
        encode: Callable[[], torch.Tensor] | None = None,
        system: str = "",
        callers_system: bool = False,
        tenant: str | None = None,
    ):
        """``image_key``: what the image's features and prefix are shared under (None: not
        shared); ``encode()``: the image's features (the vision tower; None: a text-only
        session); ``callers_system``: ``system`` is the caller's own text."""
        super().__init__(context, deadline_s)
        self.system = system
        self.lease: OpeningLease = context.leases.opening(
            session_id, image_key, encode, self._render, tenant, callers_system
        )

    def _render(self, image_tokens: int) -> list[int]:
        ids = self.context.prompt.opening_ids(image_tokens > 0, image_tokens, self.system)
        self.context.check_length(len(ids))
        return ids

    def admit(self, may_drop: bool = True) -> Shortfall | None:
        lease = self.lease
        shortfall = lease.take(may_drop)
        if shortfall is not None:
            return shortfall
        ids, cached = lease.ids, lease.reused
        tail = ids[cached:]
        if cached and len(tail) < lease.kv.pool.block_tokens:
            tail = []  # deferred to the first question's prefill (the history holds it)
        self.feed = self.context.feed(lease, ids[:cached], tail)
        return None

    def stop_reason(self, now: float) -> str | None:
        return None  # one prefill: it ends at once

    def accept(self, token: int) -> str | None:
        return None if self.feed.pending else EOS

    def finish(self, reason: str) -> None:
        lease = self.lease
        committed = lease.commit(lease.ids, opening_messages(self.system))
        self.future.set_result(
            Opened(
                session_id=lease.session_id,
                expires_at=committed.expires_at,
                prefill_tokens=len(self.feed.ids),
                image_tokens=committed.image_tokens,
                cached_tokens=lease.reused,
            )
        )

    def fail(self, error: BaseException) -> None:
        self.lease.abort()
        self.future.set_exception(error)


class TurnRequest(_Request):
    def __init__(
        self,
        context: RequestContext,
        deadline_s: float,
        session_id: str,
        question: str,
        params: GenerationParams,
        on_token: Callable[[str, int | None], None] | None,
        cancelled: Callable[[], bool] | None,
        rewind_turns: int = 0,
        images: Sequence[AddedImage] = (),
    ):
        """``images``: those the turn brings, shown in its user message before the question."""
        super().__init__(context, deadline_s)
        self.order_key = session_id
        self.question = question
        self.images = list(images)
        self.rewind_turns = rewind_turns
        self.params = params
        self.on_token = on_token
        self.cancelled = cancelled
        self.tier: Tier | None = None  # where the first try found the session's KV
        self.chooser = Chooser(params, context.eos_token_ids)
        self.detokenizer = Detokenizer(context.tokenizer)
        self.stop_text = StopText(params.stop)
        self.first_token_at: float | None = None
        self.lease: TurnLease = context.leases.turn(
            session_id, self._render, params.max_new_tokens, self.images
        )

    @property
    def prefilling(self) -> bool:
        return not self.chooser.generated

    def admit(self, may_drop: bool = True) -> Shortfall | None:
        lease = self.lease
        shortfall = lease.take(may_drop)
        if shortfall is not None:
            return shortfall
        prompt, reused = lease.ids, lease.reused
        self.feed = self.context.feed(lease, prompt[:reused], prompt[reused:])
        return None

    def _render(self, session: Session) -> TurnPrompt:
        """This turn's prompt: the session's conversation (less the turns it rewinds) and the
        question after the images its message shows (the open's, on a first question, then
        the turn's own), in the checkpoint's canonical tokenization; refused if too long or
        past the session's images."""
        if self.tier is None:
            self.tier = session.tier
        kept = self._kept_messages(session)
        first = not questions_asked(kept)
        kept_images = session.opening_images if first else images_shown(kept)
        shown = (session.opening_images if first else 0) + len(self.images)
        self.messages = [*kept, user_message(self.question, shown)]
        return self._prompt(session, kept_images)

    def _prompt(self, session: Session, kept_images: int) -> TurnPrompt:
        """``self.messages`` as ids, showing the session's first ``kept_images`` images and
        then the turn's own; refused past the session's images or the length limits."""
        if self.images:
            self.context.check_images(kept_images + len(self.images))
        counts = [image.tokens for image in session.holding.images[:kept_images]]
        counts += [image.tokens for image in self.images]
        prompt = self.context.prompt.ids(self.messages, counts)
        self.context.check_length(len(prompt) + self.params.max_new_tokens)
        return TurnPrompt(prompt, kept_images)

    def _kept_messages(self, session: Session) -> list[dict]:
        """The conversation this turn follows: the session's, less the turns it rewinds. Their
        KV needs no special care: the lease keeps only the prefix the new prompt shares."""
        if self.rewind_turns > session.turns:
            raise InvalidRequest(
                f"'rewind_turns' is {self.rewind_turns} but the session holds {session.turns} "
                "turns",
                code="REWIND_PAST_START",
            )
        return without_last_turns(session.messages, self.rewind_turns)

    def stop_reason(self, now: float) -> str | None:
        if self.cancelled is not None and self.cancelled():
            return CANCELLED
        return DEADLINE if now >= self.deadline else None

    def accept(self, token: int) -> str | None:
        if self.feed.pending:
            return None  # a prefill chunk that is not the prompt's last
        self.chooser.record(token)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self._emit(self.detokenizer.push(token), token)
        if self.chooser.ended:
            return EOS
        if self.stop_text.stopped:
            return STOP_SEQUENCE
        if self.chooser.exhausted:
            return MAX_NEW_TOKENS
        self.feed.append(token)
        return None

    def _emit(self, text: str, token_id: int | None) -> None:
        text = self.stop_text.push(text)
        if self.on_token is not None:
            self.on_token(text, token_id)

    def finish(self, reason: str) -> None:
        held_back = self.stop_text.push(self.detokenizer.flush()) + self.stop_text.flush()
        if held_back and self.on_token is not None:
            self.on_token(held_back, None)
        lease = self.lease
        generated = self.chooser.generated
        text = self.stop_text.text
        # No end token in the history: the chat template renders none after an answer, so
        # keeping one would make every follow-up diverge from what the checkpoint sees.
        answer_ids = generated[:-1] if reason == EOS else generated
        messages = [*self.messages, assistant_message(text)]
        turns = questions_asked(messages)
        committed = lease.commit(lease.ids + answer_ids, messages, turns)
        now = time.monotonic()
        self.future.set_result(
            Answer(
                session_id=lease.session_id,
                text=text,
                token_ids=tuple(generated),
                finished=reason in (EOS, STOP_SEQUENCE),
                stop_reason=reason,
                new_tokens=len(lease.ids) - lease.reused,
                cached_tokens=lease.reused,
                tier=self.tier,
                turns=turns,
                image_tokens=lease.ids[lease.reused :].count(self.context.image_token_id),
                images=committed.images,
                ttft_s=(self.first_token_at or now) - self.arrived,
                total_s=now - self.arrived,
                expires_at=committed.expires_at,  # the turn restarted the idle clock
            )
        )

    def fail(self, error: BaseException) -> None:
        self.lease.abort()
        self.future.set_exception(error)


class ChatRequest(TurnRequest):
    """A turn given as the whole conversation, as a chat-completions client resends it
    (llava.sched.conversation): its prompt is the conversation's, and the lease keeps what
    the session's KV holds of it (the common prefix, as after a rewind), so an extended
    conversation prefills only its new message, and an edited one rewinds to the edit.

    ``kept``: how many of the session's images the caller found the conversation shows
    first (``Engine.images_to_fetch``); ``images``: the conversation's images after those,
    loaded. Should the session have moved on since (another request's turn committed), so
    that it no longer holds those ``kept``, the turn is refused (SessionChanged)."""

    def __init__(
        self,
        context: RequestContext,
        deadline_s: float,
        session_id: str,
        conversation: Conversation,
        system: str,
        params: GenerationParams,
        on_token: Callable[[str, int | None], None] | None,
        cancelled: Callable[[], bool] | None,
        kept: int,
        images: Sequence[AddedImage],
    ):
        question = conversation.turns[-1].question
        super().__init__(
            context, deadline_s, session_id, question, params, on_token, cancelled, 0, images
        )
        self.conversation = conversation
        self.system = system
        self.kept = kept

    def _render(self, session: Session) -> TurnPrompt:
        if self.tier is None:
            self.tier = session.tier
        if system_of(session.messages) != self.system:
            raise InvalidRequest(
                "the system message differs from the session's: a session keeps the system "
                "prompt it was opened with; send that one, or start a new session",
                code="SYSTEM_CHANGED",
            )
        held = held_refs(session.messages, session.opening_images)
        if images_kept(held, self.conversation) < self.kept:
            raise SessionChanged(
                f"session {session.session_id} changed while this request was on its way "
                "(another request's turn came first); send it again"
            )
        self.messages = self.conversation.messages(self.system)
        return self._prompt(session, self.kept)
