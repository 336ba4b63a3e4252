"""Attention of a whole step over the paged KV pool: one call per layer, no gather.

Every new token is one query row (a batch entry of ``flex_attention`` with one query), the
keys and values are one layer of the pool as it lies (``[1, kv_heads, slots, head_dim]``), and a
block mask built from the block tables tells the kernel which pool blocks each row reads. Its
``layout`` is how the blocks are listed: ``partial`` (the default) lists each of the row's own
blocks as partial, so the mask function keeps its slots up to its position; ``full`` lists the
blocks entirely at or before its position as full (read without a mask) and the block holding
it as partial. With full blocks, CUDA's flex-decoding template sizes each ``SPLIT_KV`` tile by
the whole pool, so one program per head walks a row's whole history while the other splits
idle; with partial blocks only it splits the row's own blocks (``split_kv``; the runner gives
the Triton kernel's rule, llava.exec.triton_decode.default_splits). ``attend_paged`` runs the
rows through flex or through that Triton kernel (the same rows, tables and positions). A row
never reads another sequence's blocks, so prefill rows and decode rows of many sequences share
one call, and a decode row costs what its own KV costs. The same code runs on CPU (where CI
tests it) and on CUDA (docs/engine/execution.md §Paged attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from llava.exec import compiler, triton_decode

# Compiled once per process: eager flex_attention is a slow reference that materialises every
# score. Each model geometry, pool size and row bucket is its own graph (llava.exec.compiler).
_compiled_flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)
compiler.for_this_thread()

# Row counts the kernel is compiled for: a step's rows are padded up to the next (copies of its
# first row, whose outputs are dropped). Static shapes, because the CPU kernel generated for a
# dynamic row count failed to build (a C++ error in inductor's template) in some recompiles.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# The mask's query block. Each row is its own batch entry with one query, so any size covers
# it; but the CUDA kernels skip every config whose BLOCK_M does not divide it (flex decoding's
# BLOCK_M is at least 16 and grows with the GQA group; the main kernel's is 64 or 128), and a
# block of 1 left none at all: no decode step could compile on any GPU. 128 divides them all.
QUERY_BLOCK = 128
LAYOUTS = ("partial", "full")  # how a block mask lists a row's blocks (the module's docstring)


def padded_rows(rows: int) -> int:
    """The bucket ``rows`` query rows are padded to (a multiple of 64 past the largest)."""
    return next((b for b in BUCKETS if b >= rows), -(-rows // BUCKETS[-1]) * BUCKETS[-1])


def paged_block_mask(
    tables: torch.Tensor,
    positions: torch.Tensor,
    block_tokens: int,
    pool_slots: int,
    layout: str = "partial",
) -> BlockMask:
    """The block mask of one step: row i is at ``positions[i]`` of the sequence whose pool
    blocks are ``tables[i]`` (int32, ``[rows, pool blocks]``: as wide as the pool, which the
    kernel requires; only the first blocks of a row are read). ``layout``: one of LAYOUTS.

    The mask function alone is the whole rule (a slot belongs to the row's sequence, at a
    position up to the row's), so the block lists are only what lets the kernel skip work:
    eager and compiled flex_attention agree."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    real, pool_blocks = tables.shape
    rows = padded_rows(real)
    if rows != real:  # pad with copies of row 0
        pad = torch.zeros(rows - real, dtype=torch.long, device=tables.device)
        tables = torch.cat((tables, tables[pad]))
        positions = torch.cat((positions, positions[pad]))
    used = (positions // block_tokens + 1)[:, None]
    logical = torch.arange(pool_blocks, device=tables.device).expand(rows, pool_blocks)
    # Who owns each pool block (a sequence is named by its first block) and at which logical
    # block; rows past their used blocks write a spare last entry.
    target = torch.where(logical < used, tables.long(), pool_blocks).view(-1)
    owner = tables.new_full((pool_blocks + 1,), -1)
    owner.scatter_(0, target, tables[:, :1].expand(rows, pool_blocks).reshape(-1))
    block_position = tables.new_zeros(pool_blocks + 1)
    block_position.scatter_(0, target, logical.to(tables.dtype).reshape(-1))
    # Buffers the mask function reads must be plain (stride 1, not a view of an input) for
    # the CPU kernel; a one-row slice would carry the table's row stride.
    first = torch.empty(rows, dtype=tables.dtype, device=tables.device).copy_(tables[:, 0])

    def own_past(b, h, q_idx, kv_idx):
        block = kv_idx // block_tokens
        position = block_position[block] * block_tokens + kv_idx % block_tokens
        return (owner[block] == first[b]) & (position <= positions[b])

    if layout == "partial":  # every block of the row's own, masked by own_past
        used_count = used.view(rows, 1, 1).to(torch.int32)
        lists = tables.view(rows, 1, 1, -1)
        # No full lists, or CUDA's decoding kernel tiles its splits by the whole pool. torch
        # 2.13's CPU kernel does not build without them: it gets empty ones, the same mask.
        no_full = (None, None)
        if tables.device.type == "cpu":
            no_full = (torch.zeros_like(used_count), torch.zeros_like(lists))
        return BlockMask(
            (1, pool_slots), used_count, lists, *no_full,
            None, None, None, None, BLOCK_SIZE=(QUERY_BLOCK, block_tokens), mask_mod=own_past,
        )  # fmt: skip
    seen = positions + 1  # tokens the row sees
    full_count = (seen // block_tokens).to(torch.int32)
    partial_count = (seen % block_tokens != 0).to(torch.int32)
    partial_index = tables.gather(1, (positions // block_tokens)[:, None])
    # CUDA's decoding kernel reads the full-block lists with the partial lists' strides: both
    # must be laid out alike ([rows, 1, 1, pool blocks], contiguous), not an expanded view.
    partial_lists = partial_index.view(rows, 1, 1, 1).expand(rows, 1, 1, pool_blocks).contiguous()
    return BlockMask(
        (1, pool_slots),
        partial_count.view(rows, 1, 1),
        partial_lists,
        full_count.view(rows, 1, 1),
        tables.view(rows, 1, 1, -1),
        None,
        None,
        None,
        None,
        BLOCK_SIZE=(QUERY_BLOCK, block_tokens),
        mask_mod=own_past,
    )


def paged_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: BlockMask,
    scale: float,
    split_kv: int | None = None,
) -> torch.Tensor:
    """``q`` ``[rows, heads, head_dim]`` against one layer of the pool (``keys``/``values``
    ``[kv_heads, slots, head_dim]``), ``mask`` from ``paged_block_mask`` (its rows padded);
    returns q's shape. ``split_kv``: flex-decoding's ``SPLIT_KV`` (None: torch's own choice)."""
    real = q.shape[0]
    rows = mask.kv_num_blocks.shape[0]
    if rows != real:
        q = torch.cat((q, q[:1].expand(rows - real, *q.shape[1:])))
    keys, values = keys[None], values[None]
    out = _compiled_flex(
        q[:, :, None],
        keys,
        values,
        block_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
        kernel_options=None if split_kv is None else {"SPLIT_KV": split_kv},
    )
    return out[:real, :, 0]


PAGED = ("flex", "triton")  # the paged decode paths (llava.exec.runner.Runner's attention)


@dataclass(frozen=True)
class PagedRows:
    """The rows a step reads through one paged attention call a layer, prepared once for
    every layer: row i is at ``positions[i]`` of the sequence with pool blocks ``tables[i]``."""

    kind: str  # one of PAGED
    tables: torch.Tensor  # int32 [rows, pool blocks]
    positions: torch.Tensor  # int64 [rows]
    block_tokens: int
    splits: int  # the Triton kernel's splits, flex's SPLIT_KV (triton_decode.default_splits)
    mask: BlockMask | None  # flex's block mask (None for the Triton kernel)


def paged_rows(
    kind: str,
    tables: torch.Tensor,
    positions: torch.Tensor,
    block_tokens: int,
    pool_slots: int,
    splits: int,
) -> PagedRows:
    mask = None
    if kind == "flex":
        mask = paged_block_mask(tables, positions, block_tokens, pool_slots)
    elif kind != "triton":
        raise ValueError(f"paged attention must be one of {PAGED}, got {kind!r}")
    return PagedRows(kind, tables, positions, block_tokens, splits, mask)


def attend_paged(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: PagedRows, scale: float
) -> torch.Tensor:
    """``q`` ``[rows, heads, head_dim]`` against one layer of the pool (``keys``/``values``
    ``[kv_heads, slots, head_dim]``) through the path ``rows`` was prepared for."""
    if rows.kind == "flex":
        return paged_attention(q, keys, values, rows.mask, scale, rows.splits)
    return triton_decode.paged_decode(
        q, keys, values, rows.tables, rows.positions, rows.block_tokens, scale, splits=rows.splits
    )
