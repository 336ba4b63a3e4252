"""Paged attention (llava.exec.attention) against one SDPA per sequence over its own KV, on CPU:
the block mask built from the block tables is the logic the GPU runs too."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from llava.exec.attention import QUERY_BLOCK, paged_attention, paged_block_mask
from llava.exec.step_meta import row_slots

# Each shape compiles flex attention on the CPU (seconds): make test runs these, the GPU check
# runs the paged path on CUDA.
pytestmark = pytest.mark.thorough
BT = 4  # small blocks: many partial and full blocks in a short sequence
POOL_BLOCKS = 64


def scattered_tables(lengths: list[int], rng: random.Random) -> list[list[int]]:
    """Each sequence's blocks, drawn at random from one pool (never shared, rarely adjacent)."""
    free = list(range(POOL_BLOCKS))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // BT))] for n in lengths]


def reference(q, keys, values, table, positions, scale):
    """Row by row: SDPA over the slots of its sequence's positions 0..position."""
    out = torch.empty_like(q)
    for row, (blocks, position) in enumerate(zip(table, positions, strict=True)):
        slots = torch.tensor([blocks[p // BT] * BT + p % BT for p in range(position + 1)])
        out[row] = F.scaled_dot_product_attention(
            q[row, :, None],
            keys[:, slots],
            values[:, slots],
            scale=scale,
            enable_gqa=q.shape[1] != keys.shape[0],
        )[:, 0]
    return out


@pytest.mark.parametrize(
    ("kv_heads", "layout"),
    [(4, "partial"), (2, "partial"), (4, "full")],
    ids=["mha", "gqa", "full"],
)
def test_rows_of_prefills_and_decodes_equal_sdpa_per_sequence(kv_heads, layout):
    rng = random.Random(kv_heads)
    torch.manual_seed(kv_heads)
    lengths = [1, 3, 4, 5, 17, 30, 41]  # one token, partial block, exact blocks, long
    tables = scattered_tables(lengths, rng)
    keys = torch.randn(kv_heads, POOL_BLOCKS * BT, 8)
    values = torch.randn_like(keys)
    # every position of the first three (prefill rows), the last position of the others (decode)
    rows = [(s, p) for s in range(3) for p in range(lengths[s])]
    rows += [(s, lengths[s] - 1) for s in range(3, len(lengths))]
    row_tables = [tables[s] for s, _ in rows]
    positions = [p for _, p in rows]
    padded = torch.zeros(len(rows), POOL_BLOCKS, dtype=torch.int32)
    for row, blocks in enumerate(row_tables):
        padded[row, : len(blocks)] = torch.tensor(blocks)
    q = torch.randn(len(rows), 4, 8)
    write_slots = row_slots(padded, torch.tensor(positions), BT)
    mask = paged_block_mask(padded, torch.tensor(positions), BT, POOL_BLOCKS * BT, layout)
    with torch.inference_mode():
        got = paged_attention(q, keys, values, mask, 0.3, split_kv=2)
        # the mask function alone is the whole rule: eager flex (every slot scored) agrees
        padded = torch.cat((q, q[:1].expand(mask.kv_num_blocks.shape[0] - len(rows), 4, 8)))
        eager = flex_attention(
            padded[:, :, None], keys[None], values[None], block_mask=mask, scale=0.3,
            enable_gqa=kv_heads != 4,
        )[: len(rows), :, 0]  # fmt: skip
    expected = reference(q, keys, values, row_tables, positions, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager, expected, rtol=1e-5, atol=1e-5)
    expected_slots = [t[p // BT] * BT + p % BT for t, p in zip(row_tables, positions, strict=True)]
    assert write_slots.tolist() == expected_slots
    # CUDA's flex kernels skip every config whose BLOCK_M (16 up to 128) does not divide the
    # query block: a block of 1 compiled on CPU and on no GPU. The CPU kernel cannot see it.
    assert mask.BLOCK_SIZE == (QUERY_BLOCK, BT) and QUERY_BLOCK % 128 == 0
    if layout == "partial":  # every block a row reads is listed as partial: its own, no more
        used = [p // BT + 1 for p in positions]
        assert mask.full_kv_num_blocks is None or not mask.full_kv_num_blocks.any()
        assert mask.kv_num_blocks.view(-1)[: len(rows)].tolist() == used
        return
    # CUDA's decoding kernel reads the full lists with the partial lists' strides (an expanded
    # partial list made every row but the first read another row's blocks, seen on an H200).
    assert mask.kv_indices.stride() == mask.full_kv_indices.stride()
    assert mask.kv_num_blocks.stride() == mask.full_kv_num_blocks.stride()


def test_a_row_never_reads_another_sequences_blocks():
    """Poisoning every slot outside a sequence's own positions changes nothing it attends."""
    rng = random.Random(5)
    tables = scattered_tables([9, 14], rng)
    keys = torch.randn(2, POOL_BLOCKS * BT, 8)
    values = torch.randn_like(keys)
    padded = torch.zeros(2, POOL_BLOCKS, dtype=torch.int32)
    for row, blocks in enumerate(tables):
        padded[row, : len(blocks)] = torch.tensor(blocks)
    positions = torch.tensor([8, 13])
    q = torch.randn(2, 2, 8)
    mask = paged_block_mask(padded, positions, BT, POOL_BLOCKS * BT)
    with torch.inference_mode():
        before = paged_attention(q, keys, values, mask, 0.3)
        lengths = zip(tables, [9, 14], strict=True)
        own = {t[p // BT] * BT + p % BT for t, n in lengths for p in range(n)}
        others = torch.tensor(sorted(set(range(POOL_BLOCKS * BT)) - own))
        keys[:, others] = 1e4
        values[:, others] = -1e4
        after = paged_attention(q, keys, values, mask, 0.3)
    torch.testing.assert_close(after, before)
