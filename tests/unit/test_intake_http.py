"""Image intake over HTTP against real servers on loopback: limits, redirects, address policy.

The servers listen on 127.0.0.x / ::1 only, and the default policy refuses loopback: tests
reach them by allowing 127.0.0.1 explicitly. A tripwire fails any test that tries to connect
to a non-loopback address (so refusals of 169.254.169.254 are proven to happen before any
packet is sent).
"""

from __future__ import annotations

import socket
import time

import pytest
from PIL import Image

from llava.errors import ImageFetchFailed, ImageSourceNotAllowed, ImageTooLarge, NotAnImage
from llava.intake import IntakePolicy, load_image
from tests.intake_servers import (
    LoopbackServer,
    drip,
    endless,
    forbid_non_loopback,
    image_bytes,
    redirect,
    respond,
    stall,
)

PNG = image_bytes(Image.new("RGB", (8, 6), (10, 200, 30)))
LOCAL = IntakePolicy(allow=("127.0.0.1",))
FAST = IntakePolicy(allow=("127.0.0.1",), deadline_s=0.3, read_timeout_s=5.0)


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch):
    forbid_non_loopback(monkeypatch)


@pytest.fixture
def server():
    server = LoopbackServer()
    server.routes["/img.png"] = respond(PNG)
    yield server
    server.close()


@pytest.fixture
def resolver(monkeypatch):
    """Resolve chosen names to chosen loopback addresses (one answer per lookup, in order)."""
    answers: dict[str, list[str]] = {}
    lookups: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in answers:
            return real(host, port, *args, **kwargs)
        lookups.append(host)
        queue = answers[host]
        ip = queue.pop(0) if len(queue) > 1 else queue[0]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answers, lookups


def fetch(url, policy=LOCAL):
    return load_image({"url": url}, policy)


def test_fetches_an_allowed_url(server):
    image = fetch(server.url("/img.png"))
    assert (image.mode, image.size) == ("RGB", (8, 6))
    assert image.getpixel((0, 0)) == (10, 200, 30)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.1", "2130706433"])
def test_default_policy_refuses_loopback_without_connecting(server, host):
    with pytest.raises(ImageSourceNotAllowed, match=r"is a loopback|, a loopback.*intake\.allow"):
        fetch(server.url("/img.png", host=host), IntakePolicy())
    assert server.paths == []


def test_default_policy_guards_https_too(server):
    with pytest.raises(ImageSourceNotAllowed, match=r"127\.0\.0\.1 is a loopback"):
        fetch(f"https://127.0.0.1:{server.port}/img.png", IntakePolicy())
    assert server.paths == []


def test_default_policy_refuses_ipv6_loopback():
    server = LoopbackServer("::1")
    try:
        with pytest.raises(ImageSourceNotAllowed, match=r"::1 is a loopback"):
            fetch(server.url("/x"), LOCAL)
        assert server.paths == []
    finally:
        server.close()


def test_a_public_name_resolving_to_loopback_is_refused(server, resolver):
    """The check is on the resolved address, not on how the URL spells the host."""
    answers, _ = resolver
    answers["images.example.com"] = ["127.0.0.1"]
    url = server.url("/img.png", host="images.example.com")
    with pytest.raises(ImageSourceNotAllowed, match="host images.example.com resolves to 127"):
        fetch(url, IntakePolicy())
    assert server.paths == []
    assert fetch(url).size == (8, 6)  # the same name, with 127.0.0.1 allowed


def test_dns_rebinding_cannot_switch_the_connected_address(server, resolver):
    """A name that answers an allowed address, then an internal one (DNS rebinding).

    Each connection resolves once and connects to exactly the address it checked, so the
    internal server is never reached: not by the first hop, nor by a redirect to the same name.
    """
    internal = LoopbackServer("127.0.0.2")
    internal.routes["/img.png"] = respond(b"secret")
    try:
        answers, lookups = resolver
        answers["rebind.example.com"] = ["127.0.0.1", "127.0.0.2"]
        url = server.url("/img.png", host="rebind.example.com")
        assert fetch(url).size == (8, 6)
        assert lookups == ["rebind.example.com"]

        server.routes["/hop"] = redirect(internal.url("/img.png", host="rebind.example.com"))
        with pytest.raises(ImageSourceNotAllowed, match=r"127\.0\.0\.2, a loopback"):
            fetch(server.url("/hop"))
        assert internal.paths == []
    finally:
        internal.close()


def test_environment_proxies_are_ignored(server, monkeypatch):
    proxy = LoopbackServer()
    try:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
            monkeypatch.setenv(name, proxy.url(""))
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        assert fetch(server.url("/img.png")).size == (8, 6)
        with pytest.raises(ImageSourceNotAllowed):
            fetch(server.url("/img.png"), IntakePolicy())
        assert proxy.paths == []
    finally:
        proxy.close()


def test_slow_drip_is_cut_at_the_deadline(server):
    server.routes["/drip"] = drip(interval_s=0.05)
    start = time.monotonic()
    with pytest.raises(ImageFetchFailed, match=r"longer than 0.3 s.*intake\.deadline_s"):
        fetch(server.url("/drip"), FAST)
    assert time.monotonic() - start < 1.5


def test_a_server_that_never_answers_is_cut_at_the_deadline(server):
    server.routes["/stall"] = stall()
    start = time.monotonic()
    with pytest.raises(ImageFetchFailed, match="longer than 0.3 s"):
        fetch(server.url("/stall"), FAST)
    assert time.monotonic() - start < 1.5


def test_endless_body_is_cut_at_max_bytes(server):
    server.routes["/endless"] = endless()
    policy = IntakePolicy(allow=("127.0.0.1",), max_bytes=1024 * 1024)
    with pytest.raises(ImageTooLarge, match=r"larger than 1048576 bytes.*intake\.max_bytes"):
        fetch(server.url("/endless"), policy)


def test_honest_too_big_content_length_is_refused_before_reading(server):
    server.routes["/big"] = respond(b"", headers={"Content-Length": str(10**12)})
    with pytest.raises(ImageTooLarge):
        fetch(server.url("/big"))


def test_small_content_length_caps_what_is_read(server):
    """A lying small Content-Length: the body is read only that far, then fails to decode."""
    server.routes["/liar"] = respond(PNG + b"\0" * 2_000_000, headers={"Content-Length": "40"})
    with pytest.raises(NotAnImage):
        fetch(server.url("/liar"), IntakePolicy(allow=("127.0.0.1",), max_bytes=1000))


def test_text_named_png_is_not_an_image(server):
    server.routes["/cat.png"] = respond(b"<html>not a picture</html>")
    with pytest.raises(NotAnImage, match=r"allowed format.*intake\.formats"):
        fetch(server.url("/cat.png"))


def test_redirects_are_followed_up_to_the_limit(server):
    server.routes["/r1"] = redirect("/r2")  # relative
    server.routes["/r2"] = redirect(server.url("/r3"), status=301)
    server.routes["/r3"] = redirect("/img.png", status=307)
    assert fetch(server.url("/r1")).size == (8, 6)


def test_redirect_loop_stops_after_max_redirects(server):
    server.routes["/loop"] = redirect("/loop")
    with pytest.raises(ImageFetchFailed, match=r"more than 3 redirects.*intake\.max_redirects"):
        fetch(server.url("/loop"))
    assert server.paths == ["/loop"] * 4


@pytest.mark.parametrize(
    ("location", "match"),
    [
        ("http://169.254.169.254/latest/meta-data/", r"169\.254\.169\.254 is a link-local"),
        ("http://127.0.0.2:{port}/img.png", r"127\.0\.0\.2 is a loopback"),
        ("http://[::1]:{port}/img.png", r"::1 is a loopback"),
        ("http://10.0.0.5/img.png", r"10\.0\.0\.5 is a private"),
        ("file:///etc/passwd", "scheme 'file' is not allowed"),
        ("gopher://127.0.0.1:6379/_INFO", "scheme 'gopher' is not allowed"),
    ],
)
def test_each_redirect_hop_is_rechecked(server, location, match):
    server.routes["/hop"] = redirect(location.format(port=server.port))
    with pytest.raises(ImageSourceNotAllowed, match=match):
        fetch(server.url("/hop"))
    assert server.paths == ["/hop"]


@pytest.mark.parametrize("status", [404, 403, 500])
def test_http_error_status_is_a_fetch_failure(server, status):
    server.routes["/err"] = respond(b"nope", status)
    with pytest.raises(ImageFetchFailed, match=f"answered HTTP {status}"):
        fetch(server.url("/err"))


def test_connection_refused_is_a_fetch_failure():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(ImageFetchFailed, match="refused"):
            fetch(f"http://127.0.0.1:{port}/img.png")
