"""The host tier's books: which bytes of host memory hold copies of device KV, within the
host budget (docs/engine/memory.md §Memory policy). The copies themselves move in bounded
pieces (llava.kv.host_copies). The memory manager (llava.kv.memory) calls this under its lock
and decides whose KV moves; this module copies and counts."""

from __future__ import annotations

from llava.kv.budget import blocks_for
from llava.kv.holding import HostKV
from llava.kv.host_copies import HostCopies
from llava.kv.pool import KVPool, SessionKV


class HostTier:
    def __init__(self, pool: KVPool, budget_bytes: int):
        self.pool = pool
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.copies = HostCopies(pool)

    def written_blocks(self, kv: SessionKV) -> list[int]:
        """The blocks holding its written tokens: what a host copy takes."""
        return kv.blocks[: blocks_for(kv.length, self.pool.block_tokens)]

    def copy_bytes(self, kv: SessionKV) -> int:
        return len(self.written_blocks(kv)) * self.pool.bytes_per_block

    def fits(self, nbytes: int) -> bool:
        return self.bytes + nbytes <= self.budget_bytes

    def copy_out(self, kv: SessionKV) -> HostKV:
        """A host copy of the KV's written blocks (the caller checked it ``fits``)."""
        written = self.written_blocks(kv)
        nbytes = len(written) * self.pool.bytes_per_block
        self.bytes += nbytes
        return HostKV(self.copies.to_host(written), kv.length, nbytes)

    def copy_back(self, host: HostKV, kv: SessionKV, shared: int) -> None:
        """The copy into ``kv``'s blocks past its first ``shared`` (already on the device,
        shared with other sessions); then the copy goes."""
        written = host.data.shape[1]
        self.copies.to_device(host.data, kv.blocks[shared:written], skip=shared)
        kv.length = host.length
        self.drop(host)

    def drop(self, host: HostKV) -> None:
        self.bytes -= host.nbytes
        self.copies.release(host.data)
