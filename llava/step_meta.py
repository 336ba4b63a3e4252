"""What one step needs besides the weights: every index tensor, built once per step.

The host knows each sequence's block table, length and new ids; it writes them into one int64
staging tensor and copies that to a preallocated device buffer in one transfer (asynchronous
from pinned memory on CUDA). Everything else (positions, write slots, the padded query layout,
the attention block mask) is derived on the device from those views, so a step has no
per-sequence host work past the table copy and no host sync (docs/design.md §Step metadata).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from llava.attention import paged_block_mask


@dataclass(frozen=True)
class StepMeta:
    ids: torch.Tensor  # [T] the packed new ids
    positions: torch.Tensor  # [T] each token's position in its sequence
    write_slots: torch.Tensor  # [T] the pool slot its K/V goes to
    last: torch.Tensor  # [sequences] packed index of each sequence's last new token
    mask: BlockMask  # which pool blocks each token's query reads


class StepBuffers:
    """A device buffer for the step's host-made integers, allocated once and grown only when
    a step needs more (pinned host staging on CUDA, so the copy does not block)."""

    def __init__(self, device: torch.device, capacity: int = 4096):
        self.device = torch.device(device)
        self._device_buffer = torch.empty(capacity, dtype=torch.long, device=self.device)

    def upload(self, values: list[int]) -> torch.Tensor:
        if len(values) > self._device_buffer.numel():
            self._device_buffer = torch.empty(2 * len(values), dtype=torch.long, device=self.device)
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        out = self._device_buffer[: len(values)]
        out.copy_(host, non_blocking=True)
        return out


def build_step_meta(
    buffers: StepBuffers,
    ids: list[int],
    lengths: list[int],
    counts: list[int],
    tables: list[list[int]],
    block_tokens: int,
    pool_slots: int,
) -> StepMeta:
    """``lengths``: tokens each sequence already holds; ``counts``: its new ids (in ``ids``,
    packed in order); ``tables``: its pool blocks."""
    decode_only = len(ids) == len(counts)
    width = max(len(t) for t in tables)
    flat_tables = [b for t in tables for b in t + [0] * (width - len(t))]
    row_sequence = [] if decode_only else [s for s, n in enumerate(counts) for _ in range(n)]
    starts = lengths if decode_only else [lengths[s] for s in row_sequence]
    offsets = [0] * len(ids) if decode_only else [i for n in counts for i in range(n)]
    total = len(ids)
    uploaded = buffers.upload(ids + starts + offsets + counts + row_sequence + flat_tables)
    packed_ids = uploaded[:total]
    positions = uploaded[total : 2 * total] + uploaded[2 * total : 3 * total]
    new = uploaded[3 * total : 3 * total + len(counts)]
    rows_of = uploaded[3 * total + len(counts) : 3 * total + len(counts) + len(row_sequence)]
    table = uploaded[3 * total + len(counts) + len(row_sequence) :].view(len(counts), width)
    pool_table = torch.zeros(
        len(counts), pool_slots // block_tokens, dtype=torch.int32, device=buffers.device
    )
    pool_table[:, :width] = table
    row_tables = pool_table if decode_only else pool_table.index_select(0, rows_of)
    write_slots, mask = row_meta(row_tables, positions, block_tokens, pool_slots)
    return StepMeta(packed_ids, positions, write_slots, torch.cumsum(new, 0) - 1, mask)


def row_meta(
    tables: torch.Tensor, positions: torch.Tensor, block_tokens: int, pool_slots: int
) -> tuple[torch.Tensor, BlockMask]:
    """Each row's pool slot for its new K/V, and the attention block mask, from its
    sequence's pool blocks (``tables``, int32 ``[rows, pool blocks]``) and its position."""
    blocks = tables.gather(1, (positions // block_tokens)[:, None])[:, 0]
    write_slots = blocks.long() * block_tokens + positions % block_tokens
    return write_slots, paged_block_mask(tables, positions, block_tokens, pool_slots)
