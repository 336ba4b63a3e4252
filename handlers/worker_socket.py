"""One lock around every write to the worker's socket (a TorchServe 0.12 async-mode bug).

In async mode two threads write frames to the socket the frontend reads: our threads send
streamed chunks (``send_intermediate_predict_response``) while TorchServe's ``send_responses``
thread sends final replies, each with a bare ``sendall``. A big frame can be interleaved with
another one and the frontend then reads garbage (docs/serving.md §TorchServe 0.12 facts). The
worker hands ``ts.service.Service`` its socket after the model loaded (``set_cl_socket``);
wrapping it there puts both writers behind one lock.
"""

from __future__ import annotations

import threading

from ts.service import Service


class LockedSocket:
    """The worker's socket, with ``sendall`` serialized; everything else passes through."""

    def __init__(self, sock):
        self._sock = sock
        self._sending = threading.Lock()

    def sendall(self, data) -> None:
        with self._sending:
            self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def lock_worker_socket() -> None:
    """Make every Service wrap the socket it is given (idempotent). Called from the handler's
    ``initialize``, which runs before TorchServe hands the Service its socket."""
    if getattr(Service.set_cl_socket, "locks_sends", False):
        return
    plain = Service.set_cl_socket

    def set_cl_socket(self, cl_socket) -> None:
        plain(self, LockedSocket(cl_socket))

    set_cl_socket.locks_sends = True
    Service.set_cl_socket = set_cl_socket
