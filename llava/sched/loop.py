"""The engine loop: one thread that owns the model and runs every request, step by step.

Callers (many handler threads) put requests in an inbox and wait on their futures. Each
iteration the loop starts what the scheduler admits, ends requests that were cancelled or ran
out of time, then runs one step over the scheduler's plan and hands each request its next
id. A request that fails fails alone: its future gets the exception, the others go on
(docs/engine/scheduling.md §Engine loop); one the device ran out of memory for is answered
KV_MEMORY_FULL (``out_of_memory``). The one exception is an error that leaves the device
unusable (``device_lost``): then every request fails, the loop stops and ``on_fatal`` is told.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from llava.errors import Busy, ShardFailed
from llava.exec.runner import Runner, StepInput
from llava.kv.memory import Shortfall
from llava.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


# What a CUDA error that poisons the device's context says (a device-side assert, an illegal
# address): every later call on that device fails too, so nothing it runs can succeed again.
_DEVICE_LOST_MESSAGES = ("CUDA error", "device-side assert", "illegal memory access")


def device_lost(error: BaseException) -> bool:
    """Whether ``error`` leaves the device unusable for this process: torch's
    ``AcceleratorError`` (where torch has it) or a RuntimeError that says so. Running out of
    memory is not: the context survives it (``out_of_memory``)."""
    if out_of_memory(error):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _DEVICE_LOST_MESSAGES)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory: a step's activations or the
    vision tower's did not fit beside the pool (the headroom, docs/engine/memory.md)."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)


def device_memory_full(error: BaseException) -> Busy:
    """What a request the device had no memory for is answered: KV_MEMORY_FULL, to be retried
    (its undo left every session as it was), not an internal error."""
    busy = Busy(
        "the device ran out of memory for this request (its activations did not fit beside "
        "the sessions' memory); no session lost anything: retry"
    )
    busy.__cause__ = error
    return busy


class Request(Protocol):
    """What the loop runs (llava.sched.work): an opening prefill or a question's turn."""

    future: Future
    deadline: float  # time.monotonic() by which it must have ended
    order_key: str | None
    pending: int
    prefilling: bool

    def admit(self, may_drop: bool) -> Shortfall | None:
        """Take what the request needs (session, memory); all or nothing. ``may_drop``:
        whether idle sessions may be dropped or parked for it (llava.kv.memory's order).
        Returns a Shortfall if memory is short now (it waits, or fails Busy); raises any error
        that fails the request."""

    def stop_reason(self, now: float) -> str | None:
        """Why it must end before the next step ("deadline", "cancelled"), or None."""

    def step_input(self, n: int) -> StepInput:
        """Its next ``n`` pending ids, to feed this step."""

    def rewind(self) -> None:
        """Undo the inputs taken since the last ``accept`` (a step that raised)."""

    def accept(self, token: int) -> str | None:
        """Its next id after a step (chosen on the device by its step input's chooser);
        returns why it ended ("eos", "max_new_tokens"), or None."""

    def finish(self, reason: str) -> None:
        """Commit and resolve the future."""

    def fail(self, error: BaseException) -> None:
        """Undo what it holds and resolve the future with ``error``."""


class EngineLoop:
    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        clock: Callable[[], float],
        on_idle: Callable[[], None] | None = None,
    ):
        self.runner = runner
        self.on_idle = on_idle  # called each time the loop goes idle (a debug check)
        # Called once, from the loop thread, with the error after which the device is lost
        # (``device_lost``): the engine stays TorchServe-free, its owner decides what to end.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.scheduler = scheduler
        self._clock = clock
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        # Once the thread has ended its last requests, nothing more may enter the inbox (it
        # would wait for ever): ``_closed`` says so, under ``_closing``, with the error to give.
        self._closing = threading.Lock()
        self._closed = False
        self._close_error: Exception = RuntimeError("the engine was stopped")
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0  # how many model steps ran (the bench counts decode steps with it)

    def start(self) -> EngineLoop:
        self._thread.start()
        # A daemon thread still inside torch when the interpreter tears down can abort the
        # process ("terminate called without an active exception"): end it first.
        atexit.register(_stop_at_exit, weakref.ref(self))
        return self

    def stop(self, wait: bool = False, timeout: float | None = None) -> None:
        self._inbox.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The thread runs and was not told to stop: what is submitted will be answered."""
        return self._thread.is_alive() and not self._stopped

    def submit(self, request: Request) -> Any:
        """Queue ``request`` and wait for its result (raises what it failed with)."""
        self._put(request)
        return request.future.result()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the loop thread between two steps and return its result."""
        future: Future = Future()
        self._put((fn, future))
        return future.result()

    def _put(self, item) -> None:
        with self._closing:
            if self._closed:
                raise self._close_error
            self._inbox.put(item)

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        self.runner.enter_thread()
        lost: BaseException | None = None
        while not self._stopped:
            try:
                self._iteration()
            except Exception as error:
                if device_lost(error):  # nothing can run on this device again
                    lost = error
                    self._stopped = True
                    continue
                # a bug in the loop itself: fail what runs, keep serving
                logger.exception("engine loop iteration failed; failing its requests")
                for request in list(self.scheduler.running):
                    self._fail(request, RuntimeError("internal error in the engine loop"))
        if lost is not None:
            logger.critical("the engine's device failed; its loop stops", exc_info=lost)
            self._close_error = ShardFailed(
                f"the engine's device failed ({type(lost).__name__}) and this engine stopped: "
                "retry once the server has restarted"
            )
        self._close()
        if lost is not None and self.on_fatal is not None:
            self.on_fatal(lost)  # left alone, the loop would fail every request, looking alive

    def _close(self) -> None:
        """Fail every request, those still in the inbox too, with ``_close_error``."""
        with self._closing:
            self._closed = True
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self._fail(request, self._close_error)
        while not self._inbox.empty():
            item = self._inbox.get()
            if isinstance(item, tuple):
                item[1].set_exception(self._close_error)
            elif item is not None:
                self._settle(item, self._close_error)

    def _iteration(self) -> None:
        if self.scheduler.idle and self.on_idle is not None:
            try:
                self.on_idle()
            except Exception:  # a debug check: say so loudly, keep serving
                logger.exception("the engine's idle check failed")
        self._receive(block=self.scheduler.idle)
        self._admit()
        now = self._clock()
        for request in list(self.scheduler.running):
            reason = self._guarded(request, request.stop_reason, now)
            if reason is not None:
                self._end(request, reason)
        plan = self.scheduler.plan()
        if plan:
            self._step(plan)

    def _receive(self, block: bool) -> None:
        """Move the inbox into the scheduler; with ``block``, wait for the first item."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                self._stopped = True
                return
            if isinstance(item, tuple):
                fn, future = item
                _resolve(future, fn)
            else:
                self.scheduler.add(item)

    def _admit(self) -> None:
        for request in self.scheduler.admissible():
            try:
                shortfall = request.admit(self.scheduler.may_drop(request, self._clock()))
            except BaseException as error:
                self._fail(request, error)
                continue
            if shortfall is not None:
                if not self.scheduler.waits_for_memory(request, self._clock()):
                    busy = Busy(shortfall.message, retry_after_s=shortfall.retry_after_s)
                    self._fail(request, busy)
            else:
                self.scheduler.start(request)
                if not request.pending:  # nothing to feed (an opening without ids)
                    self._end(request, "eos")

    def _step(self, plan) -> None:
        inputs = []
        for request, n in plan:
            inputs.append(self._guarded(request, request.step_input, n))
        plan = [(r, n) for (r, n), i in zip(plan, inputs, strict=True) if i is not None]
        inputs = [i for i in inputs if i is not None]
        if not inputs:
            return
        try:
            ids = self.runner.next_ids(inputs)
        except Exception as error:  # find which request(s) the step fails for, alone
            if device_lost(error):  # no request alone can succeed on this device
                raise
            if out_of_memory(error):  # alone, each step needs less
                self.runner.out_of_memory()
            logger.exception("a step of %d sequences failed; retrying each alone", len(inputs))
            for request, _n in plan:
                request.rewind()
            self._step_alone(plan)
            return
        self.steps += 1
        for (request, _n), token in zip(plan, ids, strict=True):
            self._accept(request, token)

    def _step_alone(self, plan) -> None:
        for request, n in plan:
            try:
                token = self.runner.next_ids([request.step_input(n)])[0]
            except Exception as error:
                request.rewind()
                self._fail(request, error)
            else:
                self._accept(request, token)

    def _accept(self, request: Request, token: int) -> None:
        reason = self._guarded(request, request.accept, token)
        if reason is not None:
            self._end(request, reason)

    def _guarded(self, request: Request, method, *args):
        """``method(*args)``; if it raises, the request fails (alone) and None is returned."""
        try:
            return method(*args)
        except Exception as error:
            self._fail(request, error)
            return None

    def _end(self, request: Request, reason: str) -> None:
        self.scheduler.remove(request)
        try:
            request.finish(reason)
        except Exception as error:
            self._settle(request, error)

    def _fail(self, request: Request, error: BaseException) -> None:
        if request in self.scheduler.running or request in self.scheduler.waiting:
            if device_lost(error):  # not this request's failure but the device's: _run
                raise error
            if out_of_memory(error):
                self.runner.out_of_memory()
                error = device_memory_full(error)
            self.scheduler.remove(request)
            self._settle(request, error)

    @staticmethod
    def _settle(request: Request, error: BaseException) -> None:
        """Fail ``request``; whatever its undo raises, its caller still gets an answer."""
        try:
            request.fail(error)
        except Exception:
            logger.exception("undoing a failed request failed")
        if not request.future.done():
            request.future.set_exception(error)


def _stop_at_exit(loop_ref: weakref.ref) -> None:
    loop = loop_ref()
    if loop is not None:
        loop.stop(wait=True, timeout=10)


def _resolve(future: Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except BaseException as error:
        future.set_exception(error)
