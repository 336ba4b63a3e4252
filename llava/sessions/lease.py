"""A session taken for one turn: the lease (docs/engine/life-of-a-turn.md).

A request takes its session's state in one call, ``take``, and gives it back in one:
``commit`` (the turn's ids and messages) or ``abort``. Between the two the session is its
alone: pinned in memory, its turn lock held, never moved, expired or evicted. ``take`` does,
in this order and in this one place: begin the turn, render the prompt (the caller's
``render``: sched/ owns prompts), restore a host copy, keep the KV's common prefix with the
prompt, read back a parked session's features, start on a shared prefix, reserve the turn's
room. It returns a ``Shortfall`` (nothing taken, nobody lost anything) when memory is short
now; the request may try again (``take`` is repeatable until it succeeds).

An opening's lease is a session not yet in the store: its image's features are shared if the
pool holds them, else computed (the caller's ``encode``, once, kept across a wait for room);
its commit adds the session. A turn may bring images too (``AddedImage``), taken the same way
and held from then on; a turn's commit lets go of the images of the turns it rewound, its
abort of the images it brought. Either way the commit publishes the KV for the sessions its
sharing allows and writes the persistent tier before the reply goes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import NamedTuple

import torch

from llava.kv.holding import HeldImage, Holding, NewImage, Tier
from llava.kv.memory import MemoryManager, Shortfall
from llava.kv.pool import SessionKV
from llava.kv.prefix import block_keys, common_prefix_length
from llava.sessions.persist import BadEntry
from llava.sessions.session import Session, Sharing
from llava.sessions.store import SessionStore
from llava.sessions.tier import PersistentTier


@dataclass(frozen=True)
class Committed:
    expires_at: datetime  # the commit restarted the idle clock
    image_tokens: int  # of all the session's images
    images: int  # the session's images


@dataclass(frozen=True)
class AddedImage:
    """An image a turn brings: its content key (None: not shared), its image tokens as the
    processor counts them (the prompt is rendered before its features exist), and the vision
    tower on it (``encode()``: called only when the pool does not hold its features)."""

    key: bytes | None
    tokens: int
    encode: Callable[[], torch.Tensor]


class TurnPrompt(NamedTuple):
    """A turn's prompt ids, and how many of the session's images it shows before the turn's
    own (fewer than the session holds after a rewind)."""

    ids: list[int]
    images: int


class Leases:
    """Where requests take their sessions: the store, the memory manager and the persistent
    tier behind one door. ``prefix_sharing``: EngineConfig.prefix_sharing."""

    def __init__(
        self,
        store: SessionStore,
        memory: MemoryManager,
        tier: PersistentTier,
        image_token_id: int,
        prefix_sharing: str = "opening",
    ):
        self.store = store
        self.memory = memory
        self.tier = tier
        self.image_token_id = image_token_id
        self.prefix_sharing = prefix_sharing

    def turn(
        self,
        session_id: str,
        render: Callable[[Session], TurnPrompt],
        new_tokens: int,
        images: Sequence[AddedImage] = (),
    ) -> TurnLease:
        """A lease on a live session for one turn, not yet taken. ``render(session)``: the
        turn's prompt (called under the session's turn lock; may raise to refuse the turn);
        ``new_tokens``: the most the answer may add; ``images``: those the turn brings, in
        the order its prompt shows them after the session's."""
        return TurnLease(self, session_id, render, new_tokens, images)

    def opening(
        self,
        session_id: str,
        image_key: bytes | None,
        encode: Callable[[], torch.Tensor] | None,
        render: Callable[[int], list[int]],
        tenant: str | None = None,
        callers_system: bool = False,
    ) -> OpeningLease:
        """A lease on a session being opened, not yet taken. ``image_key``: what its image's
        features and prefix are shared under (None: not shared); ``encode()``: the image's
        features, when the pool does not hold them (None: a text-only session);
        ``render(image_tokens)``: the opening's prompt ids; ``callers_system``: the prompt
        holds the caller's own text (then none of it is shared as an opening)."""
        return OpeningLease(self, session_id, image_key, encode, render, tenant, callers_system)

    def prefix_keys(
        self,
        images: Sequence[tuple[bytes | None, int]],
        sharing: Sharing,
        ids: list[int],
        known: list[bytes] = (),
    ) -> list[bytes]:
        """The content keys of the full blocks of ``ids`` of a session with that ``sharing``
        (none when sharing is off); ``images``: the key and token count of each image ``ids``
        show; ``known``: the keys of its first blocks (llava.kv.prefix.block_keys). Under
        "opening", blocks past the opening's full ones are keyed for the session alone:
        another session's right guess of its text then finds no more than a wrong one."""
        if self.prefix_sharing == "off":
            return []
        bt = self.memory.pool.block_tokens
        own_from = sharing.opening_tokens // bt if self.prefix_sharing == "opening" else None
        return block_keys(
            ids,
            bt,
            images,
            self.image_token_id,
            known,
            tenant=sharing.tenant,
            own_from=own_from,
            own_salt=sharing.own_salt,
        )

    def _finish(self, session: Session, with_features: bool = False) -> None:
        """The committed KV: its unwritten blocks go back, its full blocks become reusable by
        the sessions its sharing allows, and the persistent tier keeps it."""
        holding = session.holding
        self.memory.crop(holding, holding.kv.length)  # reserved, not written
        ids = session.token_ids[: holding.kv.length]
        keys = self.prefix_keys(shown(holding.images), session.sharing, ids, holding.block_keys)
        self.memory.publish(holding, keys)
        if not session.transient:
            self.tier.write(session, with_features)

    def _committed(self, session: Session) -> Committed:
        return Committed(self.store.expires_at(session), session.image_tokens, session.images)


def shown(images: Sequence[HeldImage]) -> list[tuple[bytes | None, int]]:
    """What prefix keys need of the images a prompt shows (llava.kv.prefix.block_keys)."""
    return [(image.key, image.tokens) for image in images]


class _Lease:
    """What both leases give the request holding them."""

    holding: Holding | None = None
    ids: list[int]  # the prompt, once taken
    reused = 0  # its first ids already in the KV when taken (not computed again)
    images: list[HeldImage]  # those the prompt shows, in its order, once taken

    def __init__(self, leases: Leases):
        self._leases = leases
        self._computed: dict[int, torch.Tensor] = {}  # the images it adds, computed once each

    @property
    def kv(self) -> SessionKV:
        return self.holding.kv

    @property
    def image_tokens(self) -> int:
        """The image tokens the prompt shows."""
        return sum(image.tokens for image in self.images)

    def take(self, may_drop: bool = True) -> Shortfall | None:
        """Take the session's state for the turn (the module docstring says what, in which
        order); all or nothing: a Shortfall, or an error, leaves everything as it was.
        ``may_drop``: whether idle sessions may be dropped or parked for it (llava.kv.memory's
        ladder)."""
        held = self._acquire()
        try:
            shortfall = self._reserve(held, may_drop)
        except BaseException:
            self._give_back(held)
            raise
        if shortfall is not None:
            self._give_back(held)
            return shortfall
        self._taken(held)
        return None

    def features(self) -> torch.Tensor | None:
        """The features of the images the prompt shows, one after the other, to feed image
        tokens (read out of the pool)."""
        return self._leases.memory.features(self.holding, self.images)

    def _new_image(
        self, key: bytes | None, encode: Callable[[], torch.Tensor], index: int = 0
    ) -> tuple[NewImage, int]:
        """The ``index``-th image to add, and its image tokens: shared where the pool holds its
        features (asked just before the reservation that takes them: nothing reclaims them
        between), else computed once (kept across a wait for room)."""
        shape = None if key is None else self._leases.memory.image_shape(key)
        if shape is not None:
            return NewImage(key), shape[0]
        if index not in self._computed:
            self._computed[index] = encode()
        features = self._computed[index]
        return NewImage(key, features), features.shape[0]

    def rewind(self, length: int) -> None:
        """Forget what a failed step wrote past ``length`` (its blocks stay reserved)."""
        self._leases.memory.rewind(self.holding, length)


class TurnLease(_Lease):
    def __init__(
        self,
        leases: Leases,
        session_id: str,
        render: Callable[[Session], TurnPrompt],
        new_tokens: int,
        images: Sequence[AddedImage],
    ):
        super().__init__(leases)
        self.session_id = session_id
        self._render = render
        self._new_tokens = new_tokens
        self._added = list(images)
        self._read_back: list[torch.Tensor] | None = None  # a parked session's, read once
        self.session: Session | None = None

    @property
    def brought(self) -> list[HeldImage]:
        """The images this turn brought, once taken."""
        return self.images[len(self.images) - len(self._added) :]

    def _acquire(self) -> Session:
        return self._leases.store.begin_turn(self.session_id)

    def _give_back(self, session: Session) -> None:
        self._leases.store.end_turn(session)

    def _taken(self, session: Session) -> None:
        self.session, self.holding = session, session.holding
        if self._added:
            self.images += self.holding.images[-len(self._added) :]

    def _reserve(self, session: Session, may_drop: bool) -> Shortfall | None:
        prompt = self._render(session)
        self.ids = ids = prompt.ids
        memory, holding = self._leases.memory, session.holding
        self.images = holding.images[: prompt.images]
        total = len(ids) + self._new_tokens
        if holding.tier is Tier.HOST:  # its KV comes back first: then reused as usual
            shortfall = memory.restore(holding, may_drop)
            if shortfall is not None:
                return shortfall
        if holding.kv is not None:
            self.reused = self._keep_common_prefix(holding, session.token_ids)
            images = self._turns_images()
            return memory.grow(holding, total - self.reused, images, may_drop)
        features = self._parked_features(session)
        # at least one id is prefilled: its logits start the answer
        images = shown(self.images) + [(added.key, added.tokens) for added in self._added]
        keys = self._leases.prefix_keys(images, session.sharing, ids[:-1])
        shortfall = memory.start(holding, total, keys, features, self._turns_images(), may_drop)
        self.reused = 0 if shortfall else holding.kv.length  # a shared prefix, if any
        return shortfall

    def _turns_images(self) -> list[NewImage]:
        images = []
        for index, added in enumerate(self._added):
            image, tokens = self._new_image(added.key, added.encode, index)
            if tokens != added.tokens:  # the prompt counted them before they existed
                raise ValueError(f"the image has {tokens} features, {added.tokens} counted")
            images.append(image)
        return images

    def _keep_common_prefix(self, holding: Holding, history: list[int]) -> int:
        """Crop the KV to the longest prefix it shares with the prompt; return its length.

        Usually that is everything cached (the prompt only appends). It is less after a
        rewind, or where the tokenizer merges across the old boundary, e.g. an answer whose
        text re-tokenizes differently inside the next prompt (docs/engine/prompt-fidelity.md
        §Canonical prompt): the differing tail is prefilled again."""
        held = history[: holding.kv.length]
        # at least one id is prefilled: its logits start the answer
        reused = min(common_prefix_length(self.ids, held), len(self.ids) - 1)
        if len(holding.images) > len(self.images):  # a rewound turn brought an image
            reused = min(reused, self._first_image_not_shown(held))
        if reused < holding.kv.length:
            reused = self._leases.memory.crop(holding, reused)  # less inside a shared block
        return reused

    def _first_image_not_shown(self, held: list[int]) -> int:
        """Where ``held`` shows the first image the prompt does not (one a rewound turn
        brought): its KV is another image's even where the ids match, every image token
        being one id."""
        image_token_id, shown = self._leases.image_token_id, self.image_tokens
        for position, token in enumerate(held):
            if token == image_token_id:
                if shown == 0:
                    return position
                shown -= 1
        return len(held)

    def _parked_features(self, session: Session) -> Sequence[torch.Tensor]:
        """A parked session's features, one per image: its images', where the pool holds
        them, else read back from the persistent tier (once: kept across a wait for room).
        An entry that cannot be read loses the session (SESSION_EVICTED, logged with why)."""
        leases, holding = self._leases, session.holding
        if not holding.parked or leases.memory.share_features(holding):
            return ()
        if self._read_back is None:
            try:
                self._read_back = leases.tier.read_back(session)
            except BadEntry as e:
                why = f"its persisted features are unreadable: {e}"
                raise leases.store.lose(session, why) from None
        return self._read_back

    def commit(self, token_ids: list[int], messages: list[dict], turns: int) -> Committed:
        """The turn's conversation is the session's: ``token_ids`` (its KV holds them, and no
        more once cropped), ``messages`` and ``turns``, and the images its prompt shows; then
        the session is given back."""
        leases, session = self._leases, self.session
        holding = session.holding
        rewound = [image for image in holding.images if image not in self.images]
        leases.memory.drop_images(holding, rewound)
        session.token_ids, session.messages, session.turns = token_ids, messages, turns
        leases._finish(session, with_features=bool(rewound) or bool(self._added))
        leases.store.end_turn(session)
        self.session = None
        leases.store.record_turn(len(self.ids) - self.reused, self.reused)
        return leases._committed(session)

    def abort(self) -> None:
        """The turn failed: its KV (which may hold part of it) and the images it brought go,
        the history stays."""
        if self.session is not None:
            memory, holding = self._leases.memory, self.session.holding
            memory.drop_kv(holding)
            if self.brought:
                memory.drop_images(holding, self.brought)
            self._leases.store.end_turn(self.session)
            self.session = None


class OpeningLease(_Lease):
    def __init__(
        self,
        leases: Leases,
        session_id: str,
        image_key: bytes | None,
        encode: Callable[[], torch.Tensor] | None,
        render: Callable[[int], list[int]],
        tenant: str | None,
        callers_system: bool,
    ):
        super().__init__(leases)
        self.session_id = session_id
        self._image_key = image_key
        self._encode = encode
        self._render = render
        self._callers_system = callers_system
        self.sharing = Sharing(tenant)

    def _acquire(self) -> Holding:
        return self._leases.memory.hold()

    def _give_back(self, holding: Holding) -> None:
        self._leases.memory.release(holding)

    def _taken(self, holding: Holding) -> None:
        self.holding, self.reused = holding, holding.kv.length
        self.images = list(holding.images)

    def _reserve(self, holding: Holding, may_drop: bool) -> Shortfall | None:
        leases = self._leases
        new, image_tokens = [], 0
        if self._encode is not None:
            image, image_tokens = self._new_image(self._image_key, self._encode)
            new = [image]
        self.ids = self._render(image_tokens)
        opening_tokens = 0 if self._callers_system else len(self.ids)
        self.sharing = replace(self.sharing, opening_tokens=opening_tokens)
        images = [(image.key, image_tokens) for image in new]
        keys = leases.prefix_keys(images, self.sharing, self.ids)
        return leases.memory.start(holding, len(self.ids), keys, (), new, may_drop)

    def features(self) -> torch.Tensor | None:
        """Its image's features: at hand when this open computed them."""
        computed = self._computed.get(0)
        return computed if computed is not None else super().features()

    def commit(self, token_ids: list[int], messages: list[dict], turns: int = 0) -> Committed:
        """The session joins the store, written to the persistent tier before anyone else can
        use it."""
        leases = self._leases
        session = Session(self.session_id, token_ids, self.holding, sharing=self.sharing)
        session.messages, session.turns = messages, turns
        session.opening_images = len(self.holding.images)
        with session.lock:
            leases.store.add(session)
            self.holding = None  # the session owns it now
            leases._finish(session, with_features=True)
        return leases._committed(session)

    def abort(self) -> None:
        if self.holding is not None:
            self._leases.memory.release(self.holding)
            self.holding = None
