"""STAND-IN for kvrunner's KV pool (docs/design-sched.md §Stand-in): same interface, block
accounting only; each SessionKV keeps its tensors in a DynamicCache. Replaced on merge."""

from __future__ import annotations

import torch
from transformers import DynamicCache


class KVPoolFull(Exception):
    pass


class KVPool:
    def __init__(self, text_config, budget_bytes: int, device, dtype, block_tokens: int = 16):
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        per_token = (
            text_config.num_hidden_layers
            * 2
            * text_config.num_key_value_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )
        self.block_tokens = block_tokens
        self.bytes_per_block = per_token * block_tokens
        self.total_blocks = max(0, budget_bytes // self.bytes_per_block)
        self.allocated_bytes = self.total_blocks * self.bytes_per_block
        self._free = list(range(self.total_blocks))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def new_kv(self) -> SessionKV:
        return SessionKV(self)

    def blocks_needed(self, kv: SessionKV, extra_tokens: int) -> int:
        wanted = -(-(kv.length + extra_tokens) // self.block_tokens)
        return max(0, wanted - len(kv.blocks))


class SessionKV:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0
        self.cache = DynamicCache()

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.bytes_per_block

    def reserve(self, extra_tokens: int) -> None:
        needed = self.pool.blocks_needed(self, extra_tokens)
        if needed > self.pool.free_blocks:
            raise KVPoolFull(f"{needed} blocks needed, {self.pool.free_blocks} free")
        for _ in range(needed):
            self.blocks.append(self.pool._free.pop())

    def crop(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length)
            self.length = length
        keep = -(-length // self.pool.block_tokens)
        self.pool._free.extend(self.blocks[keep:])
        del self.blocks[keep:]

    def free(self) -> None:
        self.pool._free.extend(self.blocks)
        self.blocks = []
        self.length = 0
        self.cache = DynamicCache()
