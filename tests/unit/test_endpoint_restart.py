"""`make stop` then `make endpoint` at once: the endpoint's port is free for it again although
the stopped server's connections sit in TIME_WAIT, and still refused while one listens.

The real endpoint process (``python -m local_endpoint``) on a free loopback port, forwarding to
a backend that is never called (only ``/ping`` is asked): no TorchServe is needed to hold the
port as the endpoint holds it."""

from __future__ import annotations

import http.client
import subprocess
import sys
import time

import pytest

from local_endpoint.launcher import check_port_free
from local_endpoint.router import answers_ping
from serving.torchserve import TorchServeError, free_ports
from tests.conftest import REPO


def start_endpoint(port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "local_endpoint", "--port", str(port)]
        + ["--backend", "instance-0=http://127.0.0.1:9"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not answers_ping(f"http://127.0.0.1:{port}"):
        assert server.poll() is None and time.monotonic() < deadline, "the endpoint did not start"
        time.sleep(0.05)
    return server


def test_a_stopped_endpoint_can_start_again_at_once_on_its_port():
    [port] = free_ports(1)
    first = start_endpoint(port)
    try:
        with pytest.raises(TorchServeError, match=f"port {port} is in use"):
            check_port_free(port)
        # A kept-alive connection the server side closes first: its end stays in TIME_WAIT.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/ping")
        assert conn.getresponse().read() == b"{}"
    finally:
        first.terminate()
        first.wait(10)
    conn.close()
    timewait = subprocess.run(
        ["ss", "-tan", "state", "time-wait", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert f":{port}" in timewait.stdout, "no TIME_WAIT socket: this test would prove nothing"
    check_port_free(port)  # what `make endpoint` asks first
    second = start_endpoint(port)
    second.terminate()
    second.wait(10)
