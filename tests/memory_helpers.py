"""A small real memory manager and sessions on it, for store and memory tests (no model:
KV "written by a step" is the pool's blocks filled with a number and a length set)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from llava.kv.budget import MemoryBudget
from llava.kv.holding import NewImage
from llava.kv.memory import MemoryManager
from llava.kv.pool import KVPool
from llava.sessions.session import Session
from llava.sessions.store import SessionStore, new_session_id

TEXT_CONFIG = LlamaConfig(
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, hidden_size=32, head_dim=8
)
BLOCK_TOKENS = 2
FEATURE_HIDDEN = 8


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def new_memory(blocks: int = 10_000, host_blocks: int = 0) -> MemoryManager:
    probe = KVPool(TEXT_CONFIG, 1 << 20, "cpu", torch.float32, block_tokens=BLOCK_TOKENS)
    block = probe.bytes_per_block
    pool = KVPool(TEXT_CONFIG, blocks * block, "cpu", torch.float32, block_tokens=BLOCK_TOKENS)
    return MemoryManager(pool, MemoryBudget(blocks * block, host_blocks * block))


def new_store(blocks: int = 10_000, host_blocks: int = 0, **options) -> SessionStore:
    """A store on a new memory manager, on a FakeClock (``store._clock``'s ``now``)."""
    options.setdefault("clock", FakeClock())
    return SessionStore(new_memory(blocks, host_blocks), **options)


def write(memory: MemoryManager, session: Session, tokens: int, value: float) -> None:
    """As a step would: fill the next ``tokens`` reserved positions with ``value``."""
    kv = session.kv
    slots = kv.slots(kv.length, kv.length + tokens)
    memory.pool.kv[..., slots, :] = value
    kv.length += tokens


def make_session(
    memory: MemoryManager, tokens=100, feature_rows=10, session_id=None, value: float = 1.0
) -> Session:
    """An opened session (not yet in a store: its holding is pinned until added)."""
    holding = memory.hold()
    images = []
    if feature_rows:
        images = [NewImage(None, torch.full((feature_rows, FEATURE_HIDDEN), value))]
    assert memory.start(holding, tokens, images=images) is None
    session = Session(session_id or new_session_id(), list(range(tokens)), holding)
    write(memory, session, tokens, value)
    return session


def one_pixel_changed(image):
    """A copy of ``image`` with its top-left pixel's red channel moved by one."""
    changed = image.convert("RGB").copy()
    red, green, blue = changed.getpixel((0, 0))
    changed.putpixel((0, 0), ((red + 1) % 256, green, blue))
    return changed
