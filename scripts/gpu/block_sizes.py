"""The paged flex call's kernel time by pool block size, on CUDA (a lent GPU machine).

    python3 -u -m scripts.gpu.block_sizes

One layer of llava-1.5-7b's attention (32 heads × 128, bf16) over a pool of 204,800 slots (the
7B's 100 GiB pool on an H200), each row's blocks adjacent; the block mask is built once and 20
calls are captured in one CUDA graph, so the figure is the kernel's time alone, not the mask's
or the launches'. Rows of 1 and 32, contexts of 650 and 2,000 tokens, blocks of 16 to 128
tokens. Results: docs/performance.md §Pool block size on CUDA.
"""

from __future__ import annotations

import torch

from llava.exec.attention import paged_attention, paged_block_mask

SLOTS, HEADS, HEAD_DIM = 204_800, 32, 128
CALLS, REPLAYS = 20, 5


def kernel_us(keys, values, context: int, block_tokens: int, rows: int) -> float:
    """Microseconds per call of the paged flex kernel, replayed from a graph."""
    device = keys.device
    each = -(-context // block_tokens)
    tables = torch.zeros(rows, SLOTS // block_tokens, dtype=torch.int32, device=device)
    for row in range(rows):  # every sequence followed by a gap of its size
        tables[row, :each] = torch.arange(2 * row * each, 2 * row * each + each)
    positions = torch.full((rows,), context - 1, device=device)
    q = torch.randn(rows, HEADS, HEAD_DIM, device=device, dtype=keys.dtype)
    mask = paged_block_mask(tables, positions, block_tokens, SLOTS)
    scale = HEAD_DIM**-0.5
    with torch.inference_mode():
        for _ in range(3):  # compiles, then warm
            paged_attention(q, keys, values, mask, scale)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                paged_attention(q, keys, values, mask, scale)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / (CALLS * REPLAYS) * 1e3


def main() -> None:
    if not torch.cuda.is_available():
        print(f"gpu_block_sizes: no CUDA device here (torch {torch.__version__})")
        return
    torch.manual_seed(0)
    keys = torch.randn(HEADS, SLOTS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    for context in (650, 2000):
        for block_tokens in (16, 32, 64, 128):
            for rows in (1, 32):
                us = kernel_us(keys, values, context, block_tokens, rows)
                print(f"context {context} block {block_tokens} rows {rows}: {us:.1f} us/call "
                      "in a graph", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
