"""Engine shards: one worker drives every device, one ``Engine`` per device.

``ShardedEngine`` has the engine's surface (``open``, ``ask``, ``close``, ``warm_up``,
``check_integrity``, ``stop``) over N engines, each with its own model copy, loop thread, KV
pool and memory manager. An open is placed on the shard with the most free device memory
(ties: the fewest requests in flight); every later call of that session goes to its shard
by id. A shard's failure fails only the requests it runs, as ``ShardFailed``
(docs/engine/scheduling.md §Engine shards). A shard whose device is lost, or every shard
failing at once, is fatal to the whole engine: ``on_fatal`` is told, once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llava.config import EngineConfig
from llava.engine import Answer, Engine, EngineStats, KeyedImage, Opened
from llava.errors import EngineError, SessionIdInUse, ShardFailed
from llava.kv.budget import host_budget, memory_budget
from llava.kv.integrity import IntegrityError
from llava.model.loading import load_model, shard_devices
from llava.sessions.location import persistence
from llava.sessions.store import full_session_id

__all__ = ["ShardStats", "ShardedEngine"]

# A shard whose last this many requests all failed is not ready: new sessions go to the
# others while any is ready (its own sessions stay on it; one success makes it ready again).
FAILURES_UNTIL_UNREADY = 3


@dataclass(frozen=True)
class ShardStats:
    """One shard's snapshot, for metrics and readiness."""

    shard: int
    device: str
    ready: bool  # serving, and not failing every request: new sessions may be placed on it
    in_flight: int  # opens and turns running or waiting on it now
    engine: EngineStats


def shard_persistence(config: EngineConfig, count: int) -> list[dict[str, Any]]:
    """Each shard's persistent tier: with one shard, ``persist_dir`` itself; with several,
    shard k's own ``shard-<k>`` under it (a restarted worker, same device list, finds each
    session on the shard that held it) and an even share of the directory's cap."""
    if config.persist_dir is None or count == 1:
        return [{}] * count
    location = persistence(config)
    return [
        {
            "persist_dir": str(Path(location.directory) / f"shard-{k}"),
            "persist_max_bytes": location.max_bytes // count,
        }
        for k in range(count)
    ]


class ShardedEngine:
    def __init__(self, engines: Sequence[Engine]):
        if not engines:
            raise ValueError("a sharded engine needs at least one engine")
        self.shards = tuple(engines)
        self.ttl_s = engines[0].config.session_ttl_s  # for llava.sessions.reaper.Reaper
        self._lock = threading.Lock()
        self._home: dict[str, int] = {}  # session id → shard, live or remembered by it
        self._opening: dict[str, int] = {}  # session id → shard, for the opens in flight
        self._in_flight = [0] * len(engines)
        self._failures = [0] * len(engines)  # requests failed in a row, per shard
        # Told once, with the error, when this engine can serve nothing more (a shard's device
        # lost, or no shard ready): its owner ends the process so it restarts (handlers/).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._fatal_told = False
        for engine in engines:
            engine.on_fatal = self._fatal
        # The cost of one open in flight: what the latest open came to hold (at first, what
        # an open with an image reserves).
        self._open_bytes = engines[0].open_bytes()

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, clock: Callable[[], float] = time.monotonic
    ) -> ShardedEngine:
        """Load one model copy per device of ``config.device`` and build the engines; any
        shard that cannot load fails the whole start (the ones built are stopped). The host
        tier is the instance's RAM: ``host_budget`` split evenly across the shards."""
        devices = shard_devices(config.device)
        engines: list[Engine] = []
        try:
            loaded = [
                load_model(config.model_dir, str(d), config.dtype, config.attn_implementation)
                for d in devices
            ]
            host = host_budget(config) // len(devices)
            on_device = Counter(devices)  # measured before any shard takes its pool
            budgets = [
                memory_budget(config, d, host_bytes=host, sharing=on_device[d]) for d in devices
            ]
            persistence = shard_persistence(config, len(devices))
            for model, budget, persist in zip(loaded, budgets, persistence, strict=True):
                shard_config = dataclasses.replace(config, device=str(model.device), **persist)
                engines.append(Engine(model, shard_config, budget, clock=clock))
        except BaseException:
            for engine in engines:
                engine.stop()
            raise
        return cls(engines)

    @property
    def image_side(self) -> int:
        """Every shard holds the same checkpoint: the side its processor resizes to
        (llava.engine.Engine.image_side)."""
        return self.shards[0].image_side

    def warm_up(self) -> float:
        """Warm every shard (llava.engine.Engine.warm_up); the seconds it took in all."""
        start = time.perf_counter()
        for engine in self.shards:
            engine.warm_up()
        return time.perf_counter() - start

    # -- the operations --------------------------------------------------------------------
    def open(
        self,
        image=None,
        session_id: str | None = None,
        system: str | None = None,
        tenant: str | None = None,
    ) -> Opened:
        """Open on the placed shard (``_start``). The image is keyed once, here
        (``Engine.keyed_image``)."""
        if image is not None and not isinstance(image, KeyedImage):
            image = self.shards[0].keyed_image(image, tenant)
        return self._start(
            session_id,
            self._holder_of(image),
            lambda engine, new_id: engine.open(image, new_id, system, tenant),
        )

    def resume(
        self, from_session_id: str, session_id: str | None = None, tenant: str | None = None
    ) -> Opened:
        """``Engine.resume`` on the placed shard, its new id bound as an open's is."""
        return self._start(
            session_id,
            None,
            lambda engine, new_id: engine.resume(from_session_id, new_id, tenant),
            learn=False,  # parked: it holds no device bytes until its next turn
        )

    def flush_durable(self, timeout_s: float) -> list[str]:
        """Every shard's ``Engine.flush_durable`` within one ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        left: list[str] = []
        for engine in self.shards:
            left += engine.flush_durable(max(0.0, deadline - time.monotonic()))
        return left

    def _start(
        self,
        session_id: str | None,
        holder: int | None,
        start: Callable[[Engine, str], Opened],
        learn: bool = True,
    ) -> Opened:
        """Start a session on the placed shard. The id (``full_session_id``: the caller's,
        perhaps with a random part, or a new one) is bound to that shard before any model
        work, so an id is unique across the shards. ``learn``: what it holds now is what an
        open in flight counts (``_open_bytes``)."""
        session_id = full_session_id(session_id)
        with self._lock:
            self._check_id_free(session_id)
            index = self._place(holder)
            self._home[session_id] = index
            self._opening[session_id] = index
        engine = self.shards[index]
        try:
            with self._running(index):
                opened = self._call(index, start, engine, session_id)
            if learn:
                self._learn_open_bytes(engine, session_id)
            return opened
        except BaseException:
            with self._lock:
                if not engine.remembers(session_id):
                    self._home.pop(session_id, None)
            raise
        finally:
            with self._lock:
                del self._opening[session_id]

    def ask(
        self,
        session_id: str,
        question: str,
        parameters: dict | None = None,
        on_token: Callable[[str, int | None], None] | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
        rewind_turns: int = 0,
        image=None,
    ) -> Answer:
        """``Engine.ask`` on the session's shard (which keys ``image`` for its tenant)."""
        return self._turn_on(
            session_id,
            "ask",
            session_id,
            question,
            parameters,
            on_token,
            cancelled=cancelled,
            rewind_turns=rewind_turns,
            image=image,
        )

    def _turn_on(self, session_id: str, method: str, *args, **kwargs) -> Any:
        """The session's shard's ``method`` (a turn), counted as running there."""
        index = self.shard_of(session_id)
        with self._running(index):
            return self._call(index, getattr(self.shards[index], method), *args, **kwargs)

    def images_to_fetch(self, conversation, session_id: str | None = None) -> list[int]:
        """``Engine.images_to_fetch`` on the session's shard (all of them without one)."""
        index = 0 if session_id is None else self.shard_of(session_id)
        return self._call(index, self.shards[index].images_to_fetch, conversation, session_id)

    def chat(
        self,
        conversation,
        session_id: str | None = None,
        parameters: dict | None = None,
        on_token: Callable[[str, int | None], None] | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
        tenant: str | None = None,
        new_session: bool = False,
    ) -> Answer:
        """``Engine.chat``: on the session's shard; a new session placed and bound as an
        open's is; a stateless answer on the placed shard. A new conversation's images are
        keyed once, here: the first one places it (the shard that holds it)."""
        options = dict(cancelled=cancelled, tenant=tenant)
        if session_id is not None and not new_session:
            return self._turn_on(
                session_id, "chat", conversation, session_id, parameters, on_token, **options
            )
        conversation = self.shards[0].keyed_conversation(conversation, tenant)
        images = conversation.images
        holder = self._holder_of(images[0].image if images else None)
        if new_session:
            return self._start(
                session_id,
                holder,
                lambda engine, new_id: engine.chat(
                    conversation, new_id, parameters, on_token, new_session=True, **options
                ),
            )
        with self._lock:
            index = self._place(holder)
        engine = self.shards[index]
        with self._running(index):
            return self._call(
                index, engine.chat, conversation, None, parameters, on_token, **options
            )

    def close(self, session_id: str) -> str | None:
        """``Engine.close`` on the session's shard (which remembers why an id is gone)."""
        index = self.shard_of(session_id)
        return self._call(index, self.shards[index].close, session_id)

    def shard_of(self, session_id: str) -> int:
        """The session's shard; an id no shard knows goes to shard 0, which says so."""
        with self._lock:
            index = self._bound(session_id)
        return 0 if index is None else index

    # -- upkeep and views ------------------------------------------------------------------
    def reap(self) -> int:
        """Expired sessions freed on every shard (llava.sessions.reaper.Reaper calls it); ids
        no shard remembers any more leave the id map, so it stays bounded."""
        reaped = sum(engine.reap() for engine in self.shards)
        with self._lock:
            for session_id, index in list(self._home.items()):
                opening = session_id in self._opening
                if not opening and not self.shards[index].remembers(session_id):
                    del self._home[session_id]
        return reaped

    def stats(self) -> list[ShardStats]:
        with self._lock:
            in_flight = list(self._in_flight)
            ready = [self._ready(i) for i in range(len(self.shards))]
        return [
            ShardStats(i, str(e.device), ready[i], in_flight[i], e.stats())
            for i, e in enumerate(self.shards)
        ]

    def check_integrity(self) -> None:
        """Every shard's books (llava.engine.Engine.check_integrity), and no session bound
        to one shard while it lives on another."""
        for engine in self.shards:
            engine.check_integrity()
        with self._lock:
            home = dict(self._home)
        for session_id, index in home.items():
            for other, engine in enumerate(self.shards):
                if other != index and engine.holds(session_id):
                    raise IntegrityError(f"a session bound to shard {index} lives on {other}")

    def stop(self) -> None:
        for engine in self.shards:
            engine.stop()

    # -- internals -------------------------------------------------------------------------
    def _bound(self, session_id: str) -> int | None:
        """The shard the id is bound to; an id a shard holds that the map never saw (a session
        not opened through this facade: re-attached at start) is bound to it here. Caller
        holds the lock."""
        index = self._home.get(session_id)
        if index is None:
            shards = enumerate(self.shards)
            index = next((i for i, e in shards if e.remembers(session_id)), None)
            if index is not None:
                self._home[session_id] = index
        return index

    def _check_id_free(self, session_id: str) -> None:
        """Refuse an id being opened, or one its shard holds live or remembers
        (SessionIdInUse); a binding the shard has forgotten is dropped. Caller holds the
        lock."""
        if session_id in self._opening:
            raise SessionIdInUse(
                f"session id {session_id} is being opened by another request; choose another "
                "id, or leave out 'extSessionID' to get a server-chosen one"
            )
        index = self._bound(session_id)
        if index is not None:
            self.shards[index].check_id_free(session_id)
            del self._home[session_id]

    def _ready(self, index: int) -> bool:
        return self.shards[index].alive and self._failures[index] < FAILURES_UNTIL_UNREADY

    def _holder_of(self, image: KeyedImage | None) -> int | None:
        """The shard that holds this image's features already for its key's sessions
        (sessions share an image's features and prefix within a shard and a tenant only)."""
        if image is None:
            return None
        return next((i for i, e in enumerate(self.shards) if e.holds_image(image)), None)

    def _place(self, holder: int | None = None) -> int:
        """The ready shard (else any serving one: failing is not stopped) with the most free
        device memory, counting each open in flight as the bytes an open came to hold,
        whether or not it has taken its blocks yet (so simultaneous opens spread); ties: the
        fewest requests in flight, then the lowest index. ``holder``, the shard that holds the
        image already, comes first while it is ready and has room for an open. Caller holds
        the lock."""
        ready = [i for i in range(len(self.shards)) if self._ready(i)]
        ready = ready or [i for i, e in enumerate(self.shards) if e.alive]
        if not ready:
            raise ShardFailed("no engine shard of this worker is serving; it must be restarted")

        opening = Counter(self._opening.values())

        def free(i: int) -> int:
            return self.shards[i].free_bytes() - opening[i] * self._open_bytes

        if holder in ready and free(holder) >= self._open_bytes:
            return holder
        return min(ready, key=lambda i: (-free(i), self._in_flight[i], i))

    @contextmanager
    def _running(self, index: int):
        with self._lock:
            self._in_flight[index] += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[index] -= 1

    def _learn_open_bytes(self, engine: Engine, session_id: str) -> None:
        try:
            held = engine.session_bytes(session_id)
        except EngineError:  # already gone (closed or evicted at once): nothing to learn
            return
        with self._lock:
            self._open_bytes = held

    def _call(self, index: int, method: Callable[..., Any], *args, **kwargs) -> Any:
        """``method`` of shard ``index``; what is not an engine error becomes ShardFailed,
        and counts against the shard's readiness."""
        try:
            result = self._shard_call(index, method, *args, **kwargs)
        except ShardFailed as failed:
            with self._lock:
                self._failures[index] += 1
                none_ready = not any(self._ready(i) for i in range(len(self.shards)))
            if none_ready:  # nothing left to place a session on: the worker answers nothing
                self._fatal(failed)
            raise
        except EngineError:  # the request's own fault: the shard served it
            self._count_success(index)
            raise
        self._count_success(index)
        return result

    def _fatal(self, error: BaseException) -> None:
        with self._lock:
            told, self._fatal_told = self._fatal_told, True
        if not told and self.on_fatal is not None:
            self.on_fatal(error)

    def _count_success(self, index: int) -> None:
        with self._lock:
            self._failures[index] = 0

    def _shard_call(self, index: int, method: Callable[..., Any], *args, **kwargs) -> Any:
        engine = self.shards[index]
        if not engine.alive:
            raise ShardFailed(
                f"engine shard {index} ({engine.device}) has stopped; its sessions are "
                "lost: open a new session"
            )
        try:
            return method(*args, **kwargs)
        except EngineError:
            raise
        except Exception as error:
            raise ShardFailed(
                f"engine shard {index} ({engine.device}) failed this request "
                f"({type(error).__name__}); sessions on other shards are unaffected: retry, "
                "or open a new session"
            ) from error
