"""Paged decode attention in Triton, split-K: the second path (beside flex_attention) for the
decode rows of a step.

Every row is one query token of some sequence: ``q[i]`` (``[heads, head_dim]``) attends to its
sequence's positions ``0..positions[i]``, whose keys and values lie in one layer of the KV pool
as it lies (``keys``/``values`` ``[kv_heads, slots, head_dim]``, slot ``block * block_tokens +
offset``); ``tables[i]`` lists the sequence's pool blocks in logical order. Nothing is gathered:
the kernel reads each row's own blocks in place.

Why split-K: one program per (row, kv head) leaves a single 650-token row with 8 programs on a
GPU of 132 SMs, each walking 41 blocks alone. Here the grid is (rows, kv_heads, splits): each
program takes one share of its row's blocks (the shares are computed in the kernel from the
row's position, so a short row leaves its last splits empty) and all the query heads of one KV
head (the GQA group), so K/V is read once per group. It writes an fp32 partial output with its
running max and sum; a second small kernel combines the splits (log-sum-exp weights) into the
output, in q's dtype.

Graph-capturable: ``splits`` is static (an argument, not read from device data), the buffers'
shapes follow the inputs' shapes only, and nothing syncs with the host. On CPU the kernels run
under Triton's interpreter, which is chosen when the kernels are defined: ``TRITON_INTERPRET=1``
must be set before this module is first imported.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the module imports without triton; paged_decode says why it cannot run
    triton = None

# The interpreter is chosen when a kernel is defined (at import): what unavailable() reports.
_INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)

# Splits are bounded: past a few blocks each, a split's fixed cost (its partial output, its
# share of the combine) outweighs the parallelism it adds.
MAX_SPLITS = 16
# SMs of the GPUs the engine is sized for (H100 SXM, H200).
SMS = 132
# The smallest tile tl.dot takes on a GPU (each of M, N and K).
DOT_MIN = 16
# exp2 is the fast exponential on the GPU: scores are scaled by log2(e) once.
LOG2E = 1.4426950408889634


def default_splits(
    rows: int, kv_heads: int, max_tokens: int, block_tokens: int, sms: int = SMS
) -> int:
    """Splits for a launch of ``rows`` rows whose longest history is ``max_tokens``: the
    smallest power of two that gives at least two programs per SM (rows * kv_heads * splits >=
    2 * sms), at most MAX_SPLITS and at most one split per block of ``max_tokens``, at least 1.

    Static shapes only (a graph bucket's rows, the pool's width), never device data."""
    wanted = _next_power_of_2(-(-2 * sms // max(1, rows * kv_heads)))
    return max(1, min(wanted, MAX_SPLITS, -(-max_tokens // block_tokens)))


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def unavailable(device) -> str | None:
    """None when ``paged_decode`` can run on tensors of ``device``, else why not (one line)."""
    if triton is None:
        return "triton is not installed"
    kind = torch.device(device).type
    if _INTERPRETED:
        if kind == "cpu":
            return None
        return f"TRITON_INTERPRET=1 runs the triton attention in the interpreter, not on {kind}"
    if kind == "cuda":
        return None
    return (
        "the triton attention runs on CUDA, or on CPU under TRITON_INTERPRET=1 (set before "
        "llava.exec.triton_decode is imported)"
    )


def paged_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    block_tokens: int,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of each row of ``q`` ``[rows, heads, head_dim]`` over its sequence's positions
    ``0..positions[i]`` (``positions`` ``[rows]``, >= 0) in the pool blocks ``tables[i]``
    (``[rows, width]``, integer); ``keys``/``values`` ``[kv_heads, slots, head_dim]`` in q's
    dtype, their last dimension contiguous. ``splits``: the programs a (row, kv head) is
    split over; None: ``default_splits`` of the shapes (the table as wide as the pool's
    history). Returns q's shape and dtype."""
    if triton is None:
        raise RuntimeError("paged_decode needs triton, which is not installed")
    problem = _problem(q, keys, values, tables, positions, block_tokens, splits)
    if problem:
        raise ValueError(f"paged_decode: {problem}")
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    if splits is None:
        splits = default_splits(rows, kv_heads, tables.shape[1] * block_tokens, block_tokens)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    partial = torch.empty((rows, heads, splits, head_dim), dtype=torch.float32, device=q.device)
    maxes = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    group = heads // kv_heads
    _split_kernel[(rows, kv_heads, splits)](
        q, *q.stride()[:2],
        keys, *keys.stride()[:2],
        values, *values.stride()[:2],
        tables, tables.stride(0),
        positions,
        partial, maxes, sums,
        scale * LOG2E,
        HEAD_DIM=head_dim,
        HEAD_PAD=_head_pad(head_dim),
        BLOCK_TOKENS=block_tokens,
        TILE_BLOCKS=max(1, DOT_MIN // block_tokens),
        GROUP=group,
        GROUP_PAD=max(DOT_MIN, _next_power_of_2(group)),
        SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WHILE_LOOP=_INTERPRETED,
    )  # fmt: skip
    _combine_kernel[(rows, heads)](
        partial, maxes, sums,
        out, *out.stride()[:2],
        heads,
        HEAD_DIM=head_dim,
        HEAD_PAD=_head_pad(head_dim),
        SPLITS=splits,
        SPLITS_PAD=_next_power_of_2(splits),
    )  # fmt: skip
    return out


def _problem(q, keys, values, tables, positions, block_tokens: int, splits) -> str | None:
    """Why the inputs do not fit the kernel (shapes, dtypes, strides), None when they do."""
    if q.dim() != 3 or keys.dim() != 3 or keys.shape != values.shape:
        return f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}"
    rows, heads, head_dim = q.shape
    if splits is not None and splits < 1:
        return f"splits must be at least 1, got {splits}"
    if keys.shape[2] != head_dim or heads % keys.shape[0]:
        return f"q {tuple(q.shape)} does not fit keys {tuple(keys.shape)}"
    if not _power_of_2(block_tokens):
        return f"block_tokens {block_tokens} must be a power of 2"
    if keys.dtype != q.dtype or values.dtype != q.dtype:
        return f"q is {q.dtype}, keys {keys.dtype}, values {values.dtype}"
    if _INTERPRETED and q.dtype == torch.bfloat16:  # it multiplies their bits as integers
        return "Triton's interpreter computes tl.dot of bfloat16 wrongly: use float32 or float16"
    if tables.dim() != 2 or tables.shape[0] != rows or positions.shape != (rows,):
        return f"tables {tuple(tables.shape)}, positions {tuple(positions.shape)}, rows {rows}"
    if any(t.stride(-1) != 1 for t in (q, keys, values, tables, positions) if t.numel() > 1):
        return "the last dimension of q, keys, values, tables and positions must be contiguous"
    return None


def _power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _head_pad(head_dim: int) -> int:
    """The head dimension as the kernels tile it: a power of 2 (tl.arange's rule), at least
    DOT_MIN (tl.dot's); the padding is masked (the demo model's heads are 24 wide)."""
    return max(DOT_MIN, _next_power_of_2(head_dim))


if triton is not None:

    @triton.jit
    def _split_kernel(
        q_ptr, q_row_stride, q_head_stride,
        k_ptr, k_head_stride, k_slot_stride,
        v_ptr, v_head_stride, v_slot_stride,
        tables_ptr, tables_row_stride,
        positions_ptr,
        partial_ptr, maxes_ptr, sums_ptr,
        qk_scale,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr,
        TILE_BLOCKS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        SPLITS: tl.constexpr,
        PRECISION: tl.constexpr,
        WHILE_LOOP: tl.constexpr,
    ):  # fmt: skip
        """One (row, kv head, split): the group's heads over the split's share of the row's
        blocks, TILE_BLOCKS blocks a step. The group is padded to GROUP_PAD (>= 16) rows of
        zeros so both products are tl.dot, which a GPU runs on tensor cores only from 16 a
        side (a broadcast product would hold group x tile x head_dim values in registers); the
        padded heads' results are never stored."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        position = tl.load(positions_ptr + row).to(tl.int64)
        used = position // BLOCK_TOKENS + 1  # blocks holding positions 0..position
        per_split = tl.cdiv(used, SPLITS)
        first = split * per_split
        last = tl.minimum(first + per_split, used)

        member = tl.arange(0, GROUP_PAD)
        dim = tl.arange(0, HEAD_PAD)
        stored = (member < GROUP)[:, None] & (dim < HEAD_DIM)[None, :]
        heads = kv_head * GROUP + member
        in_group = member < GROUP
        q_rows = q_ptr + row * q_row_stride + heads[:, None] * q_head_stride + dim[None, :]
        q = tl.load(q_rows, mask=stored, other=0.0)
        # Pool offsets run past 2**31 in a large pool: 64-bit from the head on.
        k_head = k_ptr + kv_head.to(tl.int64) * k_head_stride
        v_head = v_ptr + kv_head.to(tl.int64) * v_head_stride

        table = tables_ptr + row * tables_row_stride
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        # Triton 3.6's interpreter takes no tensor as a range bound under numpy >= 2.4
        # (triton-lang/triton#9171): it walks the tiles in a while loop. The GPU keeps the for
        # loop, which Triton software-pipelines (the next tile's loads under this one's maths).
        if WHILE_LOOP:
            tile = first
            while tile < last:
                running_max, running_sum, acc = _attend_tile(
                    q, k_head, k_slot_stride, v_head, v_slot_stride, table, tile, last,
                    position, qk_scale, running_max, running_sum, acc,
                    HEAD_DIM, HEAD_PAD, BLOCK_TOKENS, TILE_BLOCKS, PRECISION,
                )  # fmt: skip
                tile += TILE_BLOCKS
        else:
            for tile in range(first, last, TILE_BLOCKS):
                running_max, running_sum, acc = _attend_tile(
                    q, k_head, k_slot_stride, v_head, v_slot_stride, table, tile, last,
                    position, qk_scale, running_max, running_sum, acc,
                    HEAD_DIM, HEAD_PAD, BLOCK_TOKENS, TILE_BLOCKS, PRECISION,
                )  # fmt: skip

        # An empty split stores max -inf, sum 0 and output 0: it weighs nothing in the combine.
        at = (row * GROUP * tl.num_programs(1) + heads) * SPLITS + split
        tl.store(maxes_ptr + at, running_max, mask=in_group)
        tl.store(sums_ptr + at, running_sum, mask=in_group)
        tl.store(partial_ptr + at[:, None] * HEAD_DIM + dim[None, :], acc, mask=stored)

    @triton.jit
    def _attend_tile(
        q, k_head, k_slot_stride, v_head, v_slot_stride, table, tile, last,
        position, qk_scale, running_max, running_sum, acc,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr,
        TILE_BLOCKS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """The online softmax one tile further: logical blocks tile.. (up to ``last``, the
        split's end) of the row at ``position``; returns the new max, sum and output."""
        token = tl.arange(0, TILE_BLOCKS * BLOCK_TOKENS)
        offset = token % BLOCK_TOKENS
        dim = tl.arange(0, HEAD_PAD)
        in_head = dim < HEAD_DIM
        logical = tile + token // BLOCK_TOKENS
        in_split = logical < last
        block = tl.load(table + logical, mask=in_split, other=0)
        slot = block.to(tl.int64) * BLOCK_TOKENS + offset
        # Masked loads read no slot past the row's position: not even a finite one.
        seen = in_split & (logical * BLOCK_TOKENS + offset <= position)
        k = tl.load(
            k_head + slot[None, :] * k_slot_stride + dim[:, None],
            mask=seen[None, :] & in_head[:, None],
            other=0.0,
        )
        scores = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        # A tile's first token is always seen (its block is one the row uses): the new max is
        # finite, and the first tile's rescale is exp2(-inf) = 0.
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        weights = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        v = tl.load(
            v_head + slot[:, None] * v_slot_stride + dim[None, :],
            mask=seen[:, None] & in_head[None, :],
            other=0.0,
        )
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        return new_max, running_sum, acc

    @triton.jit
    def _combine_kernel(
        partial_ptr, maxes_ptr, sums_ptr,
        out_ptr, out_row_stride, out_head_stride,
        heads,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):  # fmt: skip
        """One (row, head): its splits' partial outputs weighed by exp2(split max - max)."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.arange(0, SPLITS_PAD)
        dim = tl.arange(0, HEAD_PAD)
        in_head = dim < HEAD_DIM
        real = split < SPLITS
        at = (row * heads + head) * SPLITS + split
        split_max = tl.load(maxes_ptr + at, mask=real, other=float("-inf"))
        split_sum = tl.load(sums_ptr + at, mask=real, other=0.0)
        partial = tl.load(
            partial_ptr + at[:, None] * HEAD_DIM + dim[None, :],
            mask=real[:, None] & in_head[None, :],
            other=0.0,
        )
        # The first split always holds block 0: the max is finite.
        weight = tl.exp2(split_max - tl.max(split_max, 0))
        total = tl.sum(partial * weight[:, None], 0) / tl.sum(split_sum * weight, 0)
        out = out_ptr + row * out_row_stride + head * out_head_stride + dim
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=in_head)
