"""Host-tier copies in bounded pieces (llava.kv.host_copies): exact round trips through two
staging chunks, a piece at most ``chunk_blocks`` blocks of one layer, shared prefix blocks
skipped on the way back; on CUDA, host copies pinned at their own size and no device
temporary beyond the staging chunks (docs/engine/memory.md §Host copies)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from llava.kv.holding import Tier
from llava.kv.host_copies import PAGE, HostCopies, Piece, pieces
from llava.kv.pool import KVPool
from tests.memory_helpers import new_memory
from tests.unit.test_prefix_memory import family, open_on, values

THREE_LAYERS = LlamaConfig(
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, head_dim=8
)


def random_pool(blocks: int = 24) -> KVPool:
    probe = KVPool(THREE_LAYERS, 1 << 20, "cpu", torch.float32, block_tokens=2)
    pool = KVPool(THREE_LAYERS, blocks * probe.bytes_per_block, "cpu", torch.float32, 2)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    return pool


def copies_of(pool: KVPool, chunk_blocks: int) -> HostCopies:
    layer_block_bytes = pool.bytes_per_block // pool.kv.shape[0]
    copies = HostCopies(pool, staging_bytes=chunk_blocks * layer_block_bytes)
    assert copies.chunk_blocks == chunk_blocks
    return copies


def test_pieces_take_every_block_of_every_layer_once_a_chunk_at_most_at_a_time():
    got = list(pieces(layers=3, count=7, chunk_blocks=3))
    assert got[:3] == [Piece(0, 0, 3), Piece(0, 3, 6), Piece(0, 6, 7)]
    covered = [(p.layer, block) for p in got for block in range(p.start, p.stop)]
    assert covered == [(layer, block) for layer in range(3) for block in range(7)]
    assert list(pieces(layers=2, count=0, chunk_blocks=3)) == []


@pytest.mark.parametrize("chunk_blocks", [1, 2, 7, 24])
def test_a_host_copy_holds_each_layers_blocks_in_order_and_comes_back_exactly(chunk_blocks):
    pool = random_pool()
    copies = copies_of(pool, chunk_blocks)
    blocks = [5, 0, 9, 3, 11, 2, 7]  # odd, scattered, out of order
    original = pool.read_blocks(blocks)
    host = copies.to_host(blocks)
    assert host.shape == (3, 7, *pool.layer_blocks_shape(7)[1:]) and host.is_contiguous()
    assert torch.equal(host, original.permute(0, 3, 1, 2, 4, 5))  # block by block per layer
    elsewhere = [23, 13, 14, 15, 20, 1, 18]
    copies.to_device(host, elsewhere)
    assert torch.equal(pool.read_blocks(elsewhere), original)


def test_a_restore_skips_the_shared_blocks_and_writes_only_its_own():
    pool = random_pool()
    copies = copies_of(pool, chunk_blocks=2)
    blocks = [4, 5, 6, 10, 11]
    original = pool.read_blocks(blocks)
    host = copies.to_host(blocks)
    untouched = pool.kv.clone()
    own = [20, 17]  # the first three blocks are still on the device: not copied
    copies.to_device(host, own, skip=3)
    assert torch.equal(pool.read_blocks(own), original[:, :, :, 3:])
    bt = pool.block_tokens
    elsewhere = torch.ones(pool.kv.shape[3], dtype=torch.bool)
    for block in own:
        elsewhere[block * bt : (block + 1) * bt] = False
    assert torch.equal(pool.kv[..., elsewhere, :], untouched[..., elsewhere, :])
    copies.to_device(host, [], skip=5)  # all of it shared: nothing to copy
    with pytest.raises(ValueError):
        copies.to_device(host, own, skip=2)


def test_a_piece_is_bounded_by_the_staging_bytes_and_the_pool():
    pool = random_pool(blocks=24)
    layer_block_bytes = pool.bytes_per_block // 3
    assert HostCopies(pool, staging_bytes=5 * layer_block_bytes + 1).chunk_blocks == 5
    assert HostCopies(pool, staging_bytes=1).chunk_blocks == 1
    assert HostCopies(pool).chunk_blocks == pool.total_blocks  # never more than the pool
    assert HostCopies(pool).staging_bytes == 0  # on CPU pieces go straight into the host copy


def test_a_session_on_a_shared_prefix_comes_back_from_the_host_with_only_its_own_blocks_copied():
    memory = new_memory(blocks=20, host_blocks=10)
    memory._host.copies = copies_of(memory.pool, chunk_blocks=1)  # several pieces a layer
    _, keys = family(0, 3)
    owner = open_on(memory, keys, own=3, prefix_value=4.0, value=1.0)  # 3 shared + 2 own
    memory.unpin(owner)
    sharer = open_on(memory, keys, own=1, prefix_value=-1.0, value=2.0)
    memory.unpin(sharer)
    assert memory.move_down(owner) is Tier.HOST
    assert owner.host.data.shape[1] == 5  # the host copy is the session's own, shared included
    copied, to_device = [], memory._host.copies.to_device

    def counted(host, blocks, skip):
        copied.append((len(blocks), skip))
        to_device(host, blocks, skip)

    memory._host.copies.to_device = counted
    memory.pin(owner)
    assert memory.restore(owner) is None
    assert copied == [(2, 3)]
    assert owner.kv.blocks[:3] == sharer.kv.blocks[:3]
    assert values(memory, owner).tolist() == [4.0] * 6 + [1.0] * 3
    memory.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_host_copies_pin_their_own_size_and_restores_add_only_the_staging_chunks():
    """1,280 blocks of 256 KiB (320 MiB, 1.25 x 2^28): pinned as 320 MiB, not 512; moved down
    and back with no device temporary beyond the two staging chunks."""
    config = LlamaConfig(
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        hidden_size=1024,
        head_dim=128,
    )
    pool = KVPool(config, 1 << 30, "cuda", torch.bfloat16, block_tokens=16)
    pool.kv.normal_()
    copies = HostCopies(pool)
    blocks = list(range(1, 2 * 1280, 2))
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    host_pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    host = copies.to_host(blocks)
    elsewhere = list(range(2 * 1280, 3 * 1280))
    copies.to_device(host, elsewhere)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - reserved
    assert grown <= copies.staging_bytes + (4 << 20), grown
    nbytes = len(blocks) * pool.bytes_per_block
    assert host.is_pinned() and host.untyped_storage().nbytes() <= nbytes + 2 * PAGE
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - host_pinned < 1 << 20
    assert torch.equal(pool.read_blocks(elsewhere), pool.read_blocks(blocks))
    copies.release(host)  # its copies have ended: unpinned at once
    assert not host.is_pinned()
