"""A ``requests.Session`` whose every connection goes through ``AddressGuard``.

The guard lives in urllib3's connection (``_new_conn``), the one place that turns a host name
into a socket, so a redirect, a retry or a pooled reconnect cannot bypass it. Environment
proxies are ignored (``trust_env=False``): a proxy would make the connected address the
proxy's, not the image host's.
"""

from __future__ import annotations

import socket
from functools import partial

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError
from urllib3.util import connection

from .netpolicy import AddressGuard


class _GuardedConnectionMixin:
    def __init__(self, *args, guard: AddressGuard, **kwargs):
        super().__init__(*args, **kwargs)
        self._guard = guard

    def _new_conn(self) -> socket.socket:
        # Connect to exactly the address the guard approved (an IP literal: no second lookup).
        address = self._guard.resolve(self.host, self.port)
        try:
            return connection.create_connection(
                (address, self.port),
                self.timeout,
                source_address=self.source_address,
                socket_options=self.socket_options,
            )
        except TimeoutError as e:
            raise ConnectTimeoutError(self, f"connection to {self.host} timed out") from e
        except OSError as e:
            raise NewConnectionError(self, f"cannot connect to {self.host}: {e}") from e


class _GuardedHTTPConnection(_GuardedConnectionMixin, HTTPConnection):
    pass


class _GuardedHTTPSConnection(_GuardedConnectionMixin, HTTPSConnection):
    pass


class _GuardedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _GuardedHTTPConnection


class _GuardedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _GuardedHTTPSConnection


class _GuardedAdapter(HTTPAdapter):
    def __init__(self, guard: AddressGuard):
        self._guard = guard  # before super().__init__, which builds the pool manager
        super().__init__(max_retries=0)

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        # Pools pass unknown keyword arguments on to their connections: that carries the guard.
        self.poolmanager.pool_classes_by_scheme = {
            "http": partial(_GuardedHTTPPool, guard=self._guard),
            "https": partial(_GuardedHTTPSPool, guard=self._guard),
        }


def guarded_session(guard: AddressGuard) -> requests.Session:
    """A session that connects only where ``guard`` permits, directly (no proxies)."""
    session = requests.Session()
    session.trust_env = False
    adapter = _GuardedAdapter(guard)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session
