"""What image intake may fetch and accept: one frozen dataclass with safe defaults.

Configured under the engine config key ``intake`` (``EngineConfig.intake``); refusal messages
name the key to change as ``intake.<field>``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MiB = 1024 * 1024
# Formats are detected from content by PIL, never from a name or a Content-Type.
KNOWN_FORMATS = frozenset({"PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF", "ICO", "PPM"})
KNOWN_SCHEMES = frozenset({"http", "https"})
S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.?)+$", re.IGNORECASE)


@dataclass(frozen=True)
class IntakePolicy:
    """Limits and network policy for loading one image.

    ``allow`` opens what the default address policy refuses (loopback, private, link-local,
    metadata service...): entries are IP addresses, CIDR networks, or host names (a host name
    entry trusts whatever that name resolves to). Public addresses need no entry.
    ``deadline_s`` bounds the whole fetch, redirects and slow bodies included; the per-socket
    timeouts alone cannot stop a server that drips one byte at a time.
    ``s3_buckets`` lists what an ``s3://`` source may name: ``bucket`` (any key in it) or
    ``bucket/prefix`` (keys under that prefix, matched by whole path segments: ``b/cats``
    permits ``b/cats/x.png``, not ``b/catsup.png``). Empty (the default) refuses every
    ``s3://`` source: the server's role may read more than callers should.
    ``max_pixels`` is checked first, from the header; PIL itself refuses images over
    2 x ``Image.MAX_IMAGE_PIXELS`` (~179 MP) whatever ``max_pixels`` says. 16 MP holds a phone
    camera's photo; the model sees under a megapixel of it, so more only costs decode time.
    ``decode_budget_bytes`` bounds the memory of the decodes a worker runs at once (each
    counted as 8 bytes a pixel, from the header); one larger than it runs alone.
    """

    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0
    deadline_s: float = 20.0
    max_bytes: int = 20 * MiB
    max_pixels: int = 16_000_000
    decode_budget_bytes: int = 512 * MiB
    formats: frozenset[str] = frozenset({"PNG", "JPEG", "GIF", "WEBP", "BMP"})
    max_redirects: int = 3
    schemes: frozenset[str] = KNOWN_SCHEMES
    allow: tuple[str, ...] = ()
    s3_buckets: frozenset[str] = frozenset()
    s3_endpoint_url: str | None = None
    s3_region: str | None = None

    def __post_init__(self):
        for name in ("connect_timeout_s", "read_timeout_s", "deadline_s"):
            _require(getattr(self, name) > 0, f"intake.{name} must be > 0")
        for name in ("max_bytes", "max_pixels", "decode_budget_bytes"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"intake.{name} must be an int > 0")
        _require(self.max_redirects >= 0, "intake.max_redirects must be >= 0")
        _require(
            self.formats <= KNOWN_FORMATS and self.formats,
            f"intake.formats must be a non-empty subset of {sorted(KNOWN_FORMATS)}",
        )
        _require(
            self.schemes <= KNOWN_SCHEMES,
            f"intake.schemes must be a subset of {sorted(KNOWN_SCHEMES)}",
        )
        for entry in self.allow:
            _require(
                _is_network(entry) or _HOSTNAME.match(entry), f"intake.allow: bad entry {entry!r}"
            )
        for entry in self.s3_buckets:
            bucket, _, prefix = entry.partition("/")
            _require(
                S3_BUCKET.match(bucket) and "//" not in prefix and not prefix.startswith("/"),
                f"intake.s3_buckets: bad entry {entry!r}; want bucket or bucket/prefix",
            )

    def s3_permits(self, bucket: str, key: str) -> bool:
        """Whether ``s3_buckets`` lists the bucket, or a prefix of the key's path segments."""
        for entry in self.s3_buckets:
            listed, _, prefix = entry.partition("/")
            prefix = prefix.rstrip("/")
            if listed == bucket and (not prefix or key.startswith(prefix + "/")):
                return True
        return False

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> IntakePolicy:
        """Build from config: field names as keys, lists for the set-valued fields.

        Keys: connect_timeout_s, read_timeout_s, deadline_s, max_bytes, max_pixels,
        decode_budget_bytes, formats,
        max_redirects, schemes, allow, s3_buckets, s3_endpoint_url, s3_region. Unknown keys
        are an error, not silently ignored.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown intake config keys: {', '.join(unknown)}")
        kwargs = dict(values)
        for name, norm in (("formats", str.upper), ("schemes", str.lower), ("s3_buckets", str)):
            if name in kwargs:
                kwargs[name] = frozenset(norm(v) for v in _strings(name, kwargs[name]))
        if "allow" in kwargs:
            kwargs["allow"] = tuple(v.strip().lower() for v in _strings("allow", kwargs["allow"]))
        return cls(**kwargs)


def _is_network(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False
    return True


def _strings(name: str, values: Any) -> list[str]:
    if isinstance(values, str) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"intake.{name} must be a list of strings")
    return list(values)


def _require(condition: Any, message: str) -> None:
    if not condition:
        raise ValueError(message)
