"""Device ↔ host copies of a session's KV blocks for the host tier (llava.kv.memory), in
bounded pieces (docs/engine/memory.md §Host copies).

A host copy holds the blocks layer by layer, block by block: [layers, blocks, 2 (K, V),
kv_heads, block_tokens, head_dim]. Any run of one layer's blocks is then one contiguous piece
of host memory, so a restore that skips the shared prefix blocks still copies contiguous
pieces and never materialises a strided slice of the host copy.

A copy moves one piece at a time: up to ``chunk_blocks`` blocks of one layer, gathered into
(or scattered from) one of two staging chunks on the pool's device. Those two chunks,
allocated once, are a copy's only device temporary, never the session's whole KV. (A run of
blocks that lies together in the pool is still 2 × kv_heads strided pieces there, so every
piece goes through a staging chunk.) On CUDA the chunks are double-buffered: gathers and
scatters run on one side stream, the copies across the bus on another, and an event per
chunk hands it from the stream that fills it to the one that empties it and back, so one
chunk crosses the bus while the other is gathered. On CPU the same pieces run in order, each
gathered straight into (scattered straight from) its part of the host copy, which is already
where the pool is: no staging, no extra copy, and the CPU tests cover the piece bookkeeping.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from llava.kv.pool import KVPool

STAGING_BYTES = 32 << 20  # each of the two staging chunks: large enough to copy at bus speed
PAGE = mmap.PAGESIZE
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context


@dataclass(frozen=True)
class Piece:
    """Blocks ``start..stop-1`` (positions in the list of blocks copied) of one layer."""

    layer: int
    start: int
    stop: int


def pieces(layers: int, count: int, chunk_blocks: int) -> Iterator[Piece]:
    """Each of ``count`` blocks of every layer once, layer by layer, ``chunk_blocks`` at most
    at a time."""
    for layer in range(layers):
        for start in range(0, count, chunk_blocks):
            yield Piece(layer, start, min(start + chunk_blocks, count))


class PinnedHost:
    """Host memory page-locked at its own size, so that copies to and from it are asynchronous.

    Not ``torch.empty(pin_memory=True)``: torch's caching host allocator rounds every block up
    to a power of two (a 1.05 GB host copy pinned 2 GiB) and keeps freed blocks pinned for
    reuse. Here pageable memory is registered with the driver (``cudaHostRegister``) in whole
    pages no other registration shares, and unregistered by ``unpin`` (or when collected)."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype):
        nbytes = shape.numel() * dtype.itemsize
        size = -(-nbytes // PAGE) * PAGE
        raw = torch.empty(size + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        pages = raw[start : start + size]
        cudart = torch.cuda.cudart()
        _check(cudart.cudaHostRegister(pages.data_ptr(), size, _REGISTER_PORTABLE), "register")
        self.tensor = pages[:nbytes].view(dtype).view(shape)
        self.last_copy = torch.cuda.Event()  # recorded after every copy to or from it
        self.unpin = weakref.finalize(self, _unregister, pages)  # idempotent
        self.unpin.atexit = False  # at exit the driver lets go of everything anyway


def _unregister(pages: torch.Tensor) -> None:
    _check(torch.cuda.cudart().cudaHostUnregister(pages.data_ptr()), "unregister")


def _check(error, action: str) -> None:
    if int(error) != 0:
        raise RuntimeError(f"cannot {action} pinned host memory: cudaError {int(error)}")


class HostCopies:
    """Copies whole blocks between the pool and host copies (pinned on CUDA), a piece at a
    time through two staging chunks of ``staging_bytes`` each. The caller serialises calls
    (the memory manager's lock)."""

    def __init__(self, pool: KVPool, staging_bytes: int = STAGING_BYTES):
        self.pool = pool
        self.device = pool.kv.device
        self.cuda = self.device.type == "cuda"
        self.layers = pool.kv.shape[0]
        layer_block_bytes = pool.bytes_per_block // self.layers
        self.chunk_blocks = max(1, min(pool.total_blocks, staging_bytes // layer_block_bytes))
        self._staging: torch.Tensor | None = None  # CUDA: [2, chunk], allocated on first use
        self._pinned: dict[int, PinnedHost] = {}  # host copies handed out, by data pointer
        self._unpinning: list[PinnedHost] = []  # released; their last copy may be in flight
        if self.cuda:  # gathers and scatters; copies across the bus
            self._device_lane = torch.cuda.Stream(self.device)
            self._bus_lane = torch.cuda.Stream(self.device)
            self._filled = [torch.cuda.Event(), torch.cuda.Event()]  # per staging chunk
            self._emptied = [torch.cuda.Event(), torch.cuda.Event()]
        else:
            self._device_lane = self._bus_lane = self._filled = self._emptied = None

    @property
    def staging_bytes(self) -> int:
        """Device bytes the two staging chunks take once allocated (none on CPU)."""
        return 2 * self.chunk_blocks * self.pool.bytes_per_block // self.layers if self.cuda else 0

    @torch.inference_mode()  # a copy of data: the same mode whichever thread asks
    def to_host(self, blocks: list[int]) -> torch.Tensor:
        """A host copy of ``blocks``, every layer: [layers, len(blocks), *layer_blocks_shape].
        On CUDA it may still be arriving when this returns; the compute stream waits only
        until the blocks are read, and every later copy to or from it comes after."""
        pool = self.pool
        host = self._host_memory(torch.Size((self.layers, *pool.layer_blocks_shape(len(blocks)))))
        with self._copying(blocks, host) as index:
            for i, piece in enumerate(pieces(self.layers, len(blocks), self.chunk_blocks)):
                part = host[piece.layer, piece.start : piece.stop]
                stage = self._stage(i, part)
                with self._filling(i, self._device_lane):
                    pool.read_layer_blocks(piece.layer, index[piece.start : piece.stop], stage)
                with self._emptying(i, self._bus_lane):
                    part.copy_(stage, non_blocking=True)
        return host

    @torch.inference_mode()
    def to_device(self, host: torch.Tensor, blocks: list[int], skip: int = 0) -> None:
        """Copy the blocks of ``host`` (from ``to_host``) past its first ``skip`` (those still
        on the device: a shared prefix) into ``blocks``, every layer; the compute stream's
        later work sees them."""
        if skip + len(blocks) != host.shape[1]:
            raise ValueError(f"{host.shape[1]} blocks held, {skip} skipped, {len(blocks)} given")
        if not blocks:  # every block is still on the device
            return
        pool = self.pool
        with self._copying(blocks, host) as index:
            for i, piece in enumerate(pieces(self.layers, len(blocks), self.chunk_blocks)):
                part = host[piece.layer, skip + piece.start : skip + piece.stop]
                stage = self._stage(i, part)
                with self._filling(i, self._bus_lane):
                    stage.copy_(part, non_blocking=True)
                with self._emptying(i, self._device_lane):
                    pool.write_layer_blocks(piece.layer, index[piece.start : piece.stop], stage)

    def release(self, host: torch.Tensor) -> None:
        """A host copy is no longer needed: its memory is unpinned once its last copy ends
        (checked now and at every later call, never waited for)."""
        pinned = self._pinned.pop(host.data_ptr(), None)
        if pinned is not None:
            self._unpinning.append(pinned)
        self._unpin_finished()

    def _host_memory(self, shape: torch.Size) -> torch.Tensor:
        self._unpin_finished()
        if not self.cuda:
            return torch.empty(shape, dtype=self.pool.kv.dtype)
        pinned = PinnedHost(shape, self.pool.kv.dtype)
        self._pinned[pinned.tensor.data_ptr()] = pinned
        return pinned.tensor

    def _unpin_finished(self) -> None:
        still = []
        for pinned in self._unpinning:
            if pinned.last_copy.query():
                pinned.unpin()
            else:
                still.append(pinned)
        self._unpinning = still

    @contextmanager
    def _copying(self, blocks: list[int], host: torch.Tensor) -> Iterator[torch.Tensor]:
        """Yields ``blocks`` as an index on the pool's device. On CUDA the device lane starts
        after the compute stream's queued work (the blocks hold what earlier steps wrote, or
        were just zeroed for a restore), and the compute stream's later work waits for the
        device lane (a moved block may be reused, a restored one read)."""
        index = torch.tensor(blocks, dtype=torch.long)
        if not self.cuda:
            yield index
            return
        compute = torch.cuda.current_stream(self.device)
        self._device_lane.wait_stream(compute)
        with torch.cuda.stream(self._device_lane):  # allocated where used: no reuse under it
            if self._staging is None:
                numel = self.chunk_blocks * self.pool.block_numel // self.layers
                self._staging = self.pool.kv.new_empty((2, numel))
            index = index.pin_memory().to(self.device, non_blocking=True)
        try:
            yield index
        finally:
            compute.wait_stream(self._device_lane)
            self._pinned[host.data_ptr()].last_copy.record(self._bus_lane)

    def _stage(self, i: int, part: torch.Tensor) -> torch.Tensor:
        """Where piece ``i`` (``part`` of a host copy) is gathered or scattered: on CUDA its
        view of its staging chunk (the two alternate); on CPU ``part`` itself, so the copy
        between them is a copy onto itself, which torch skips."""
        if not self.cuda:
            return part
        return self._staging[i % 2][: part.numel()].view(part.shape)

    def _filling(self, i: int, lane):
        """Piece ``i`` fills its staging chunk on ``lane`` once the chunk's last piece left."""
        return self._handing(i, lane, self._emptied, self._filled)

    def _emptying(self, i: int, lane):
        """Piece ``i`` empties its staging chunk on ``lane`` once it has been filled."""
        return self._handing(i, lane, self._filled, self._emptied)

    @contextmanager
    def _handing(self, i: int, lane, wait: list, record: list) -> Iterator[None]:
        """Run a step of piece ``i`` on ``lane`` after its staging chunk's ``wait`` event, then
        record its ``record`` event. On CPU: just run it."""
        if lane is None:
            yield
            return
        lane.wait_event(wait[i % 2])  # never recorded yet: no wait
        with torch.cuda.stream(lane):
            yield
        record[i % 2].record(lane)
