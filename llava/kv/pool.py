"""All KV memory of a worker: one tensor allocated up front, handed out in fixed-size blocks.

A session's KV is a block table into that tensor plus a length, so the bytes a session holds
are exactly blocks * bytes_per_block, and the allocator's view never moves after start-up: a
turn that needs more than the free blocks gets ``KVPoolFull`` (the caller demotes or refuses)
instead of an out-of-memory error mid-forward (docs/engine/memory.md §KV pool).
"""

from __future__ import annotations

import torch

BLOCK_TOKENS = 16  # tokens per pool block unless a pool is given another size


class KVPoolFull(Exception):
    """Not enough free blocks for a reservation; nothing was taken."""


def kv_geometry(text_config) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a LLaMA-family text config."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return text_config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(text_config, dtype) -> int:
    """K and V of one token in every layer: a budget of N tokens is N times this."""
    layers, kv_heads, head_dim = kv_geometry(text_config)
    return layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    """The pool tensor is [layers, 2 (K, V), kv_heads, total_blocks * block_tokens, head_dim].

    Token slot ``block * block_tokens + offset`` of one layer's K (or V) is a [kv_heads, head_dim]
    row; heads come first so a session's K or V is already SDPA's [heads, tokens, dim] layout:
    a slice when its blocks are adjacent, one gather otherwise. Not thread-safe: the engine
    loop owns it.
    """

    def __init__(
        self, text_config, budget_bytes: int, device, dtype, block_tokens: int = BLOCK_TOKENS
    ):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        layers, kv_heads, head_dim = kv_geometry(text_config)
        self.block_tokens = block_tokens
        self.bytes_per_block = block_tokens * kv_bytes_per_token(text_config, dtype)
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
        self._free_map = bytearray(b"\x01") * self.total_blocks  # 1: block i is free
        self._free_count = self.total_blocks
        self._never_used = bytearray(b"\x01") * self.total_blocks  # 1: still as allocated

    @property
    def free_blocks(self) -> int:
        return self._free_count

    @property
    def allocated_bytes(self) -> int:
        """What the allocator holds for the pool: the one tensor's storage."""
        return self.kv.untyped_storage().nbytes()

    @property
    def block_numel(self) -> int:
        """Elements of one block (every layer's K and V of ``block_tokens`` tokens)."""
        return self.bytes_per_block // self.kv.element_size()

    def is_free(self, block: int) -> bool:
        return bool(self._free_map[block])

    def new_kv(self) -> SessionKV:
        return SessionKV(self)

    # -- whole blocks as data (the memory manager's API: docs/engine/memory.md §Memory policy) -----
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for data other than a sequence's KV (image features), highest free
        first so the low runs stay whole for KV; raises KVPoolFull taking none."""
        if n > self._free_count:
            raise KVPoolFull(f"need {n} blocks, {self._free_count} free of {self.total_blocks}")
        taken, at = [], len(self._free_map)
        while len(taken) < n:
            at = self._free_map.rfind(1, 0, at)
            taken.append(at)
        return self._mark_taken(taken)

    def give_back(self, blocks: list[int]) -> None:
        """Blocks from ``allocate`` (or a block table) are free again."""
        self._give_back(blocks)

    def blocks_shape(self, n: int) -> torch.Size:
        """Shape of what ``read_blocks`` returns for ``n`` blocks (opaque: the layout's)."""
        layers, pair, kv_heads, _slots, head_dim = self.kv.shape
        return torch.Size((layers, pair, kv_heads, n, self.block_tokens, head_dim))

    def read_blocks(self, blocks: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of ``blocks`` (every layer), into ``out`` if given (e.g. pinned host memory;
        the copy is then asynchronous on CUDA). ``write_blocks`` puts it back, in any blocks."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        with torch.inference_mode():
            gathered = self._by_block().index_select(3, index)
            if out is None:
                return gathered
            out.copy_(gathered, non_blocking=True)
            return out

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Copy ``data`` (shaped like ``read_blocks``' result) into ``blocks``."""
        if data.shape != self.blocks_shape(len(blocks)):
            raise ValueError(f"{tuple(data.shape)} is not {len(blocks)} blocks of this pool")
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        with torch.inference_mode():
            self._by_block().index_copy_(3, index, data.to(self.kv.device, non_blocking=True))

    def _by_block(self) -> torch.Tensor:
        """The pool tensor viewed with blocks as one dimension (a view: no copy)."""
        layers, pair, kv_heads, _slots, head_dim = self.kv.shape
        shape = (layers, pair, kv_heads, self.total_blocks, self.block_tokens, head_dim)
        return self.kv.view(shape)

    def blocks_needed(self, kv: SessionKV, extra_tokens: int) -> int:
        """Blocks ``kv`` must still take to hold ``extra_tokens`` more tokens."""
        wanted = -(-(kv.length + extra_tokens) // self.block_tokens)
        return max(0, wanted - len(kv.blocks))

    def _grow(self, kv: SessionKV, n: int) -> list[int]:
        """``kv``'s block table with ``n`` more blocks, kept adjacent where the free map allows
        (the runner reads adjacent KV in place, scattered KV by a gather on every step):

        1. the blocks right after its last one;
        2. else, if a free run fits all its blocks and the new ones, its KV moves there (one
           copy of its written tokens now instead of a gather at every step from here on);
        3. else the first free run of ``n``, else the lowest free blocks.
        """
        if n > self._free_count:
            raise KVPoolFull(f"need {n} KV blocks, {self._free_count} free of {self.total_blocks}")
        held = kv.blocks
        if n == 0:
            return held
        free_map = self._free_map
        if held and free_map[held[-1] + 1 : held[-1] + 1 + n] == b"\x01" * n:
            return held + self._mark_taken(range(held[-1] + 1, held[-1] + 1 + n))
        start = free_map.find(b"\x01" * (len(held) + n)) if held else -1
        if start >= 0:
            moved = self._mark_taken(range(start, start + len(held) + n))
            self._copy(kv, moved)
            self._give_back(held)
            return moved
        start = free_map.find(b"\x01" * n)
        if start >= 0:
            return held + self._mark_taken(range(start, start + n))
        lowest, at = [], -1
        while len(lowest) < n:
            at = free_map.find(1, at + 1)
            lowest.append(at)
        return held + self._mark_taken(lowest)

    def _mark_taken(self, blocks) -> list[int]:
        for block in blocks:
            self._free_map[block] = 0
        self._free_count -= len(blocks)
        self._clear_never_used(blocks)
        return list(blocks)

    def _clear_never_used(self, blocks) -> None:
        """Zero blocks handed out for the first time. Attention reads a whole block and masks
        the slots past a sequence's position (llava.exec.attention), and a masked weight of 0 times
        an uninitialised NaN is NaN: every slot must hold a finite value, once."""
        fresh = [block for block in blocks if self._never_used[block]]
        bt = self.block_tokens
        with torch.inference_mode():
            for block in fresh:
                self._never_used[block] = 0
                self.kv[:, :, :, block * bt : (block + 1) * bt].zero_()

    def _copy(self, kv: SessionKV, blocks: list[int]) -> None:
        """Copy ``kv``'s written tokens, every layer, into the same positions of ``blocks``."""
        if kv.length:
            bt = self.block_tokens
            target = blocks[0] * bt  # blocks is one adjacent run
            slots = kv.slots(0, kv.length)
            with torch.inference_mode():
                self.kv[:, :, :, target : target + kv.length] = self.kv.index_select(3, slots)

    def _give_back(self, blocks: list[int]) -> None:
        for block in blocks:
            self._free_map[block] = 1
        self._free_count += len(blocks)


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
        self.blocks = self.pool._grow(self, self.pool.blocks_needed(self, extra_tokens))

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

    def contiguous_slots(self, stop: int) -> slice | None:
        """Pool slots of positions ``0..stop-1`` as one slice, if their blocks are adjacent."""
        bt = self.pool.block_tokens
        used = -(-stop // bt)
        first = self.blocks[0] if self.blocks else 0
        if self.blocks[:used] != list(range(first, first + used)):
            return None
        return slice(first * bt, first * bt + stop)

    def slots(self, start: int, stop: int) -> torch.Tensor:
        """Pool token slots of positions ``start..stop-1``, all within held blocks."""
        if not 0 <= start <= stop <= self.capacity:
            raise ValueError(f"positions {start}..{stop} outside the {self.capacity} reserved")
        bt = self.pool.block_tokens
        positions = torch.arange(start, stop, device=self.pool.kv.device)
        table = torch.tensor(self.blocks, dtype=torch.long, device=self.pool.kv.device)
        return table[positions // bt] * bt + positions % bt
