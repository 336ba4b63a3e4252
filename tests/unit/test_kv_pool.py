"""The KV pool: one up-front tensor, fixed-size blocks, block tables that never overlap."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlavaConfig

from llava.kv.pool import KVPool, KVPoolFull

LLAVA_15 = Path(__file__).resolve().parents[1] / "fixtures" / "llava-1.5-7b-hf"
TINY = LlamaConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)  # kv heads 2, head_dim 16
TINY_BLOCK_BYTES = 2 * 2 * 2 * 4 * 16 * 4  # layers, K/V, kv heads, 4 tokens, head dim, fp32


def tiny_pool(blocks: int, device="cpu") -> KVPool:
    return KVPool(TINY, blocks * TINY_BLOCK_BYTES, device, torch.float32, block_tokens=4)


def test_llava_15_block_is_eight_mib_in_fp16():
    text = LlavaConfig.from_pretrained(LLAVA_15).text_config
    pool = KVPool(text, budget_bytes=(8 << 20) * 3 + 5, device="meta", dtype=torch.float16)
    # 32 layers x K/V x 32 heads x 16 tokens x 128 dims x 2 bytes
    assert pool.bytes_per_block == 8 << 20
    assert pool.total_blocks == 3
    assert tuple(pool.kv.shape) == (32, 2, 32, 3 * 16, 128)


def test_budget_below_one_block_is_refused():
    with pytest.raises(ValueError, match="smaller than one block"):
        KVPool(TINY, TINY_BLOCK_BYTES - 1, "cpu", torch.float32, block_tokens=4)


def test_allocated_bytes_is_the_tensor_storage_and_within_budget():
    budget = 10 * TINY_BLOCK_BYTES + TINY_BLOCK_BYTES // 2
    pool = KVPool(TINY, budget, "cpu", torch.float32, block_tokens=4)
    assert pool.bytes_per_block == TINY_BLOCK_BYTES
    assert pool.total_blocks == pool.free_blocks == 10
    assert pool.allocated_bytes == pool.kv.untyped_storage().nbytes() == 10 * TINY_BLOCK_BYTES
    assert pool.allocated_bytes <= budget


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocator_holds_exactly_the_pool():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    pool = tiny_pool(1000, device="cuda")
    held = torch.cuda.memory_allocated() - before
    assert pool.allocated_bytes <= held < pool.allocated_bytes + 512  # allocator rounding
    session = pool.new_kv()
    session.reserve(4 * 1000)
    assert torch.cuda.memory_allocated() - before == held  # sessions allocate nothing


def test_reserve_takes_whole_blocks_and_only_what_is_missing():
    pool = tiny_pool(10)
    kv = pool.new_kv()
    assert (kv.length, kv.nbytes, kv.blocks) == (0, 0, [])
    assert pool.blocks_needed(kv, 5) == 2
    kv.reserve(5)
    assert len(kv.blocks) == 2 and kv.capacity == 8 and kv.nbytes == 2 * TINY_BLOCK_BYTES
    kv.reserve(3)  # 8 tokens fit in the 2 blocks held
    assert len(kv.blocks) == 2 and pool.free_blocks == 8
    kv.length = 8
    assert pool.blocks_needed(kv, 1) == 1


def test_reserve_that_cannot_be_met_takes_nothing():
    pool = tiny_pool(4)
    first, second = pool.new_kv(), pool.new_kv()
    first.reserve(4 * 3)
    with pytest.raises(KVPoolFull):
        second.reserve(4 * 2)
    assert second.blocks == [] and pool.free_blocks == 1
    second.reserve(4)  # what is left can still be had
    assert pool.free_blocks == 0


def test_crop_frees_blocks_past_the_kept_tokens():
    pool = tiny_pool(10)
    kv = pool.new_kv()
    kv.reserve(4 * 5)
    kv.length = 18
    kept_blocks = kv.blocks[:2]
    kv.crop(7)  # tokens 0..6 live in blocks 0 and 1
    assert kv.length == 7 and kv.blocks == kept_blocks and pool.free_blocks == 8
    kv.crop(0)
    assert kv.blocks == [] and pool.free_blocks == 10
    with pytest.raises(ValueError, match="cannot crop"):
        kv.crop(1)


def test_free_gives_everything_back_and_is_idempotent():
    pool = tiny_pool(6)
    kv = pool.new_kv()
    kv.reserve(4 * 6)
    kv.length = 21
    kv.free()
    kv.free()
    assert (kv.length, kv.nbytes, pool.free_blocks) == (0, 0, 6)


# Two thousand random operations (seconds): make test-fast keeps the single-purpose tests above
# and below (reserve, crop, free, a blocked session's move, no room to move).
@pytest.mark.thorough
def test_random_reserve_crop_free_never_shares_loses_or_corrupts_a_block():
    """Each session writes its own number into the tokens it adds; through moves, crops and
    frees every session still reads only its own number."""
    pool = tiny_pool(40)
    sessions = [pool.new_kv() for _ in range(6)]
    rng = random.Random(7)
    moves = 0
    for _ in range(2000):
        index = rng.randrange(len(sessions))
        kv = sessions[index]
        action = rng.random()
        if action < 0.5:
            before = list(kv.blocks)
            with contextlib.suppress(KVPoolFull):
                kv.reserve(rng.randint(0, 12))
            moves += bool(before) and kv.blocks[: len(before)] != before
            written = rng.randint(kv.length, kv.capacity)  # the runner writes up to capacity
            pool.kv[..., kv.slots(kv.length, written), :] = float(index + 1)
            kv.length = written
        elif action < 0.85:
            kv.crop(rng.randint(0, kv.length))
        else:
            kv.free()
        held = [block for s in sessions for block in s.blocks]
        assert len(held) == len(set(held)), "a block is in two tables"
        free = [i for i, is_free in enumerate(pool._free_map) if is_free]
        assert sorted(held + free) == list(range(40)), "a block was lost or duplicated"
        assert sum(s.nbytes for s in sessions) == (40 - pool.free_blocks) * TINY_BLOCK_BYTES
        for number, s in enumerate(sessions, 1):
            assert bool((pool.kv[..., s.slots(0, s.length), :] == number).all()), "corrupted"
    assert moves > 50  # the moving path ran


def test_writing_one_sessions_slots_leaves_the_others_kv_alone():
    pool = tiny_pool(12)
    a, b = pool.new_kv(), pool.new_kv()
    a.reserve(10)
    b.reserve(10)
    pool.kv.zero_()
    b_before = pool.kv[..., b.slots(0, 10), :].clone()
    pool.kv[..., a.slots(0, 10), :] = 1.0
    assert torch.equal(pool.kv[..., b.slots(0, 10), :], b_before)
    assert bool((pool.kv[..., a.slots(0, 10), :] == 1.0).all())


def test_slots_follow_the_block_table():
    pool = tiny_pool(8)
    other, kv = pool.new_kv(), pool.new_kv()
    other.reserve(4)  # so kv's blocks do not start at 0
    kv.reserve(9)
    expected = [kv.blocks[p // 4] * 4 + p % 4 for p in range(2, 9)]
    assert kv.slots(2, 9).tolist() == expected
    with pytest.raises(ValueError, match="outside"):
        kv.slots(0, 13)


def test_a_blocked_session_moves_its_kv_to_a_run_that_fits_it_whole():
    pool = tiny_pool(10)
    first, second = pool.new_kv(), pool.new_kv()
    first.reserve(4)
    first.reserve(8)  # grows into the next block
    second.reserve(4)
    assert first.blocks == [0, 1] and second.blocks == [2]
    pool.kv.zero_()
    first.length = 6
    written = torch.arange(1.0, 7.0).view(6, 1)
    pool.kv[..., first.slots(0, 6), :] = written
    first.reserve(6)  # needs a third block; block 2 is second's: all move to blocks 3..5
    assert first.blocks == [3, 4, 5] and pool.free_blocks == 6
    assert first.contiguous_slots(6) == slice(12, 18)
    assert torch.equal(pool.kv[..., 12:18, :], written.expand(*pool.kv.shape[:3], 6, 16))
    assert torch.equal(pool.kv[..., second.slots(0, 4), :], torch.zeros_like(pool.kv[..., :4, :]))


def test_without_room_to_move_a_session_takes_a_free_run_then_the_lowest_blocks():
    pool = tiny_pool(5)
    a, b, c, d = (pool.new_kv() for _ in range(4))
    for kv in (a, b, c, d):
        kv.reserve(4)
    a.reserve(8)  # no free run of 2 to move into: the one free block, 4
    assert a.blocks == [0, 4]
    a.length = 5
    assert a.contiguous_slots(4) == slice(0, 4)
    assert a.contiguous_slots(5) is None  # blocks 0 and 4 are not adjacent
    b.free()
    d.free()
    e = pool.new_kv()
    e.reserve(8)  # free: 1 and 3, no run of 2
    assert e.blocks == [1, 3]


def test_blocks_read_out_come_back_exactly_in_other_blocks():
    text = LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32
    )
    pool = KVPool(text, budget_bytes=1 << 16, device="cpu", dtype=torch.float32, block_tokens=4)
    pool.kv.copy_(torch.randn_like(pool.kv))
    first = pool.new_kv()
    first.reserve(10)  # 3 blocks
    expected = pool.kv[..., first.slots(0, 10), :].clone()
    copied = pool.read_blocks(first.blocks)
    assert copied.shape == pool.blocks_shape(3) and copied.numel() == 3 * pool.block_numel
    pool.kv.zero_()
    elsewhere = pool.allocate(3)
    assert elsewhere == sorted(elsewhere, reverse=True) and elsewhere[0] == pool.total_blocks - 1
    pool.write_blocks(elsewhere, copied)
    moved = pool.new_kv()
    moved.blocks, moved.length = elsewhere, 10
    assert torch.equal(pool.kv[..., moved.slots(0, 10), :], expected)
    with pytest.raises(ValueError):
        pool.write_blocks(elsewhere[:2], copied)
    pool.give_back(elsewhere)
    first.free()
    assert pool.free_blocks == pool.total_blocks
