"""Download an image over http(s): redirects re-checked hop by hop, bytes and time capped."""

from __future__ import annotations

from urllib.parse import urljoin, urlsplit

import requests
import urllib3

from llava.errors import ImageFetchFailed, ImageSourceNotAllowed, InvalidRequest

from .limits import Deadline, read_capped, too_large
from .netpolicy import AddressGuard
from .policy import IntakePolicy
from .transport import guarded_session

# Images are compressed already; asking for identity also rules out a gzip bomb.
_HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity"}


def _shown(url: str) -> str:
    """The URL for messages and logs: no query string (it may hold a signature), bounded."""
    parts = urlsplit(url)
    text = f"{parts.scheme}://{parts.netloc}{parts.path}"
    return text if len(text) <= 120 else text[:117] + "..."


def _check_url(url: str, policy: IntakePolicy) -> None:
    """Refuse a URL (the caller's or a redirect's) whose scheme the policy does not allow."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in policy.schemes:
        raise ImageSourceNotAllowed(
            f"URL scheme {parts.scheme!r} is not allowed; use one of {sorted(policy.schemes)} "
            f"(intake.schemes)"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as e:
        raise InvalidRequest(f"image URL {_shown(url)} has a bad port: {e}") from e
    if not parts.hostname:
        raise InvalidRequest(f"image URL {_shown(url)} has no host; use https://host/path")


def fetch_http(url: str, policy: IntakePolicy) -> bytes:
    """The body of ``url``, following at most ``policy.max_redirects`` redirects."""
    deadline = Deadline(policy.deadline_s)
    with guarded_session(AddressGuard(policy)) as session:
        for _ in range(policy.max_redirects + 1):
            _check_url(url, policy)
            with _get(session, url, policy, deadline) as response:
                if response.is_redirect:
                    url = urljoin(url, response.headers["Location"])
                    continue
                if not 200 <= response.status_code < 300:
                    raise ImageFetchFailed(
                        f"{_shown(url)} answered HTTP {response.status_code}; check the URL"
                    )
                return _read_body(response, url, policy, deadline)
    raise ImageFetchFailed(
        f"{_shown(url)}: more than {policy.max_redirects} redirects; link the image directly "
        f"or raise intake.max_redirects"
    )


def _get(session, url, policy, deadline) -> requests.Response:
    deadline.check(_shown(url))
    remaining = deadline.remaining()
    timeout = (min(policy.connect_timeout_s, remaining), min(policy.read_timeout_s, remaining))
    try:
        return session.get(
            url, headers=_HEADERS, timeout=timeout, stream=True, allow_redirects=False
        )
    except requests.exceptions.InvalidURL as e:
        raise InvalidRequest(f"image URL {_shown(url)} is malformed: {e}") from e
    except requests.RequestException as e:
        deadline.check(_shown(url))
        raise _unreachable(_shown(url), e) from e


def _read_body(response, url, policy, deadline) -> bytes:
    source = _shown(url)
    length = response.headers.get("Content-Length", "")
    if length.isdigit() and int(length) > policy.max_bytes:
        raise too_large(source, policy.max_bytes)
    raw = response.raw
    sock = getattr(raw.connection, "sock", None)

    def read(n: int) -> bytes:
        # read1 returns what one recv gives, and each recv waits at most until the deadline.
        if sock is not None:
            sock.settimeout(max(0.001, min(policy.read_timeout_s, deadline.remaining())))
        return raw.read1(n, decode_content=False)

    try:
        return read_capped(read, policy.max_bytes, deadline, source)
    except (urllib3.exceptions.HTTPError, OSError) as e:
        deadline.check(source)
        raise _unreachable(source, e) from e


def _unreachable(source: str, error: Exception) -> ImageFetchFailed:
    # The innermost cause says what happened: urllib3 nests it a few exceptions deep.
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    reason = str(error) or type(error).__name__
    return ImageFetchFailed(
        f"cannot fetch {source} ({reason}); check it is reachable from the server"
    )
