"""All KV memory of a worker: one tensor allocated up front, handed out in fixed-size blocks.

A session's KV is a block table into that tensor plus a length, so the bytes a session holds
are exactly blocks * bytes_per_block, and the allocator's view never moves after start-up: a
turn that needs more than the free blocks gets ``KVPoolFull`` (the caller demotes or refuses)
instead of an out-of-memory error mid-forward (docs/design-kvrunner.md §KV pool).
"""

from __future__ import annotations

import torch


class KVPoolFull(Exception):
    """Not enough free blocks for a reservation; nothing was taken."""


def kv_geometry(text_config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a LLaMA-family text config."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return text_config.num_hidden_layers, kv_heads, head_dim


class KVPool:
    """The pool tensor is [layers, 2 (K, V), kv_heads, total_blocks * block_tokens, head_dim].

    Token slot ``block * block_tokens + offset`` of one layer's K (or V) is a [kv_heads, head_dim]
    row; heads come first so gathering a session's slots yields SDPA's [heads, tokens, dim]
    layout with a single copy.
    """

    def __init__(self, text_config, budget_bytes: int, device, dtype, block_tokens: int = 16):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        layers, kv_heads, head_dim = kv_geometry(text_config)
        element = torch.empty((), dtype=dtype).element_size()
        self.block_tokens = block_tokens
        self.bytes_per_block = layers * 2 * kv_heads * block_tokens * head_dim * element
        self.total_blocks = budget_bytes // self.bytes_per_block
        if self.total_blocks < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes is smaller than one block "
                f"({self.bytes_per_block} bytes: {block_tokens} tokens x {layers} layers)"
            )
        self.kv = torch.empty(
            (layers, 2, kv_heads, self.total_blocks * block_tokens, head_dim),
            dtype=dtype,
            device=device,
        )
        self._free: list[int] = list(range(self.total_blocks - 1, -1, -1))  # pop() gives 0 first

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def allocated_bytes(self) -> int:
        """What the allocator holds for the pool: the one tensor's storage."""
        return self.kv.untyped_storage().nbytes()

    def new_kv(self) -> SessionKV:
        return SessionKV(self)

    def blocks_needed(self, kv: SessionKV, extra_tokens: int) -> int:
        """Blocks ``kv`` must still take to hold ``extra_tokens`` more tokens."""
        wanted = -(-(kv.length + extra_tokens) // self.block_tokens)
        return max(0, wanted - len(kv.blocks))

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVPoolFull(f"need {n} KV blocks, {len(self._free)} free of {self.total_blocks}")
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken[::-1]

    def _give_back(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class SessionKV:
    """One sequence's KV: a block table into the pool and how many tokens are written."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0

    @property
    def capacity(self) -> int:
        """Tokens the held blocks can store."""
        return len(self.blocks) * self.pool.block_tokens

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.bytes_per_block

    def reserve(self, extra_tokens: int) -> None:
        """Hold blocks for ``length + extra_tokens`` tokens; raises KVPoolFull taking none."""
        if extra_tokens < 0:
            raise ValueError(f"extra_tokens must be >= 0, got {extra_tokens}")
        self.blocks.extend(self.pool._take(self.pool.blocks_needed(self, extra_tokens)))

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens; whole blocks past them go back to the pool."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a KV of {self.length} tokens to {length}")
        self.length = length
        keep = -(-length // self.pool.block_tokens)
        self.pool._give_back(self.blocks[keep:])
        del self.blocks[keep:]

    def free(self) -> None:
        """Give every block back (idempotent)."""
        self.pool._give_back(self.blocks)
        self.blocks = []
        self.length = 0

    def slots(self, start: int, stop: int) -> torch.Tensor:
        """Pool token slots of positions ``start..stop-1``, all within held blocks."""
        if not 0 <= start <= stop <= self.capacity:
            raise ValueError(f"positions {start}..{stop} outside the {self.capacity} reserved")
        bt = self.pool.block_tokens
        positions = torch.arange(start, stop, device=self.pool.kv.device)
        table = torch.tensor(self.blocks, dtype=torch.long, device=self.pool.kv.device)
        return table[positions // bt] * bt + positions % bt
