"""Which waiting requests start, and which ids each running one feeds to the next step.

Pure bookkeeping (no model, no store), so the policy is testable alone:
- Requests start in arrival order, at most ``max_batch`` running at once. Requests of one
  session (same ``order_key``) start strictly one after another: a second ask waits until
  the first has finished, and no later ask of that session overtakes it.
- A step feeds every decoding request its one id, and the prefilling requests (first come,
  first served) up to ``prefill_chunk_tokens`` ids between them, so a long prefill delays the
  decodes sharing its steps by a bounded amount ("mixed"). With ``mixed=False`` prefill
  steps and decode steps alternate instead (docs/engine/scheduling.md §Mixed or alternating steps).
- A request the memory manager cannot fit now waits while other requests run, since their
  sessions turn idle (movable) when they end. For ``wait_for_room_s`` it waits rather than
  have idle sessions dropped or parked for it; after that (or at once when nothing runs, since
  nothing would free) it may (``may_drop``). It is refused Busy once nothing runs or its
  deadline has passed (``waits_for_memory``; the order: docs/engine/memory.md §Memory policy).
"""

from __future__ import annotations

from typing import Protocol


class Schedulable(Protocol):
    order_key: str | None  # requests with the same key run in arrival order, one at a time
    pending: int  # ids not yet fed to the model
    prefilling: bool  # True until the prompt has been fed (it then decodes one id a step)
    deadline: float  # the clock's time by which it must have ended


class Scheduler:
    def __init__(
        self,
        max_batch: int = 32,
        prefill_chunk_tokens: int = 512,
        mixed: bool = True,
        wait_for_room_s: float = 0.0,
    ):
        if max_batch < 1 or prefill_chunk_tokens < 1 or wait_for_room_s < 0:
            raise ValueError("max_batch, prefill_chunk_tokens >= 1 and wait_for_room_s >= 0")
        self.max_batch = max_batch
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.mixed = mixed
        self.wait_for_room_s = wait_for_room_s
        self.waiting: list[Schedulable] = []
        self.running: list[Schedulable] = []
        self._short_since: dict[Schedulable, float] = {}  # first found short of memory
        self._last_was_prefill = False

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, request: Schedulable) -> None:
        self.waiting.append(request)

    def admissible(self) -> list[Schedulable]:
        """Waiting requests that may start now, in arrival order; the caller starts each one
        (``start``), drops it (``remove``), or leaves it waiting (it is offered again)."""
        taken = {r.order_key for r in self.running if r.order_key is not None}
        slots = self.max_batch - len(self.running)
        chosen = []
        for request in self.waiting:
            if slots == 0:
                break
            key = request.order_key
            if key is not None:
                if key in taken:
                    continue
                taken.add(key)  # later requests of this session wait behind this one
            chosen.append(request)
            slots -= 1
        return chosen

    def may_drop(self, request: Schedulable, now: float) -> bool:
        """Whether idle sessions may be dropped or parked to make room for ``request`` now:
        when nothing runs, or once it has waited ``wait_for_room_s`` for running turns."""
        since = self._short_since.get(request)
        return not self.running or (since is not None and now - since >= self.wait_for_room_s)

    def waits_for_memory(self, request: Schedulable, now: float) -> bool:
        """Whether ``request``, short of memory, stays waiting (True) or is refused Busy."""
        self._short_since.setdefault(request, now)
        return bool(self.running) and now < request.deadline

    def start(self, request: Schedulable) -> None:
        self.waiting.remove(request)
        self.running.append(request)
        self._short_since.pop(request, None)

    def remove(self, request: Schedulable) -> None:
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)
        self._short_since.pop(request, None)

    def plan(self) -> list[tuple[Schedulable, int]]:
        """The next step: (request, how many of its pending ids it feeds)."""
        decodes = [(r, 1) for r in self.running if not r.prefilling and r.pending]
        prefills = []
        budget = self.prefill_chunk_tokens
        for request in self.running:
            if request.prefilling and request.pending and budget > 0:
                count = min(request.pending, budget)
                prefills.append((request, count))
                budget -= count
        if self.mixed:
            return prefills + decodes
        prefill_turn = prefills and not (decodes and self._last_was_prefill)
        self._last_was_prefill = bool(prefill_turn)
        return prefills if prefill_turn else decodes
