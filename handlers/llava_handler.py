"""TorchServe entry point, in async mode (model-config.yaml: ``asyncCommunication: true``).

TorchServe 0.12 runs ``await handler.handle(data, context)`` as its own asyncio task for every
request, on one event loop in the worker's main thread; ``initialize`` runs earlier, before
that loop exists. Each request's work (image fetch, the engine's blocking calls, sending chunks)
runs in a thread of ``pool``, so a slow image or a long turn holds up only its own request
while the engine batches the turns of all sessions (docs/architecture.md §Architecture).
``max_requests_in_flight`` requests hold a thread at once; one more is answered on the event
loop at once, 503 ``OVERLOADED`` with Retry-After, instead of waiting for a thread without bound.

The module defines exactly one class: TorchServe takes it as the entry point (a module-level
``handle`` function would be called at load time without being awaited).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

from handlers.errors import error_response
from handlers.service import LlavaService
from handlers.worker_socket import lock_worker_socket
from llava.errors import Overloaded, log_id

logger = logging.getLogger(__name__)
# What a worker whose engine can serve nothing more exits with: not 0, so the supervisor
# (serving/supervisor.py) sees the worker die and restarts the instance.
ENGINE_LOST_EXIT_CODE = 3


class LlavaHandler:
    def __init__(self):
        self.service: LlavaService | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.limit = 0  # requests served at once: max_requests_in_flight
        self.in_flight = 0  # only the event loop's thread counts, so no lock

    def initialize(self, context) -> None:
        lock_worker_socket()
        self.service = LlavaService.from_context(context)
        self.service.engine.on_fatal = end_worker
        self.limit = self.service.config.max_requests_in_flight
        self.pool = ThreadPoolExecutor(self.limit, thread_name_prefix="request")
        flush_on_sigterm(self.service)

    async def handle(self, data, context) -> list[str]:
        """One reply per row, and never an exception: in 0.12's async mode an exception that
        leaves ``handle`` fails every request in flight, not just this one."""
        loop = asyncio.get_running_loop()
        serve = self.service.serve
        replies = []
        for idx, row in enumerate(data or ()):
            if self.in_flight >= self.limit:
                replies.append(_error_reply(self._overloaded(), idx, context))
                continue
            body = row.get("body", row.get("data"))
            self.in_flight += 1
            try:
                reply = await loop.run_in_executor(self.pool, serve, idx, body, context)
            except BaseException as exc:  # see the docstring
                reply = _error_reply(exc, idx, context)
            finally:
                self.in_flight -= 1
            replies.append(reply)
        return replies

    def _overloaded(self) -> Overloaded:
        return Overloaded(
            f"this worker is serving {self.limit} requests already (max_requests_in_flight); "
            "send it again after Retry-After"
        )


def end_worker(error: BaseException) -> None:
    """The engine's ``on_fatal``: its device is lost or no shard is ready, so every request
    would get a 500 while /ping said 200. Ending the process makes the supervisor restart the
    instance, and the persistent tier keeps the sessions
    (docs/serving.md §Supervisor: restart the whole instance)."""
    logger.critical("ending the worker, its engine can serve nothing more: %r", error)
    os._exit(ENGINE_LOST_EXIT_CODE)


def flush_on_sigterm(service: LlavaService) -> None:
    """On SIGTERM (SageMaker's scale-in or update: SIGKILL follows 30 s later; a supervisor
    stopping the instance) the worker writes every session the durable store does not hold in
    its latest state yet, for at most ``durable_flush_s``, logs the ids it could not, and
    exits 0 (docs/engine/sessions.md §Durable store). ``initialize`` runs in the worker's main
    thread, the only one that may set a signal's handler."""
    timeout_s = service.config.durable_flush_s

    def on_sigterm(signum, frame) -> None:
        left = service.engine.flush_durable(timeout_s)
        for session_id in left:
            logger.error("durable store: session %s not written before exit", log_id(session_id))
        logger.info("SIGTERM: durable store flushed, %d sessions left unwritten", len(left))
        logging.shutdown()
        os._exit(0)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: a stop then loses what is not written yet
        logger.warning("SIGTERM handler not set: not in the worker's main thread")


def _error_reply(exc: BaseException, idx: int, context) -> str:
    """The JSON error for a request refused before ``serve`` or failed outside it (``serve``
    answers every error of its own): its status, and Retry-After when it has one."""
    error = error_response(exc)
    try:
        context.set_response_status(error.status, "", idx)
        context.set_response_content_type(idx, "application/json")
        for name, value in error.headers.items():
            context.set_response_header(idx, name, value)
    except Exception:
        logger.exception("could not set the status of a failed request")
    return json.dumps(error.payload)
