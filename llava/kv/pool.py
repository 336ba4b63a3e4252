"""All KV memory of a worker: one tensor allocated up front, handed out in fixed-size blocks.

A session's KV is a block table into that tensor plus a length, so the bytes a session holds
are exactly blocks * bytes_per_block, and the allocator's view never moves after start-up: a
reservation of more than the free blocks raises ``KVPoolFull``, taking none, instead of an
out-of-memory error mid-forward. Nothing catches it: the memory manager (llava.kv.memory) makes
room or refuses before it reserves, so a served turn never meets it (docs/engine/memory.md §KV
pool).

Blocks are reference-counted: a block of a shared prefix (llava.kv.prefix) sits in the block
tables of every session that reuses it and is free only when the last one lets go; even then
it stays indexed, and counted as free room, until an allocation needs it.
"""

from __future__ import annotations

from array import array

import torch

from llava.kv.prefix import PrefixIndex

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
        self._free_map = bytearray(b"\x01") * self.total_blocks  # 1: empty (no one, no key)
        self._free_count = self.total_blocks  # empty blocks
        self._refs = array("l", [0]) * self.total_blocks  # block tables that list block i
        self.aside: list[int] = []  # blocks set aside for the runner (set_aside)
        self.index = PrefixIndex()  # published blocks; unreferenced ones are reclaimable
        self._never_used = bytearray(b"\x01") * self.total_blocks  # 1: still as allocated

    @property
    def free_blocks(self) -> int:
        """Room for new blocks: empty ones and unreferenced published ones (reclaimed on need)."""
        return self._free_count + self.index.unused

    def refs(self, block: int) -> int:
        return self._refs[block]

    @property
    def allocated_bytes(self) -> int:
        """What the allocator holds for the pool: the one tensor's storage."""
        return self.kv.untyped_storage().nbytes()

    @property
    def block_numel(self) -> int:
        """Elements of one block (every layer's K and V of ``block_tokens`` tokens)."""
        return self.bytes_per_block // self.kv.element_size()

    def is_free(self, block: int) -> bool:
        """Empty: referenced by no one and holding no published prefix."""
        return bool(self._free_map[block])

    def new_kv(self) -> SessionKV:
        return SessionKV(self)

    # -- whole blocks as data (the memory manager's API: docs/engine/memory.md §Memory policy) -----
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for data other than a sequence's KV (image features), highest free
        first so the low runs stay whole for KV; raises KVPoolFull taking none."""
        self._make_empty(n)
        taken, at = [], len(self._free_map)
        while len(taken) < n:
            at = self._free_map.rfind(1, 0, at)
            taken.append(at)
        return self._mark_taken(taken)

    def set_aside(self) -> int:
        """One block no session holds, for the runner's own writes (the padded rows of a
        captured decode step); counted like a held block, and listed in ``aside`` so the
        books know who holds it."""
        block = self.allocate(1)[0]
        self.aside.append(block)
        return block

    def give_back(self, blocks: list[int]) -> None:
        """One reference fewer to each of ``blocks`` (from ``allocate``, ``share`` or a block
        table); a block no one references is free again."""
        self._give_back(blocks)

    # -- shared prefixes (llava.kv.prefix) -------------------------------------------------
    def match(self, keys: list[bytes]) -> list[int]:
        """The published blocks of the longest run of ``keys`` from the first (nothing taken)."""
        return self.index.find(keys)

    def share(self, blocks: list[int]) -> None:
        """One reference more to each of ``blocks`` (published: referenced or reclaimable)."""
        for block in blocks:
            if self._refs[block] == 0:
                if not self.index.is_unused(block):
                    raise ValueError(f"block {block} is neither referenced nor published")
                self.index.used(block)
            self._refs[block] += 1

    def publish(self, block: int, key: bytes) -> None:
        """``block`` (referenced, fully written) holds the prefix ``key`` from now on, and is
        never written again; a key another block holds already leaves this one private."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not referenced")
        self.index.publish(block, key)

    def is_published(self, block: int) -> bool:
        return self.index.key_of(block) is not None

    def blocks_shape(self, n: int) -> torch.Size:
        """Shape of what ``read_blocks`` returns for ``n`` blocks (opaque: the layout's)."""
        layers, pair, kv_heads, _slots, head_dim = self.kv.shape
        return torch.Size((layers, pair, kv_heads, n, self.block_tokens, head_dim))

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A copy of ``blocks`` (every layer). ``write_blocks`` puts it back, in any blocks."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        with torch.inference_mode():
            return self._by_block().index_select(3, index)

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Copy ``data`` (shaped like ``read_blocks``' result) into ``blocks``."""
        if data.shape != self.blocks_shape(len(blocks)):
            raise ValueError(f"{tuple(data.shape)} is not {len(blocks)} blocks of this pool")
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        with torch.inference_mode():
            self._by_block().index_copy_(3, index, data.to(self.kv.device, non_blocking=True))

    def layer_blocks_shape(self, n: int) -> torch.Size:
        """Shape of ``n`` blocks of one layer as ``read_layer_blocks`` writes them: block by
        block, so any run of them is one contiguous piece of memory (the host tier's layout)."""
        _layers, pair, kv_heads, _slots, head_dim = self.kv.shape
        return torch.Size((n, pair, kv_heads, self.block_tokens, head_dim))

    def read_layer_blocks(self, layer: int, index: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks ``index`` (a long tensor on the pool's device) of one layer into ``out``
        (on the pool's device, shaped by ``layer_blocks_shape``)."""
        with torch.inference_mode():
            torch.index_select(self._layer_by_block(layer), 0, index, out=out)

    def write_layer_blocks(self, layer: int, index: torch.Tensor, data: torch.Tensor) -> None:
        """Copy ``data`` (as ``read_layer_blocks`` writes it) into blocks ``index`` of one layer."""
        with torch.inference_mode():
            self._layer_by_block(layer).index_copy_(0, index, data)

    def _layer_by_block(self, layer: int) -> torch.Tensor:
        """One layer viewed as [blocks, 2 (K, V), kv_heads, block_tokens, head_dim] (a view)."""
        return self._by_block()[layer].permute(2, 0, 1, 3, 4)

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
        2. else, if a free run fits all its blocks and the new ones and none of them is shared,
           its KV moves there (one copy of its written tokens now instead of a gather at every
           step from here on);
        3. else the first free run of ``n``, else the lowest free blocks.
        """
        held = kv.blocks
        if n == 0:
            return held
        self._make_empty(n)
        free_map = self._free_map
        if held and free_map[held[-1] + 1 : held[-1] + 1 + n] == b"\x01" * n:
            return held + self._mark_taken(range(held[-1] + 1, held[-1] + 1 + n))
        private = not any(self.is_published(block) for block in held)
        start = free_map.find(b"\x01" * (len(held) + n)) if held and private else -1
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

    def _make_empty(self, n: int) -> None:
        """At least ``n`` empty blocks, reclaiming the least recently used unreferenced
        published ones as needed; raises KVPoolFull (reclaiming none) if there is no room."""
        if n > self.free_blocks:
            raise KVPoolFull(f"need {n} blocks, {self.free_blocks} free of {self.total_blocks}")
        while self._free_count < n:
            block = self.index.reclaim()
            self._free_map[block] = 1
            self._free_count += 1

    def _mark_taken(self, blocks) -> list[int]:
        for block in blocks:
            self._free_map[block] = 0
            self._refs[block] = 1
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
            if self._refs[block] < 1:
                raise ValueError(f"block {block} given back more often than it was taken")
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if self.is_published(block):
                self.index.release(block)  # reclaimable, still found by its key
            else:
                self._free_map[block] = 1
                self._free_count += 1

    def check(self) -> None:
        """Raise ValueError unless every block is exactly one of: empty, referenced, or
        published and unreferenced (reclaimable); the counts agree."""
        empty = 0
        for block in range(self.total_blocks):
            refs, published = self._refs[block], self.is_published(block)
            states = (self._free_map[block] == 1, refs > 0, self.index.is_unused(block))
            if sum(states) != 1:
                raise ValueError(f"block {block}: empty, referenced, reclaimable = {states}")
            if states[0] and published or states[2] and not published:
                raise ValueError(f"block {block} is indexed wrongly")
            empty += states[0]
        if empty != self._free_count:
            raise ValueError("the empty count is not the free map")


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

    def attach(self, blocks: list[int]) -> None:
        """Start an empty KV on published ``blocks`` (a shared prefix): referenced, not copied."""
        if self.blocks:
            raise ValueError("a shared prefix starts an empty KV")
        self.pool.share(blocks)
        self.blocks = list(blocks)
        self.length = len(blocks) * self.pool.block_tokens

    def crop(self, length: int) -> int:
        """Keep the first ``length`` tokens; whole blocks past them go back to the pool. Where
        ``length`` ends inside a published block, which is never written again, that block
        goes too: returns the length kept (``length`` rounded down to its block then)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a KV of {self.length} tokens to {length}")
        bt = self.pool.block_tokens
        keep = -(-length // bt)
        if length % bt and self.pool.is_published(self.blocks[keep - 1]):
            keep -= 1
            length = keep * bt
        self.length = length
        self.pool._give_back(self.blocks[keep:])
        del self.blocks[keep:]
        return length

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
