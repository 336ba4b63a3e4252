"""What one step needs besides the weights: every index tensor, built once per step.

The host knows each sequence's block table, length and new ids; it writes them into one int64
staging tensor and copies that to a preallocated device buffer in one transfer (asynchronous
from pinned memory on CUDA). Everything else (positions, write slots, the padded query layout,
the attention block mask) is derived on the device from those views, so a step has no
per-sequence host work past the table copy and no host sync
(docs/engine/execution.md §Step metadata).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

from llava.exec.attention import PagedRows

# Prepares the paged rows of a step from their tables (int32 [rows, pool blocks]) and positions
# (the runner's choice of path and splits).
PreparePaged = Callable[[torch.Tensor, torch.Tensor], PagedRows]


@dataclass(frozen=True)
class Prefill:
    """A sequence attended on its own (SDPA over its slots): a prefill chunk, or any sequence
    with no paged path (sdpa attention)."""

    span: tuple[int, int]  # its [start, stop) in the packed tokens
    # pool slots of its positions 0..length+new: a slice (read in place), a few slices (runs
    # of adjacent blocks, joined by one copy each), or their indices (gathered)
    slots: slice | tuple[slice, ...] | torch.Tensor
    # new token i sees the past and new tokens 0..i: SDPA's fused kernels take this bias, where
    # a boolean mask sends them to the math path (None: one new token, it sees everything)
    causal: CausalBias | None


@dataclass(frozen=True)
class StepMeta:
    ids: torch.Tensor  # [T] the packed new ids
    positions: torch.Tensor  # [T] each token's position in its sequence
    write_slots: torch.Tensor  # [T] the pool slot its K/V goes to
    last: torch.Tensor  # [sequences] packed index of each sequence's last new token
    decode_rows: torch.Tensor | None  # packed index of each one-token sequence; None: all
    paged: PagedRows | None  # the decode rows, read through the paged path (None: no such row)
    prefills: list[Prefill]


class StepBuffers:
    """A device buffer for the step's host-made integers, allocated once and grown only when
    a step needs more. On CUDA the host side is a pinned staging buffer, so the copy does not
    block; the next upload waits for that copy to finish before it writes the staging buffer
    again (steps that read their ids back have synced already; ``Runner.step`` alone has not)."""

    def __init__(self, device: torch.device, capacity: int = 4096):
        self.device = torch.device(device)
        self._copied: torch.cuda.Event | None = None  # the last staging copy, on CUDA
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._device_buffer = torch.empty(capacity, dtype=torch.long, device=self.device)
        self._host = torch.empty(capacity, dtype=torch.long, pin_memory=self.device.type == "cuda")

    def upload(self, values: list[int]) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        if len(values) > self._device_buffer.numel():
            self._allocate(2 * len(values))
        staging = self._host[: len(values)]
        staging.copy_(torch.tensor(values, dtype=torch.long))
        out = self._device_buffer[: len(values)]
        out.copy_(staging, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return out


def build_step_meta(
    buffers: StepBuffers,
    ids: list[int],
    lengths: list[int],
    counts: list[int],
    tables: list[list[int]],
    block_tokens: int,
    pool_blocks: int,
    paged: PreparePaged | None,
) -> StepMeta:
    """``lengths``: tokens each sequence already holds; ``counts``: its new ids (in ``ids``,
    packed in order); ``tables``: its pool blocks. One-token sequences share one paged
    attention call (``paged`` prepares it), others are attended one by one; with no ``paged``
    every sequence is (the CPU's faster path, docs/performance.md §Attention candidates (CPU))."""
    sequences, total = len(counts), len(ids)
    width = max(len(t) for t in tables)
    flat_tables = [b for t in tables for b in t + [0] * (width - len(t))]
    row_sequence = [s for s, n in enumerate(counts) for _ in range(n)]
    offsets = [i for n in counts for i in range(n)]
    decoding = [] if paged is None else [s for s, n in enumerate(counts) if n == 1]
    ends = list(itertools.accumulate(counts))
    lasts = [end - 1 for end in ends]
    uploaded = buffers.upload(ids + row_sequence + offsets + lengths + lasts + flat_tables)
    packed_ids = uploaded[:total]
    row_of = uploaded[total : 2 * total]
    starts = uploaded[3 * total : 3 * total + sequences]
    positions = starts[row_of] + uploaded[2 * total : 3 * total]
    last = uploaded[3 * total + sequences : 3 * total + 2 * sequences]
    table = uploaded[3 * total + 2 * sequences :].view(sequences, width)
    blocks = table.view(-1)[row_of * width + positions // block_tokens]
    write_slots = blocks * block_tokens + positions % block_tokens
    decode_rows, decode = None, None
    if decoding:  # the paged call reads tables as wide as the pool
        pool_table = torch.zeros(sequences, pool_blocks, dtype=torch.int32, device=buffers.device)
        pool_table[:, :width] = table
        picked = None if len(decoding) == sequences else torch.tensor(decoding)
        decode_tables = pool_table if picked is None else pool_table[picked.to(buffers.device)]
        decode_rows = None if picked is None else last[picked.to(buffers.device)]
        decode_positions = positions if picked is None else positions[decode_rows]
        decode = paged(decode_tables, decode_positions)
    prefills = []
    for s, n in enumerate(counts):
        if n > 1 or paged is None:
            span = (ends[s] - n, ends[s])
            slots = _slots(tables[s], table[s], lengths[s] + n, block_tokens)
            causal = causal_lower_right(n, lengths[s] + n) if n > 1 else None
            prefills.append(Prefill(span, slots, causal))
    return StepMeta(packed_ids, positions, write_slots, last, decode_rows, decode, prefills)


MAX_RUNS = 4  # more runs of adjacent blocks than this are gathered by index instead


def _slots(table: list[int], row: torch.Tensor, stop: int, block_tokens: int):
    """Pool slots of positions 0..stop-1: one slice when their blocks are adjacent (read in
    place); a few slices when they form a few runs (a shared prefix, then the session's own
    blocks: joining runs copies at memory speed, about half a gather's time); else their
    indices (gathered)."""
    used = -(-stop // block_tokens)
    runs: list[slice] = []
    start = 0
    for i in range(1, used + 1):
        if i == used or table[i] != table[i - 1] + 1:
            first = table[start] * block_tokens
            runs.append(slice(first, first + min(stop, i * block_tokens) - start * block_tokens))
            start = i
            if len(runs) > MAX_RUNS:
                break
    if len(runs) == 1:
        return runs[0]
    if len(runs) <= MAX_RUNS:
        return tuple(runs)
    seen = torch.arange(stop, device=row.device)
    return row[seen // block_tokens] * block_tokens + seen % block_tokens


def row_slots(tables: torch.Tensor, positions: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """Each row's pool slot for its new K/V, from its sequence's pool blocks (``tables``, int32
    ``[rows, pool blocks]``) and its position."""
    blocks = tables.gather(1, (positions // block_tokens)[:, None])[:, 0]
    return blocks.long() * block_tokens + positions % block_tokens
