"""The engine: open a session on an image, ask questions on top of its KV cache, close it.

``Engine`` is the one object a transport (the TorchServe handler, a notebook, a test) uses.
Its methods are thread-safe and blocking: many threads may call them at once. Inputs are
checked and images preprocessed in the caller's thread; the model work is queued to one
engine-loop thread (llava.sched.loop) that batches the turns of different sessions into each step.
It raises only ``llava.errors`` types, so a transport can map every failure to a status.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from PIL import Image

from llava.config import EngineConfig, SettingsError
from llava.errors import (
    DurableStoreOff,
    EngineError,
    InvalidRequest,
    RecordNotFound,
    SessionChanged,
    SessionNotFound,
    echo,
    log_id,
)
from llava.exec.runner import PagedAttentionFailed, Runner, RunnerCounters, StepInput
from llava.kv.budget import MemoryBudget, memory_budget, session_feature_bytes, session_kv_bytes
from llava.kv.holding import NewImage, Tier
from llava.kv.memory import MemoryCounters, MemoryManager
from llava.kv.pool import KVPool
from llava.kv.prefix import scoped
from llava.model.imageprep import content_key
from llava.model.loading import LoadedModel, load_model
from llava.model.prompt import opening_messages
from llava.model.vision import (
    image_features,
    image_tokens_of,
    largest_side,
    most_image_tokens,
    vision_inputs,
)
from llava.model.weights_digest import weights_digest
from llava.sampling.logits_mask import banned_token_ids
from llava.sampling.params import GenerationParams
from llava.sampling.sampler import Sampler
from llava.sched.conversation import ChatTurn, Conversation, held_refs, images_kept
from llava.sched.loop import EngineLoop
from llava.sched.scheduler import Scheduler
from llava.sched.work import (
    Answer,
    ChatRequest,
    Opened,
    OpenRequest,
    RequestContext,
    Resumed,
    TurnRequest,
)
from llava.sessions.durable import DurableSessions, Record
from llava.sessions.lease import AddedImage, Leases
from llava.sessions.location import Location, open_journal, persistence
from llava.sessions.objects import open_objects
from llava.sessions.persist import model_identity
from llava.sessions.record import Snapshot
from llava.sessions.session import Session, Sharing
from llava.sessions.store import SessionStore, StoreCounters, full_session_id
from llava.sessions.tier import PersistentTier
from llava.sessions.writeback import DurableCounters

__all__ = ["Answer", "Engine", "EngineStats", "KeyedImage", "Opened"]
logger = logging.getLogger(__name__)


def kept_weights_digest(loaded: LoadedModel, location: Location | None) -> str | None:
    """The digest of the weights' values that names the sessions the persistent tier keeps,
    recorded in its directory (None: the tier is off, nothing outlives the process)."""
    if location is None:
        return None
    if loaded.model_dir is None:
        problem = "needs a model loaded from a directory: its weights' digest names the sessions"
        raise SettingsError("persist_dir", problem)
    try:
        return weights_digest(loaded.model_dir, location.directory)
    except FileNotFoundError as e:
        raise SettingsError("persist_dir", str(e)) from None


def feature_salt(model_identity: str, loaded: LoadedModel) -> bytes:
    """Everything besides the pixels that an image's features depend on: the model, the
    processor's settings and the checkpoint's aspect-ratio mode."""
    processor = loaded.processor.image_processor.to_json_string()
    text = json.dumps([model_identity, processor, loaded.image_aspect_ratio], sort_keys=True)
    return hashlib.sha256(text.encode()).digest()


@dataclass(frozen=True)
class KeyedImage:
    """An image with the key its features and prefix are shared under, computed once where
    an open enters (``Engine.keyed_image``) and passed down (None: not shared)."""

    image: Image.Image
    key: bytes | None


@dataclass(frozen=True)
class EngineStats:
    """The store's counters, the memory manager's tiers and the step runner's counters
    (how often it degraded), one snapshot for metrics."""

    sessions_by_tier: dict[Tier, int]
    bytes_by_tier: dict[Tier, int]
    budget: MemoryBudget
    store: StoreCounters
    memory: MemoryCounters
    runner: RunnerCounters
    durable: DurableCounters  # the durable store's writer (all zero without one)

    @property
    def sessions(self) -> int:
        return sum(self.sessions_by_tier.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_tier.values())


class Engine:
    """``budget``: the memory manager's device pool (allocated once here), host bytes and
    stated headroom; the scheduler's knobs are settings (``max_batch``,
    ``prefill_chunk_tokens``, ``mixed_steps``)."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        budget: MemoryBudget,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.loaded = loaded
        self.config = config
        text_config = loaded.model.config.text_config
        pool = KVPool(text_config, budget.device_bytes, loaded.device, loaded.dtype)
        self.memory = MemoryManager(pool, budget)
        location = persistence(config)
        identity = model_identity(loaded.model, loaded.dtype, kept_weights_digest(loaded, location))
        vocab_size = text_config.vocab_size
        journal = open_journal(location, identity, vocab_size, config.session_ttl_s)
        # the durable store behind it (docs/engine/sessions.md §Durable store), tried now
        self.durable = None
        if config.durable_store is not None:
            objects = open_objects(config.durable_store, config.durable_store_kms_key)
            self.durable = DurableSessions(objects, identity, vocab_size)
        self.persistent = PersistentTier(journal, self.memory, config.session_ttl_s, self.durable)
        self._adopting = threading.Lock()  # one adoption from the durable store at a time
        self.store = SessionStore(
            self.memory,
            ttl_s=config.session_ttl_s,
            clock=clock,
            journal=self.persistent,
            max_sessions=config.max_sessions,
            max_waiting_asks=config.max_waiting_asks,
        )
        image_token_id = loaded.model.config.image_token_id
        leases = Leases(
            self.store, self.memory, self.persistent, image_token_id, config.prefix_sharing
        )
        self.context = RequestContext(
            leases=leases,
            prompt=loaded.prompt,
            tokenizer=loaded.tokenizer,
            eos_token_ids=loaded.eos_token_ids,
            banned_ids=banned_token_ids(loaded.tokenizer, vocab_size, loaded.eos_token_ids),
            image_token_id=image_token_id,
            max_positions=loaded.max_positions,
            max_session_tokens=config.max_session_tokens,
            max_images=config.max_images_per_session,
        )
        # what changes an image's features besides its pixels: the model and preprocessing
        self._features_salt = feature_salt(identity, loaded)
        self.renders_system = loaded.prompt.renders_system()
        if config.system_prompt and not self.renders_system:
            problem = "this checkpoint's chat template has no system role"
            raise SettingsError("system_prompt", problem)
        # sessions a previous worker of this model left in the persistent tier continue here
        self.adopted = self.persistent.adopt(self.store, config.prefix_sharing != "off")
        sampler = Sampler(vocab_size, self.context.banned_ids, loaded.eos_token_ids, loaded.device)
        self.runner = Runner(loaded.model, self.memory.pool, sampler, config.attention)
        knobs = config.max_batch, config.prefill_chunk_tokens, config.mixed_steps
        scheduler = Scheduler(*knobs, config.wait_for_room_s)
        on_idle = self.check_integrity if config.check_memory_when_idle else None
        self.loop = EngineLoop(self.runner, scheduler, time.monotonic, on_idle).start()
        if loaded.device.type == "cuda":  # streams, graphs and events without a device: ours
            self.loop.call(lambda: torch.cuda.set_device(loaded.device))
        weakref.finalize(self, self.loop.stop)  # the loop thread ends with its engine
        weakref.finalize(self, self.persistent.stop)  # and the durable store's writer

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> Engine:
        loaded = load_model(
            config.model_dir, config.device, config.dtype, config.attn_implementation
        )
        return cls(loaded, config, memory_budget(config, loaded.device), clock=clock)

    @property
    def image_side(self) -> int:
        """The largest side the processor resizes an image to (llava.model.vision)."""
        return largest_side(self.loaded.processor.image_processor)

    def warm_up(self) -> float:
        """Run the vision tower, a prefill and a decode step once, outside any session, so the
        first caller does not pay for lazy initialization, then capture the decode graphs (CUDA,
        ``cuda_graphs``). Returns the seconds it took.

        The decode step makes the first paged call: under ``attention: auto`` one that fails
        switches the runner to sdpa here (logged, counted), and no graphs are captured; under
        a forced ``flex`` or ``triton`` it fails the start with one line (SettingsError).
        Under ``auto`` on CUDA, flex and triton are then timed and the faster kept
        (Runner.settle_attention)."""
        start = time.perf_counter()
        size = self.loaded.processor.image_processor.crop_size
        pixels = self._pixels(Image.new("RGB", (size["width"], size["height"])))
        self.loop.call(lambda: self._warm_up(pixels))
        return time.perf_counter() - start

    def _warm_up(self, pixels: torch.Tensor) -> None:
        self.runner.warm_up_layers()  # CUDA: the layer pieces' compile, or its fallback, now
        features = self.encode_image(pixels)
        ids = self.loaded.prompt.opening_ids(True, image_tokens=features.shape[0])
        holding = self.memory.hold()
        try:
            if self.memory.start(holding, len(ids) + 1, images=[NewImage(None, features)]) is None:
                self.runner.step([StepInput(holding.kv, ids, features)])
                self.runner.step([StepInput(holding.kv, ids[:1], None)])  # not an image token
        except PagedAttentionFailed as e:  # only a forced path lets it out (auto falls back)
            raise SettingsError(
                "attention",
                f"{self.runner.attention} on {self.loaded.device}: {e} (auto would use sdpa)",
            ) from e
        finally:
            self.memory.release(holding)
        self.runner.settle_attention()  # auto on CUDA: flex or triton, by their times
        if self.config.cuda_graphs:
            self.runner.capture_graphs(self.loop.scheduler.max_batch)  # CUDA and flex only

    # -- the three operations --------------------------------------------------------------
    def open(
        self,
        image: Image.Image | KeyedImage | None = None,
        session_id: str | None = None,
        system: str | None = None,
        tenant: str | None = None,
    ) -> Opened:
        """Run the vision tower once and prefill the opening; the session starts hot. What
        another session already computed for the same image and prompt prefix is reused
        instead, as far as ``prefix_sharing`` allows (``Opened.cached_tokens`` says how much).

        ``session_id``: the caller's own id for the session (checked before any model work),
        with a random part added when it counts under 128 bits (``full_session_id``: read
        ``Opened.session_id``); by default the server picks an unguessable one. ``system``:
        the session's system prompt (None: the ``system_prompt`` setting; "": none).
        ``tenant``: sessions of different tenants share nothing (None: shares with the other
        sessions without one). ``image``: a PIL image, or one keyed already for ``tenant``
        (``keyed_image``).
        """
        callers_system = bool(system)  # None is the operator's system_prompt, "" none at all
        system = self._check_system(system)
        _check_tenant(tenant)
        session_id = full_session_id(session_id)
        self.store.check_id_free(session_id)
        key = encode = None
        if image is not None:
            if not isinstance(image, KeyedImage):
                image = self.keyed_image(image, tenant)
            key, encode = image.key, self._encoder(image)
        request = OpenRequest(
            self.context,
            self.config.turn_deadline_s,
            session_id,
            key,
            encode,
            system,
            callers_system,
            tenant,
        )
        with self.store.opening():
            return self.loop.submit(request)

    @property
    def on_fatal(self) -> Callable[[BaseException], None] | None:
        """Called once, from the loop thread, when this engine's device is lost (a CUDA error:
        llava.sched.loop.device_lost); by then every request failed and the loop stopped."""
        return self.loop.on_fatal

    @on_fatal.setter
    def on_fatal(self, hook: Callable[[BaseException], None] | None) -> None:
        self.loop.on_fatal = hook

    def image_key(self, image: Image.Image) -> bytes:
        """The image's content key: equal keys mean equal features (llava.model.imageprep)."""
        return content_key(image, self._features_salt)

    def keyed_conversation(self, conversation: Conversation, tenant: str | None) -> Conversation:
        """The conversation with each loaded image keyed for ``tenant`` (``keyed_image``)."""
        return conversation.with_images(
            {
                index: self.keyed_image(image.image, tenant)
                for index, image in enumerate(conversation.images)
                if image.image is not None and not isinstance(image.image, KeyedImage)
            }
        )

    def keyed_image(self, image: Image.Image, tenant: str | None) -> KeyedImage:
        """The image with the key ``tenant``'s sessions share its features and prefix under
        (None: ``prefix_sharing`` is off): hashed once, where the open enters."""
        if self.config.prefix_sharing == "off":
            return KeyedImage(image, None)
        return KeyedImage(image, scoped(self.image_key(image), tenant))

    def ask(
        self,
        session_id: str,
        question: str,
        parameters: dict | None = None,
        on_token: Callable[[str, int | None], None] | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
        rewind_turns: int = 0,
        image: Image.Image | KeyedImage | None = None,
    ) -> Answer:
        """Answer ``question`` in the session; turns of one session run in arrival order, and
        past ``max_waiting_asks`` behind the one in flight an ask is refused (SessionBusy).

        ``image``: one more image for the session, shown in this turn's user message before
        the question; its features computed once, or shared as an open's are; past
        ``max_images_per_session`` the turn is refused (TOO_MANY_IMAGES) and the session stays
        as it was (docs/engine/sessions.md §Several images in a session).

        ``on_token(text, token_id)`` is called from the loop thread for every generated id as
        it is generated, with the text it adds (empty for special ids or a partial character);
        a last call with ``token_id=None`` carries any text held back. The texts concatenate to
        the answer. ``cancelled()`` is polled before every step: when true the turn ends there
        (stop_reason "cancelled"); past ``turn_deadline_s`` it ends too ("deadline"). Either
        way the turn is committed like one cut by max_new_tokens.

        ``rewind_turns``: first drop the session's last N turns (questions and answers), so
        this answer is the one a session that never had them gives: to regenerate an answer
        or edit a question (docs/engine/life-of-a-turn.md §Rewinding turns).
        """
        params = self._params(parameters)
        question = self._check_question(question)
        _check_rewind(rewind_turns)
        self._adopt_unknown(session_id)
        added = [] if image is None else [self._added_image(session_id, image)]
        request = TurnRequest(
            self.context,
            self.config.turn_deadline_s,
            session_id,
            question,
            params,
            on_token,
            cancelled,
            rewind_turns,
            added,
        )
        with self.store.asking(session_id):
            return self.loop.submit(request)

    # -- conversations given whole (docs/engine/sessions.md §Conversations given whole) -----
    def images_to_fetch(
        self, conversation: Conversation, session_id: str | None = None
    ) -> list[int]:
        """The indexes (in the order the conversation shows its images) of the images a
        ``chat`` call must be given loaded: all of them without a session, else those past
        the ones the session holds in that order (SessionNotFound: it is gone)."""
        return list(range(self._images_held(conversation, session_id), len(conversation.images)))

    def chat(
        self,
        conversation: Conversation,
        session_id: str | None = None,
        parameters: dict | None = None,
        on_token: Callable[[str, int | None], None] | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
        tenant: str | None = None,
        new_session: bool = False,
    ) -> Answer:
        """Answer the conversation's last user message.

        With ``session_id`` (and not ``new_session``): the conversation is the session's
        from now on. What its KV holds of it is kept (an extended conversation prefills only
        its new message; one that differs from an earlier turn on is recomputed from there,
        as a rewind), and the images it holds are not fetched again (``images_to_fetch``).
        With ``new_session``: a session is opened for it under ``session_id`` (None: a new
        id; ``Answer.session_id``) and kept. With neither: a stateless answer, on a session
        closed at once. Either way a new session starts on the longest prefix the pool holds
        for it within ``tenant``'s sharing (``prefix_sharing``), image features included."""
        params = self._params(parameters)
        conversation = self._checked(conversation)
        system = self._check_system(conversation.system)
        if session_id is not None and not new_session:
            kept = self._images_held(conversation, session_id)
            added = self._images_past(session_id, conversation, kept)
            return self._chat_turn(
                session_id, conversation, system, params, on_token, cancelled, kept, added
            )
        _check_tenant(tenant)
        conversation = self.keyed_conversation(conversation, tenant)
        added = [self._added_keyed(image.image) for image in conversation.images]
        session_id = self._blank(
            session_id, conversation, system, tenant, added, transient=not new_session
        )
        try:
            answer = self._chat_turn(
                session_id, conversation, system, params, on_token, cancelled, 0, added
            )
        except BaseException:
            self.store.close(session_id)  # an open that answered nothing leaves nothing
            raise
        if not new_session:
            self.store.close(session_id)
        return answer

    def close(self, session_id: str) -> str | None:
        """None if this closed it; else why it was already gone (see SessionStore.close).
        With a durable store, its record goes too, held here or not."""
        gone = self.store.close(session_id)
        if gone is not None and self.persistent.writer is not None:
            self.persistent.writer.forget(session_id)  # perhaps live elsewhere before
        return gone

    def resume(
        self, from_session_id: str, session_id: str | None = None, tenant: str | None = None
    ) -> Opened:
        """Continue a session another instance (or this one) wrote to the durable store, under
        a new id: its record read and checked (each refusal its own error), its images'
        features taken from this pool where it holds them, else from the store, and the
        session kept parked here; its next turn recomputes its KV from them, no vision tower
        run (docs/engine/sessions.md §Durable store). ``session_id``, ``tenant``: as ``open``'s.
        The record it came from goes once the new one is written."""
        durable = self._durable()
        _check_tenant(tenant)
        session_id = full_session_id(session_id)
        self.store.check_id_free(session_id)
        record = durable.read(from_session_id, time.time())
        if record.snapshot.tenant != tenant:  # another tenant's: as if there were none
            raise RecordNotFound(f"no record of session {from_session_id} for this tenant")
        snapshot = self._continue(record, session_id, from_session_id)
        session = self.store.session(session_id)
        return Opened(
            session_id,
            self.store.expires_at(session),
            prefill_tokens=0,
            image_tokens=session.image_tokens,
            resumed=Resumed(from_session_id, snapshot.turns, len(snapshot.images)),
        )

    def flush_durable(self, timeout_s: float) -> list[str]:
        """Wait, at most ``timeout_s``, until every committed state is in the durable store;
        the ids whose latest state is not (none without a durable store)."""
        writer = self.persistent.writer
        return [] if writer is None else writer.flush(timeout_s)

    def reap(self) -> int:
        """Free the expired idle sessions now; how many went (llava.sessions.reaper)."""
        return self.store.reap()

    # -- what a placement needs (llava.shards) ---------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.loaded.device

    @property
    def alive(self) -> bool:
        """Its loop still serves (false once stopped, or its device lost)."""
        return self.loop.alive

    def holds(self, session_id: str) -> bool:
        """Whether the session is live here."""
        return session_id in self.store

    def remembers(self, session_id: str) -> bool:
        """Live here, or gone recently enough that its id still answers why."""
        return self.store.remembers(session_id)

    def check_id_free(self, session_id: str) -> None:
        """Refuse (SessionIdInUse) an id live or remembered here."""
        self.store.check_id_free(session_id)

    def holds_image(self, image: KeyedImage) -> bool:
        """Whether the pool holds this image's features for its key's sessions."""
        return image.key is not None and self.memory.image_shape(image.key) is not None

    def free_bytes(self) -> int:
        """Device bytes an open could have now: the pool's free blocks and those that opens in
        flight hold (they are counted apart, by the caller)."""
        pool = self.memory.pool
        return pool.free_blocks * pool.bytes_per_block + self.memory.opening_bytes()

    def session_bytes(self, session_id: str) -> int:
        """Everything the session holds now, device and host (SessionNotFound: gone)."""
        return self.memory.held_bytes(self.store.session(session_id).holding)

    def open_bytes(self) -> int:
        """Device bytes an open with an image reserves: its opening prompt's KV and its
        features (the largest image's, for NeXT), in whole pool blocks."""
        pool, hidden = self.memory.pool, self.loaded.model.config.text_config.hidden_size
        image_tokens = most_image_tokens(self.loaded.processor)
        tokens = len(self.loaded.prompt.opening_ids(True, image_tokens))
        per_token = pool.bytes_per_block // pool.block_tokens
        return session_kv_bytes(tokens, per_token, pool.block_tokens) + session_feature_bytes(
            image_tokens, hidden, pool.kv.element_size(), pool.bytes_per_block
        )

    def stats(self) -> EngineStats:
        counters = self.store.counters()  # first: it sweeps expired sessions
        memory = self.memory.stats()
        return EngineStats(
            memory.sessions_by_tier,
            memory.bytes_by_tier,
            memory.budget,
            counters,
            memory.counters,
            self.runner.counters(),
            self.persistent.writer.counters() if self.persistent.writer else DurableCounters(),
        )

    def check_integrity(self) -> None:
        """Raise IntegrityError if the memory's books or the store disagree with what is
        held (tests; and the loop when idle with check_memory_when_idle)."""
        self.store.check_integrity()

    def stop(self) -> None:
        """End the loop thread (what it still runs or holds fails) and the durable store's
        writer (what it has not written stays unwritten: ``flush_durable`` first)."""
        self.loop.stop(wait=True)
        self.persistent.stop()

    # -- the durable store ------------------------------------------------------------------
    def _durable(self) -> DurableSessions:
        if self.durable is None:
            raise DurableStoreOff(
                "this endpoint keeps no durable store (the durable_store setting), so no "
                "session can be resumed here: open a new one"
            )
        return self.durable

    def _continue(self, record: Record, session_id: str, replaces: str | None) -> Snapshot:
        """Keep the record's session here as ``session_id``, parked with its features."""
        features = [
            self._image_features(key, tokens, name)
            for (key, tokens), name in zip(record.snapshot.images, record.features, strict=True)
        ]
        snapshot = replace(
            record.snapshot,
            session_id=session_id,
            last_used_wall=time.time() if replaces else record.snapshot.last_used_wall,
            ttl_s=self.config.session_ttl_s,
        )
        shares = self.config.prefix_sharing != "off"
        with self.store.opening():
            self.persistent.take(self.store, snapshot, features, shares, replaces=replaces)
        return snapshot

    def _image_features(self, key: str | None, tokens: int, name: str) -> torch.Tensor:
        """An image's features: this pool's copy where it holds them, else the store's."""
        if key is not None and self.config.prefix_sharing != "off":
            held = self.memory.image_features(bytes.fromhex(key))
            if held is not None and held.shape[0] == tokens:
                return held
        return self._durable().features(name, tokens)

    def _adopt_unknown(self, session_id: str) -> None:
        """An id this engine neither holds nor remembers, but the durable store does (its
        instance went, and the router sent its call here): adopted under the same id, with
        its expiry, before the turn. Without a record it stays unknown (SessionNotFound)."""
        if self.durable is None or self.store.remembers(session_id):
            return
        with self._adopting:  # two calls of one id at once: one adoption
            if self.store.remembers(session_id):
                return
            try:
                record = self.durable.read(session_id, time.time())
            except RecordNotFound:
                return  # the store's answer below: unknown
            except EngineError as refused:  # expired, corrupt, foreign: say why, as gone
                raise SessionNotFound(
                    f"session {session_id} is not held here, and its record cannot be "
                    f"resumed: {refused.message}"
                ) from None
            self._continue(record, session_id, replaces=None)
            logger.info("durable store: adopted session %s", log_id(session_id))

    # -- conversations: helpers -------------------------------------------------------------
    def _images_held(self, conversation: Conversation, session_id: str | None) -> int:
        """How many of the session's images the conversation shows first, in its order."""
        if session_id is None:
            return 0
        self._adopt_unknown(session_id)
        session = self.store.session(session_id)
        return images_kept(held_refs(session.messages, session.opening_images), conversation)

    def _checked(self, conversation: Conversation) -> Conversation:
        """Each question checked (and stripped) as ``ask`` checks it; each answer tokenizable."""
        turns = []
        for turn in conversation.turns:
            if turn.answer is not None:
                self._check_tokenizes(turn.answer, "an assistant message")
            question = self._check_question(turn.question)
            turns.append(ChatTurn(question, turn.images, turn.answer))
        return Conversation(tuple(turns), conversation.system)

    def _blank(
        self,
        session_id: str | None,
        conversation: Conversation,
        system: str,
        tenant: str | None,
        added: list[AddedImage],
        transient: bool,
    ) -> str:
        """A new session holding nothing yet: its first turn starts on whatever prefix the
        pool holds for the conversation. Its opening (what ``prefix_sharing: opening`` shares:
        the prompt up to the first image under the operator's system prompt) is counted as an
        open's would be; ``added``: the conversation's images, the first one's tokens in it."""
        session_id = full_session_id(session_id)
        self.store.check_id_free(session_id)
        opening_tokens = 0  # a caller's own system prompt: nothing is shared as an opening
        if not conversation.system:
            with_image = bool(conversation.turns[0].images)
            tokens = added[0].tokens if with_image else 0
            opening = self.loaded.prompt.opening_ids(with_image, tokens, system)
            opening_tokens = len(opening)
        sharing = Sharing(tenant, opening_tokens)
        with self.store.opening():
            session = Session(session_id, [], self.memory.hold(), sharing=sharing)
            session.messages, session.transient = opening_messages(system), transient
            with session.lock:
                self.store.add(session)
        return session_id

    def _chat_turn(
        self,
        session_id: str,
        conversation: Conversation,
        system: str,
        params: GenerationParams,
        on_token,
        cancelled,
        kept: int,
        added: list[AddedImage],
    ) -> Answer:
        """The turn: the session holds the conversation's first ``kept`` images, ``added``
        are the rest."""
        request = ChatRequest(
            self.context,
            self.config.turn_deadline_s,
            session_id,
            conversation,
            system,
            params,
            on_token,
            cancelled,
            kept,
            added,
        )
        with self.store.asking(session_id):
            return self.loop.submit(request)

    def _images_past(
        self, session_id: str, conversation: Conversation, kept: int
    ) -> list[AddedImage]:
        """The conversation's images after the session's first ``kept``, as a turn brings
        them; each must be loaded (``images_to_fetch``)."""
        images = conversation.images[kept:]
        missing = [kept + i for i, image in enumerate(images) if image.image is None]
        if missing:  # the caller asked images_to_fetch before the session moved on
            raise SessionChanged(
                f"session {session_id} no longer holds the conversation's images {missing} "
                "(another request's turn came first); send the request again"
            )
        return [self._added_image(session_id, image.image) for image in images]

    # -- helpers ---------------------------------------------------------------------------
    def _pixels(self, image: Image.Image) -> dict[str, torch.Tensor]:
        """The processor's preprocessing: runs in the caller's thread, off the loop."""
        image_processor = self.loaded.processor.image_processor
        return vision_inputs(image, image_processor, self.loaded.image_aspect_ratio)

    def encode_image(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The vision tower (llava.model.vision): (image tokens, hidden). Every path calls it
        so: an open's or a turn's image (``_encoder``), the warm-up."""
        return image_features(self.loaded.model, inputs, self.loaded.dtype)

    def _encoder(self, image: KeyedImage) -> Callable[[], torch.Tensor]:
        """The image's features when the loop finds the pool does not hold them. Preprocessed
        now, in the caller's thread, unless the pool holds them now: then only if they go
        before the loop admits the request."""
        if self.holds_image(image):
            return lambda: self.encode_image(self._pixels(image.image))
        pixels = self._pixels(image.image)
        return lambda: self.encode_image(pixels)

    def _added_image(self, session_id: str, image: Image.Image | KeyedImage) -> AddedImage:
        """A turn's image keyed for its session's tenant, counted and preprocessed here, in
        the caller's thread (SessionNotFound: the session is gone)."""
        if not isinstance(image, KeyedImage):
            tenant = self.store.session(session_id).sharing.tenant
            image = self.keyed_image(image, tenant)
        return self._added_keyed(image)

    def _added_keyed(self, image: KeyedImage) -> AddedImage:
        """A keyed image as a turn brings it: counted and preprocessed in the caller's thread."""
        loaded = self.loaded
        tokens = image_tokens_of(image.image, loaded.processor, loaded.image_aspect_ratio)
        return AddedImage(image.key, tokens, self._encoder(image))

    def _params(self, parameters: dict | None) -> GenerationParams:
        return GenerationParams.from_mapping(
            parameters,
            default_max_new_tokens=self.config.default_max_new_tokens,
            max_new_tokens_limit=self.config.max_new_tokens_limit,
        )

    def _check_system(self, system) -> str:
        if system is None:
            return self.config.system_prompt
        if not isinstance(system, str):
            raise InvalidRequest("'system' must be a string: the session's system prompt")
        if len(system) > self.config.max_system_chars:
            raise InvalidRequest(
                f"the system prompt has {len(system)} characters; the limit is "
                f"{self.config.max_system_chars}"
            )
        if system and not self.renders_system:
            raise InvalidRequest(
                "this model's chat template has no system role: leave out 'system'"
            )
        self._check_tokenizes(system, "'system'")
        return system

    def _check_question(self, question) -> str:
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("'inputs' must be a non-empty question string")
        if len(question) > self.config.max_question_chars:
            raise InvalidRequest(
                f"the question has {len(question)} characters; the limit is "
                f"{self.config.max_question_chars}"
            )
        self._check_tokenizes(question, "'inputs'")
        return question.strip()

    def _check_tokenizes(self, text: str, field: str) -> None:
        """Text the tokenizer refuses (a lone surrogate, which is not UTF-8) is the caller's
        error, found here: met in the loop it would count as the shard failing (llava.shards)."""
        try:
            self.loaded.tokenizer(text, add_special_tokens=False)
        except Exception as error:
            raise InvalidRequest(
                f"{field} cannot be tokenized ({type(error).__name__}): send it as UTF-8 text"
            ) from None


def _check_tenant(tenant) -> None:
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise InvalidRequest(f"'tenant' must be a non-empty string or None, got {echo(tenant)}")


def _check_rewind(turns) -> None:
    """The type and sign here; whether the session holds that many turns, at its turn."""
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 0:
        raise InvalidRequest(f"'rewind_turns' must be an integer >= 0, got {echo(turns)}")
