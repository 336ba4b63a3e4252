"""The Triton split-K paged decode kernel (llava.exec.triton_decode) against one SDPA per row
over the slots of its own positions. On CPU it runs under Triton's interpreter, which Triton
chooses when the kernels are defined: TRITON_INTERPRET is set before the module is imported."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from llava.exec import triton_decode  # noqa: E402
from llava.exec.triton_decode import default_splits, paged_decode, unavailable  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
# (table, position) per row, for blocks of 4 tokens (a tile of the kernel is 16 tokens: four
# blocks): one token; a row ending exactly at a block boundary; rows ending mid-block; two
# sequences sharing their prefix block 5 (neither table adjacent nor in order); and a row of
# the same sequence at an earlier position.
ROWS_4 = [
    ([3], 0),
    ([9, 2], 7),
    ([5, 14, 1, 11], 13),
    ([5, 8], 5),
    ([5, 14, 1, 11], 9),
]
# Blocks of 16 tokens: one block a tile.
ROWS_16 = [([2], 0), ([7, 4], 31), ([4, 11, 0], 40)]


def make_inputs(rows, block_tokens, heads, kv_heads, dtype=torch.float32, seed=0, **geometry):
    """q and one layer of a pool laid out like KVPool.kv (keys and values are views of it):
    the slots the rows read random, every other slot NaN (a masked load never reads it)."""
    pool_blocks, head_dim = geometry.get("pool_blocks", 16), geometry.get("head_dim", 32)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.full((2, 2, kv_heads, pool_blocks * block_tokens, head_dim), float("nan"))
    for table, position in rows:
        for p in range(position + 1):
            slot = table[p // block_tokens] * block_tokens + p % block_tokens
            pool[1, :, :, slot] = torch.randn(2, kv_heads, head_dim, generator=gen)
    pool = pool.to(DEVICE, dtype)
    q = torch.randn(len(rows), heads, head_dim, generator=gen).to(DEVICE, dtype)
    tables = torch.zeros(len(rows), pool_blocks, dtype=torch.int32)
    for i, (table, _) in enumerate(rows):
        tables[i, : len(table)] = torch.tensor(table)
    positions = torch.tensor([p for _, p in rows])
    return q, pool[1, 0], pool[1, 1], tables.to(DEVICE), positions.to(DEVICE)


def reference(q, keys, values, tables, positions, block_tokens, scale):
    """Row by row, in fp32: SDPA over the slots of positions 0..positions[i]."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i, position in enumerate(positions.tolist()):
        p = torch.arange(position + 1, device=q.device)
        slots = tables[i].long()[p // block_tokens] * block_tokens + p % block_tokens
        out[i] = F.scaled_dot_product_attention(
            q[i, :, None].float(),
            keys[:, slots].float(),
            values[:, slots].float(),
            scale=scale,
            enable_gqa=True,
        )[:, 0]
    return out


# On a CPU each kernel call runs under Triton's interpreter (seconds): make test-fast keeps the
# checks without a kernel call; make test (and a GPU) runs the kernel's.
thorough = pytest.mark.thorough


# 8 splits are more than any row's blocks: the empty splits weigh nothing.
@thorough
@pytest.mark.parametrize(
    "kv_heads, splits",
    [(2, 1), (4, 3), (2, 8)],
    ids=["gqa-1", "mha-3", "gqa-8"],
)
def test_rows_equal_sdpa_over_their_own_slots(kv_heads, splits):
    inputs = make_inputs(ROWS_4, 4, heads=4, kv_heads=kv_heads)
    out = paged_decode(*inputs, block_tokens=4, scale=0.3, splits=splits)
    assert out.shape == inputs[0].shape and out.dtype == torch.float32
    expected = reference(*inputs, block_tokens=4, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@thorough
def test_heads_of_a_width_that_is_no_power_of_two():
    """The demo model's heads are 24 wide: the kernels tile 32 and mask the rest."""
    inputs = make_inputs(ROWS_16[:2], 16, heads=4, kv_heads=4, seed=4, head_dim=24)
    out = paged_decode(*inputs, block_tokens=16, scale=24**-0.5, splits=2)
    expected = reference(*inputs, block_tokens=16, scale=24**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@thorough
def test_one_block_a_tile_and_a_group_of_eight():
    inputs = make_inputs(ROWS_16, 16, heads=8, kv_heads=1, seed=1)
    out = paged_decode(*inputs, block_tokens=16, scale=32**-0.5, splits=2)
    expected = reference(*inputs, block_tokens=16, scale=32**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float16, marks=thorough),
        pytest.param(
            torch.bfloat16,
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not CUDA, reason="the interpreter's bf16 tl.dot is wrong"),
            ],
        ),
    ],
)
def test_half_precision_is_fp32_within_rounding(dtype):
    inputs = make_inputs(ROWS_4, 4, heads=4, kv_heads=2, dtype=dtype, seed=2)
    out = paged_decode(*inputs, block_tokens=4, scale=0.3, splits=2)
    assert out.dtype == dtype
    expected = reference(*inputs, block_tokens=4, scale=0.3)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@thorough
def test_default_splits_fill_the_gpu_within_bounds():
    assert default_splits(1, 8, 650, 16) == 16  # 33 wanted, at most MAX_SPLITS
    assert default_splits(1, 8, 40, 16) == 3  # no more splits than blocks
    assert default_splits(32, 8, 4096, 16) == 2  # 256 programs: 512 fill 132 SMs twice
    assert default_splits(64, 8, 4096, 16) == 1
    inputs = make_inputs(ROWS_16[:2], 16, heads=4, kv_heads=2, seed=3, pool_blocks=8)
    out = paged_decode(*inputs, block_tokens=16, scale=0.2)  # splits from the shapes: 8
    expected = reference(*inputs, block_tokens=16, scale=0.2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_available_here_and_says_why_not_elsewhere(monkeypatch):
    assert unavailable(DEVICE) is None
    assert unavailable(torch.device("meta"))
    monkeypatch.setattr(triton_decode, "triton", None)
    assert unavailable(DEVICE) == "triton is not installed"
    with pytest.raises(RuntimeError, match="needs triton"):
        paged_decode(*make_inputs(ROWS_16[:1], 16, 4, 2), block_tokens=16, scale=1.0)


def test_inputs_that_do_not_fit_are_refused():
    q, keys, values, tables, positions = make_inputs(ROWS_16[:1], 16, 4, 2)
    with pytest.raises(ValueError, match="power of 2"):
        paged_decode(q, keys, values, tables, positions, 12, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode(q[:, :3], keys, values, tables, positions, 16, 1.0)
    if not CUDA:
        half = [t.bfloat16() for t in (q, keys, values)]
        with pytest.raises(ValueError, match="bfloat16"):
            paged_decode(*half, tables, positions, 16, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the engine's geometry is too slow for the interpreter")
def test_a_7b_geometry_in_bf16():
    order = torch.randperm(80, generator=torch.Generator().manual_seed(5)).tolist()
    rows = [(order[:41], 649), (order[41:42], 0), (order[42:62], 319), (order[62:65], 33)]
    inputs = make_inputs(rows, 16, 32, 8, torch.bfloat16, seed=5, pool_blocks=80, head_dim=128)
    out = paged_decode(*inputs, block_tokens=16, scale=128**-0.5)
    expected = reference(*inputs, block_tokens=16, scale=128**-0.5)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA")
def test_captured_in_a_cuda_graph_and_replayed_with_new_rows():
    q, keys, values, tables, positions = make_inputs(ROWS_4, 4, heads=4, kv_heads=2)
    paged_decode(q, keys, values, tables, positions, 4, 0.3, splits=4)  # compiles, not captured
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode(q, keys, values, tables, positions, 4, 0.3, splits=4)
    rows = [(table[::-1], position) for table, position in ROWS_4[::-1]]
    new = make_inputs(rows, 4, heads=4, kv_heads=2, seed=4)
    for buffer, data in zip((q, keys, values, tables, positions), new, strict=True):
        buffer.copy_(data)
    graph.replay()
    expected = reference(*new, block_tokens=4, scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
