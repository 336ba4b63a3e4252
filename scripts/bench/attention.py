"""One layer's decode attention over a paged pool, by candidate: the alternatives measured.

    python -m scripts.bench.attention [--batch 32] [--context 650] [--heads 12] [--kv-heads 12]
                                      [--head-dim 64] [--block-tokens 16] [--rounds 7]
                                      [--device auto] [--dtype float32]

``batch`` sequences each hold ``context`` tokens in a pool laid out as llava.kv.pool lays it
out ([kv_heads, slots, head_dim] per layer), each sequence's blocks adjacent with a gap after
them (as the pool hands them out), and one query row each:

- ``flex paged`` (llava.exec.attention, what the runner runs): one compiled flex_attention call,
  block mask from the block tables, KV read in place;
- ``SDPA loop``: one scaled_dot_product_attention per sequence over its slice of the pool (the
  runner before this design);
- ``padded gather + SDPA``: every sequence's KV gathered into [batch, heads, context, dim], one
  call (exact, but copies all the KV every step);
- ``dense SDPA (reference)``: one call over an already padded [batch, heads, context, dim]
  tensor: not available over a paged pool (the sequences' KV is not one strided view), shown as
  the floor a copy-free batched call could reach;
- ``varlen_attn block_table`` (CUDA only): torch's flash-attention varlen kernel over the pool's
  blocks, when the installed build accepts the pool's strides ("n/a" otherwise).

Every candidate's output is checked against the loop. Medians of ``--rounds`` rounds that
interleave the candidates (other processes' load hits them alike).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llava.exec.attention import paged_attention, paged_block_mask

FLEX, LOOP = "flex paged (kept)", "SDPA loop (before)"
DENSE = "dense SDPA (reference)"  # a floor: no paged pool gives this layout without a copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=650)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = getattr(torch, args.dtype)
    with torch.inference_mode():
        table = measure(args, device, dtype)
    print(
        f"decode attention, one layer: {args.batch} rows x {args.context} tokens, "
        f"{args.heads} heads ({args.kv_heads} KV) x {args.head_dim}, {args.dtype} on {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of "
        f"{args.rounds} interleaved rounds"
    )
    print(f"{'candidate':<28}{'ms':>9}{'min ms':>9}{'max |diff|':>12}")
    for name, (times, diff) in table.items():
        if times is None:
            print(f"{name:<28}{'n/a':>9}{'':>9}  {diff}")
        else:
            print(
                f"{name:<28}{statistics.median(times) * 1e3:>9.2f}{min(times) * 1e3:>9.2f}"
                f"{diff:>12.1e}"
            )


def candidates(args, device, dtype) -> dict[str, Callable[[], torch.Tensor]]:
    """Each candidate's one-layer call over the same pool, queries and tables."""
    torch.manual_seed(0)
    bt, batch, context = args.block_tokens, args.batch, args.context
    blocks_each = -(-context // bt)
    pool_blocks = 2 * batch * blocks_each  # every sequence followed by a gap of its size
    slots = pool_blocks * bt
    keys = torch.randn(args.kv_heads, slots, args.head_dim, device=device, dtype=dtype)
    values = torch.randn_like(keys)
    q = torch.randn(batch, args.heads, args.head_dim, device=device, dtype=dtype)
    starts = [2 * b * blocks_each for b in range(batch)]
    tables = torch.zeros(batch, pool_blocks, dtype=torch.int32, device=device)
    for b, first in enumerate(starts):
        tables[b, :blocks_each] = torch.arange(first, first + blocks_each)
    positions = torch.full((batch,), context - 1, device=device)
    scale = args.head_dim**-0.5
    gqa = args.heads != args.kv_heads

    def loop():
        out = torch.empty_like(q)
        for b, first in enumerate(starts):
            span = slice(first * bt, first * bt + context)
            out[b] = F.scaled_dot_product_attention(
                q[b, :, None], keys[:, span], values[:, span], scale=scale, enable_gqa=gqa
            )[:, 0]
        return out

    def flex():
        mask = paged_block_mask(tables, positions, bt, slots)
        return paged_attention(q, keys, values, mask, scale)

    gather_slots = torch.stack(
        [torch.arange(first * bt, first * bt + context, device=device) for first in starts]
    )

    def padded_gather():
        k = keys[:, gather_slots].transpose(0, 1)
        v = values[:, gather_slots].transpose(0, 1)
        out = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=gqa)
        return out[:, :, 0]

    dense_k = keys[:, gather_slots].transpose(0, 1).contiguous()
    dense_v = values[:, gather_slots].transpose(0, 1).contiguous()

    def dense():
        out = F.scaled_dot_product_attention(
            q[:, :, None], dense_k, dense_v, scale=scale, enable_gqa=gqa
        )
        return out[:, :, 0]

    runs = {
        FLEX: flex,
        LOOP: loop,
        "padded gather + SDPA": padded_gather,
        DENSE: dense,
    }
    if device.type == "cuda":
        runs["varlen_attn block_table"] = varlen_candidate(
            q, keys, values, tables[:, :blocks_each], context, bt, scale, gqa
        )
    return runs


def measure(args, device, dtype) -> dict:
    """name → (times, max |diff| against the loop), or (None, why it cannot run)."""
    runs = candidates(args, device, dtype)
    reference = runs[LOOP]()
    table, runnable = {}, {}
    for name, run in runs.items():
        try:
            diff = (run().float() - reference.float()).abs().max().item()  # also compiles
        except Exception as error:  # a candidate this build or device cannot run
            table[name] = (None, f"{type(error).__name__}: {str(error).splitlines()[0][:60]}")
            continue
        table[name], runnable[name] = ([], diff), run
    for _ in range(args.rounds):
        for name, run in runnable.items():
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            table[name][0].append(time.perf_counter() - start)
    return table


def varlen_candidate(q, keys, values, tables, context, bt, scale, gqa):
    """torch.nn.attention.varlen.varlen_attn over the pool's blocks as [pages, page, heads, dim]
    (a strided view of the pool's [heads, slots, dim] layer: no copy)."""
    heads, slots, dim = keys.shape
    paged_k = keys.view(heads, slots // bt, bt, dim).permute(1, 2, 0, 3)
    paged_v = values.view(heads, slots // bt, bt, dim).permute(1, 2, 0, 3)
    batch = q.shape[0]
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    used = torch.full((batch,), context, dtype=torch.int32, device=q.device)

    def run():
        from torch.nn.attention.varlen import varlen_attn  # not in every build: then "n/a"

        grouped = {"enable_gqa": True} if gqa else {}  # torch 2.11 has no such argument
        return varlen_attn(
            q, paged_k, paged_v, cu_q, None, 1, context, scale=scale, seqused_k=used,
            block_table=tables, **grouped,
        )  # fmt: skip

    return run


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
