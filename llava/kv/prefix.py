"""Content keys of KV blocks, and the index of blocks that hold a known prefix.

A full block's key is a SHA-256 chained over everything its KV depends on: the key of the
block before it, its token ids and, when it holds image tokens, the content key of each image
they belong to (a hash of the decoded pixels and of everything that changes its features:
never a URL). Two blocks with one key hold the same KV, so a session whose prompt starts with
another's full blocks reuses them read-only instead of computing them (docs/engine/memory.md
§Shared prefixes).

Who may find a block is in its key too: every key of a tenant's session is salted with the
tenant (``scoped``), so tenants share nothing, and the keys of blocks that hold a caller's
text are salted with the session's own secret, so no other session can find them and its
``cachedTokens`` cannot tell a right guess of another's text from a wrong one.

``PrefixIndex`` maps keys to the pool blocks that hold them. A published block is never
written again; when no session references it any more it stays indexed, in least-recently
-used order, until its room is needed.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import struct
from collections import OrderedDict
from collections.abc import Sequence

_ROOT = hashlib.sha256(b"stateful-llava kv prefix 1").digest()


def scoped(key: bytes, tenant: str | None) -> bytes:
    """``key`` salted with ``tenant``: no key of one tenant equals another's; without a
    tenant, unchanged (tenant-less sessions share with each other only)."""
    if tenant is None:
        return key
    return hashlib.sha256(b"tenant " + key + tenant.encode()).digest()  # key: fixed length


def block_keys(
    ids: Sequence[int],
    block_tokens: int,
    images: Sequence[tuple[bytes | None, int]],
    image_token_id: int,
    known: Sequence[bytes] = (),
    *,
    tenant: str | None = None,
    own_from: int | None = None,
    own_salt: bytes = b"",
) -> list[bytes]:
    """The keys of every full block of ``ids``; ``images``: the content key and image-token
    count of each image ``ids`` holds, in order; ``known``: the keys of its first blocks,
    already computed (a session's keys grow with its history). Every key is salted with
    ``tenant``; blocks from index ``own_from`` on (None: none) with ``own_salt`` too, the
    session's own secret, so that no other session finds them."""
    if own_from is not None and not own_salt:
        raise ValueError("a session's own blocks need its own salt, or anyone finds them")
    keys = list(known)
    packed = struct.Struct(f"<{block_tokens}q")
    root = scoped(_ROOT, tenant)
    first = len(keys) * block_tokens
    image_ends = list(itertools.accumulate(tokens for _, tokens in images))
    seen = ids[:first].count(image_token_id)  # image tokens before the first new block
    for start in range(first, len(ids) - block_tokens + 1, block_tokens):
        chunk = ids[start : start + block_tokens]
        digest = hashlib.sha256(keys[-1] if keys else root)
        digest.update(packed.pack(*chunk))
        count = chunk.count(image_token_id)
        if count:  # every image token's KV depends on which image it was
            first_image = bisect.bisect_right(image_ends, seen)
            last_image = bisect.bisect_right(image_ends, seen + count - 1)
            if last_image >= len(images):
                raise ValueError("more image tokens in a prefix than its images hold")
            for key, _ in images[first_image : last_image + 1]:
                if key is None:
                    raise ValueError("image tokens in a prefix without the image's content key")
                digest.update(key)
            seen += count
        if own_from is not None and len(keys) >= own_from:
            digest.update(own_salt)
        keys.append(digest.digest())
    return keys


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first ids ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def feature_keys(image_key: bytes, blocks: int) -> list[bytes]:
    """The keys of the pool blocks holding an image's features."""
    return [hashlib.sha256(b"features %d " % i + image_key).digest() for i in range(blocks)]


class PrefixIndex:
    """Key ↔ block for published blocks, and which of them no one references (reclaimable,
    least recently used first). Bookkeeping only: the pool counts references."""

    def __init__(self):
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._unused: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._key_of)

    @property
    def unused(self) -> int:
        """Published blocks no one references: free room that still answers lookups."""
        return len(self._unused)

    def find(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of ``keys``, from the first, that are published."""
        found = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def key_of(self, block: int) -> bytes | None:
        return self._key_of.get(block)

    def is_unused(self, block: int) -> bool:
        return block in self._unused

    def publish(self, block: int, key: bytes) -> None:
        """Index ``block`` (referenced, fully written) under ``key``, unless the key already
        has a block (this one then stays private) or the block has a key."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def used(self, block: int) -> None:
        """A published block is referenced again."""
        self._unused.pop(block, None)

    def release(self, block: int) -> None:
        """A published block is referenced no more: the most recently used reclaimable one."""
        self._unused[block] = None

    def reclaim(self) -> int:
        """Forget the least recently used unreferenced block and return it (now empty room)."""
        block, _ = self._unused.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block
