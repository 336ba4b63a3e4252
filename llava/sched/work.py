"""What the engine loop runs for one request: an opening prefill, or a question's turn.

Each request takes what it needs when the loop admits it (the session, KV blocks), feeds its
ids to the steps the scheduler plans, and ends by committing (``finish``) or by undoing
(``fail``); either way its caller's future is resolved exactly once. A turn commits exactly
as a turn alone did: canonical prompt, cache reuse by common prefix, no end token in the
history, and a failure demotes its session but leaves its history
(docs/engine/prompt-fidelity.md §Canonical prompt; docs/engine/scheduling.md §Engine loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import datetime

import torch

from llava.errors import InvalidRequest, log_id
from llava.exec.runner import StepInput
from llava.kv.memory import Holding, MemoryManager, Shortfall, Tier
from llava.kv.prefix import block_keys
from llava.model.prompt import (
    ChatPrompt,
    assistant_message,
    common_prefix_length,
    opening_messages,
    questions_asked,
    user_message,
    without_last_turns,
)
from llava.sampling.chooser import Chooser
from llava.sampling.detokenizer import Detokenizer
from llava.sampling.params import GenerationParams
from llava.sessions.persist import BadEntry, NoJournal, SessionJournal, Snapshot
from llava.sessions.session import Session, Sharing
from llava.sessions.store import SessionStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestContext:
    """What a request may use: no engine, so requests and the engine do not import each
    other (docs/engine/memory.md §Memory policy)."""

    store: SessionStore
    memory: MemoryManager
    prompt: ChatPrompt
    encode_image: Callable[[dict], torch.Tensor]  # vision inputs → (image tokens, hidden)
    tokenizer: object
    eos_token_ids: frozenset[int]
    banned_ids: object  # llava.sampling.logits_mask.banned_token_ids
    image_token_id: int
    max_positions: int
    max_session_tokens: int | None = None  # EngineConfig.max_session_tokens; None: no limit
    journal: SessionJournal | NoJournal = NoJournal()
    prefix_sharing: str = "opening"  # EngineConfig.prefix_sharing

    def prefix_keys(
        self, holding: Holding, sharing: Sharing, ids: list[int], known: list[bytes] = ()
    ) -> list[bytes]:
        """The content keys of the full blocks of ``ids`` in ``holding``'s session (none when
        sharing is off); ``known``: those of its first blocks (llava.kv.prefix.block_keys).
        Under "opening", blocks past the opening's full ones are keyed for the session alone:
        another session's right guess of its text then finds no more than a wrong one."""
        if self.prefix_sharing == "off":
            return []
        bt = self.memory.pool.block_tokens
        own_from = sharing.opening_tokens // bt if self.prefix_sharing == "opening" else None
        return block_keys(
            ids,
            bt,
            holding.image_key,
            self.image_token_id,
            known,
            tenant=sharing.tenant,
            own_from=own_from,
            own_salt=sharing.own_salt,
        )

    def publish(self, session: Session) -> None:
        """The session's committed KV becomes reusable by the sessions its sharing allows
        (before its reply goes)."""
        holding, ids = session.holding, session.token_ids[: session.kv.length]
        keys = self.prefix_keys(holding, session.sharing, ids, holding.block_keys)
        self.memory.publish(holding, keys)

    def feed(self, holding: Holding, held: list[int], pending: list[int], features=None) -> Feed:
        """A feed of ``pending`` ids after the ``held`` ones its KV holds. The image features
        leave their blocks only for a prefill that feeds image tokens (``features``: the
        features at hand, if any)."""
        images_fed = held.count(self.image_token_id)
        if not pending or images_fed >= holding.image_tokens:
            features = None
        elif features is None:
            features = self.memory.features(holding)
        return Feed(holding, pending, features, self.image_token_id, images_fed)

    def persist(self, session: Session, with_features: bool = False) -> None:
        """Write the session's committed state (at open, ``with_features``: its image features
        too) to the persistent tier before its reply goes (docs/engine/sessions.md
        §Persistent tier); the caller holds the session's turn."""
        if not self.journal.enabled:
            return
        features = self.memory.features(session.holding) if with_features else None
        snapshot = Snapshot(
            session.session_id,
            session.token_ids,
            session.messages,
            session.turns,
            time.time(),
            self.store.ttl_s,
            None if session.holding.image_key is None else session.holding.image_key.hex(),
            session.sharing.tenant,
            session.sharing.opening_tokens,
        )
        try:
            kept = self.journal.save(snapshot, features)
        except Exception:  # a bug here must not fail a committed turn: the entry goes instead
            logger.exception("persistent tier: session %s not kept", log_id(session.session_id))
            self.journal.remove(session.session_id)
            kept = False
        self.memory.mark_persisted(session.holding, kept)  # parked, or else evicted, for room

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


# Why a turn ended; only "eos" is a finished answer.
EOS, MAX_NEW_TOKENS, DEADLINE, CANCELLED = "eos", "max_new_tokens", "deadline", "cancelled"


@dataclass(frozen=True)
class Opened:
    session_id: str
    expires_at: datetime
    prefill_tokens: int  # computed by this open
    image_tokens: int
    cached_tokens: int = 0  # of the opening prompt, reused from blocks others computed


@dataclass(frozen=True)
class Answer:
    session_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool  # True only when the answer ended with an end token
    stop_reason: str  # eos, max_new_tokens, deadline or cancelled
    new_tokens: int  # prefilled this turn
    cached_tokens: int  # reused from the session's KV cache
    tier: Tier  # the session's tier when the turn started
    turns: int  # the session's turns with this one (fewer than before after a rewind)
    ttft_s: float  # from the ask to its first token
    total_s: float
    expires_at: datetime


class Feed:
    """A sequence's ids still to be fed, in chunks, each chunk with the image features of the
    image tokens it holds (so a prefill may be split anywhere, even inside the image)."""

    def __init__(
        self, holding: Holding, ids: list[int], features, image_token_id: int, images_fed=0
    ):
        self.holding = holding
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
        kv = self.holding.kv
        self._undo = (self.fed, self.images_fed, kv.length)
        chunk = self.ids[self.fed : self.fed + n]
        self.fed += len(chunk)
        features = None
        images = chunk.count(self.image_token_id) if self.features is not None else 0
        if images:
            features = self.features[self.images_fed : self.images_fed + images]
            self.images_fed += images
        return StepInput(kv=kv, ids=chunk, image_features=features, chooser=chooser)

    def rewind(self, memory: MemoryManager) -> None:
        self.fed, self.images_fed, length = self._undo
        memory.rewind(self.holding, length)

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
        self.feed.rewind(self.context.memory)


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
        pixels: dict | Callable[[], dict] | None,
        session_id: str,  # the id it opens under (llava.sessions.store.full_session_id)
        image_key: bytes | None = None,
        system: str = "",
        callers_system: bool = False,
        tenant: str | None = None,
    ):
        super().__init__(context, deadline_s)
        # the image's pixels, or how to make them when the caller found its features held
        # (then made here only if the features went meanwhile); None: a text-only session
        self.pixels = pixels
        self.session_id = session_id
        self.image_key = image_key  # None: the image's features and prefix are not shared
        self.system = system
        self.callers_system = callers_system  # the caller's own text, not the operator's
        self.sharing = Sharing(tenant)
        self.features: torch.Tensor | None = None
        self.holding: Holding | None = None
        self.ids: list[int] = []

    def admit(self, may_drop: bool = True) -> Shortfall | None:
        context, memory = self.context, self.context.memory
        holding = memory.hold(self.image_key)
        try:
            shortfall = self._reserve(holding, may_drop)
        except BaseException:
            memory.release(holding)
            raise
        if shortfall is not None:
            memory.release(holding)
            return shortfall
        self.holding = holding
        self.cached = cached = holding.kv.length
        tail = self.ids[cached:]
        if cached and len(tail) < memory.pool.block_tokens:
            tail = []  # deferred to the first question's prefill (the history holds it)
        self.feed = context.feed(holding, self.ids[:cached], tail, self.features)
        return None

    def _reserve(self, holding: Holding, may_drop: bool) -> Shortfall | None:
        context, memory = self.context, self.context.memory
        shared = self.pixels is not None and memory.share_features(holding)
        if self.pixels is not None and not shared and self.features is None:
            pixels = self.pixels() if callable(self.pixels) else self.pixels
            self.features = context.encode_image(pixels)  # kept if a shortfall waits
        if self.features is not None and not shared:
            image_tokens = self.features.shape[0]
        else:
            image_tokens = holding.image_tokens
        self.ids = context.prompt.opening_ids(self.pixels is not None, image_tokens, self.system)
        context.check_length(len(self.ids))
        opening_tokens = 0 if self.callers_system else len(self.ids)
        self.sharing = replace(self.sharing, opening_tokens=opening_tokens)
        keys = context.prefix_keys(holding, self.sharing, self.ids)
        features = None if shared else self.features
        return memory.reserve(holding, len(self.ids), features, keys, may_drop)

    def stop_reason(self, now: float) -> str | None:
        return None  # one prefill: it ends at once

    def accept(self, token: int) -> str | None:
        return None if self.feed.pending else EOS

    def finish(self, reason: str) -> None:
        context, store = self.context, self.context.store
        session = Session(self.session_id, self.ids, self.holding, sharing=self.sharing)
        session.messages = opening_messages(self.system)
        with session.lock:  # persisted before anyone else can use it
            store.add(session)
            self.holding = None  # the session owns it now
            context.memory.crop(session.holding, session.kv.length)  # reserved, not written
            context.publish(session)
            context.persist(session, with_features=True)
        self.future.set_result(
            Opened(
                session_id=session.session_id,
                expires_at=store.expires_at(session),
                prefill_tokens=len(self.feed.ids),
                image_tokens=session.image_tokens,
                cached_tokens=self.cached,
            )
        )

    def fail(self, error: BaseException) -> None:
        if self.holding is not None:
            self.context.memory.release(self.holding)
            self.holding = None
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
    ):
        super().__init__(context, deadline_s)
        self.order_key = session_id
        self.question = question
        self.rewind_turns = rewind_turns
        self.params = params
        self.on_token = on_token
        self.cancelled = cancelled
        self.session: Session | None = None
        self.tier: Tier | None = None  # where the first try found the session's KV
        self.chooser = Chooser(params, context.eos_token_ids)
        self.detokenizer = Detokenizer(context.tokenizer)
        self.first_token_at: float | None = None
        self.features: torch.Tensor | None = None  # a parked session's, read back once

    @property
    def prefilling(self) -> bool:
        return not self.chooser.generated

    def admit(self, may_drop: bool = True) -> Shortfall | None:
        context, store, memory = self.context, self.context.store, self.context.memory
        session = store.begin_turn(self.order_key)
        holding = session.holding
        try:
            if self.tier is None:
                self.tier = session.tier
            image_tokens = session.image_tokens
            kept = self._kept_messages(session)
            first_has_image = image_tokens > 0 and not questions_asked(kept)
            self.messages = [*kept, user_message(self.question, first_has_image)]
            self.prompt = context.prompt.ids(self.messages, image_tokens)
            total = len(self.prompt) + self.params.max_new_tokens
            context.check_length(total)
            shortfall = None
            if session.tier is Tier.HOST:  # its KV comes back first: then reuse it as usual
                shortfall = memory.reserve(holding, 0, may_drop=may_drop)
            if shortfall is None and holding.kv is None:  # recomputed, on any shared prefix
                features = self._parked_features(session)
                # at least one id is prefilled: its logits start the answer
                keys = context.prefix_keys(holding, session.sharing, self.prompt[:-1])
                shortfall = memory.reserve(holding, total, features, keys, may_drop)
                self.reused = 0 if shortfall else holding.kv.length
            elif shortfall is None:
                self.reused = self._reuse(holding, session.token_ids)
                shortfall = memory.reserve(holding, total - self.reused, may_drop=may_drop)
        except BaseException:
            store.end_turn(session)
            raise
        if shortfall is not None:
            store.end_turn(session)
            return shortfall
        self.session = session
        prompt, reused = self.prompt, self.reused
        self.feed = context.feed(holding, prompt[:reused], prompt[reused:], self.features)
        return None

    def _kept_messages(self, session: Session) -> list[dict]:
        """The conversation this turn follows: the session's, less the turns it rewinds. Their
        KV needs no special care: ``_reuse`` keeps only the prefix the new prompt shares."""
        if self.rewind_turns > session.turns:
            raise InvalidRequest(
                f"'rewind_turns' is {self.rewind_turns} but the session holds {session.turns} "
                "turns",
                code="REWIND_PAST_START",
            )
        return without_last_turns(session.messages, self.rewind_turns)

    def _parked_features(self, session: Session) -> torch.Tensor | None:
        """A parked session's features: its image's, if the pool holds them, else read back
        from the persistent tier (once: kept across a wait for room). An entry that cannot
        be read loses the session (SESSION_EVICTED, logged with why)."""
        holding, context = session.holding, self.context
        if not holding.parked or context.memory.share_features(holding):
            return None
        if self.features is None:
            try:
                self.features = context.journal.features(session.session_id)
            except BadEntry as e:
                why = f"its persisted features are unreadable: {e}"
                raise context.store.lose(session, why) from None
        return self.features

    def _reuse(self, holding: Holding, history: list[int]) -> int:
        """Crop the KV to the longest prefix it shares with the prompt; return its length.

        Usually that is everything cached (the prompt only appends). It is less where the
        tokenizer merges across the old boundary, e.g. an answer whose text re-tokenizes
        differently inside the next prompt (docs/engine/prompt-fidelity.md §Canonical prompt): the
        prompt is the checkpoint's canonical tokenization, so the differing tail is prefilled again.
        """
        held = history[: holding.kv.length]
        # at least one id is prefilled: its logits start the answer
        reused = min(common_prefix_length(self.prompt, held), len(self.prompt) - 1)
        if reused < holding.kv.length:
            reused = self.context.memory.crop(holding, reused)  # less inside a shared block
        return reused

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
        if self.chooser.exhausted:
            return MAX_NEW_TOKENS
        self.feed.append(token)
        return None

    def _emit(self, text: str, token_id: int | None) -> None:
        if self.on_token is not None:
            self.on_token(text, token_id)

    def finish(self, reason: str) -> None:
        held_back = self.detokenizer.flush()
        if held_back:
            self._emit(held_back, None)
        store, memory, session = self.context.store, self.context.memory, self.session
        generated = self.chooser.generated
        text = self.detokenizer.text
        # No end token in the history: the chat template renders none after an answer, so
        # keeping one would make every follow-up diverge from what the checkpoint sees.
        answer_ids = generated[:-1] if reason == EOS else generated
        session.token_ids = self.prompt + answer_ids
        session.messages = [*self.messages, assistant_message(text)]
        session.turns = questions_asked(session.messages)
        memory.crop(session.holding, session.kv.length)  # the blocks reserved but not written
        self.context.publish(session)
        self.context.persist(session)
        store.end_turn(session)
        self.session = None
        store.record_turn(len(self.prompt) - self.reused, self.reused)
        now = time.monotonic()
        self.future.set_result(
            Answer(
                session_id=session.session_id,
                text=text,
                token_ids=tuple(generated),
                finished=reason == EOS,
                stop_reason=reason,
                new_tokens=len(self.prompt) - self.reused,
                cached_tokens=self.reused,
                tier=self.tier,
                turns=session.turns,
                ttft_s=(self.first_token_at or now) - self.arrived,
                total_s=now - self.arrived,
                expires_at=store.expires_at(session),  # the turn restarted the idle clock
            )
        )

    def fail(self, error: BaseException) -> None:
        session = self.session
        if session is not None:  # the KV may hold a partial turn; history and messages do not
            self.context.memory.drop_kv(session.holding)
            self.context.store.end_turn(session)
            self.session = None
        self.future.set_exception(error)
