"""TorchServe entry point, in async mode (model-config.yaml: ``asyncCommunication: true``).

TorchServe 0.12 runs ``await handler.handle(data, context)`` as its own asyncio task for every
request, on one event loop in the worker's main thread; ``initialize`` runs earlier, before
that loop exists. Each request's work (image fetch, the engine's blocking calls, sending chunks)
runs in a thread of ``pool``, so a slow image or a long turn holds up only its own request
while the engine batches the turns of all sessions (docs/architecture.md §Architecture).

The module defines exactly one class: TorchServe takes it as the entry point (a module-level
``handle`` function would be called at load time without being awaited).
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor

from handlers.errors import error_response
from handlers.service import LlavaService
from handlers.worker_socket import lock_worker_socket

logger = logging.getLogger(__name__)
# Requests served at once (each holds a thread while its turn runs); more wait for a thread.
MAX_REQUESTS_IN_FLIGHT = 64


class LlavaHandler:
    def __init__(self):
        self.service: LlavaService | None = None
        self.pool: ThreadPoolExecutor | None = None

    def initialize(self, context) -> None:
        lock_worker_socket()
        self.service = LlavaService.from_context(context)
        self.pool = ThreadPoolExecutor(MAX_REQUESTS_IN_FLIGHT, thread_name_prefix="request")

    async def handle(self, data, context) -> list[str]:
        """One reply per row, and never an exception: in 0.12's async mode an exception that
        leaves ``handle`` fails every request in flight, not just this one."""
        loop = asyncio.get_running_loop()
        serve = self.service.serve
        replies = []
        for idx, row in enumerate(data or ()):
            body = row.get("body", row.get("data"))
            try:
                reply = await loop.run_in_executor(self.pool, serve, idx, body, context)
            except BaseException as exc:  # see the docstring
                reply = _last_resort(exc, idx, context)
            replies.append(reply)
        return replies


def _last_resort(exc: BaseException, idx: int, context) -> str:
    """A JSON 500 for a failure outside ``serve`` (which answers every error of its own)."""
    error = error_response(exc)
    try:
        context.set_response_status(error.status, "", idx)
        context.set_response_content_type(idx, "application/json")
    except Exception:
        logger.exception("could not set the status of a failed request")
    return json.dumps(error.payload)
