"""Every byte a session holds, and how many it may hold.

- ``pool``: the device's KV memory, one tensor allocated at start and handed out in blocks.
- ``memory``: ``MemoryManager``, the one owner of a session's bytes on every tier (device KV,
  host KV, image features) and the ladder that moves idle sessions down under pressure.
- ``budget``: the device and host byte budgets from the settings and the machine.

Invariants: the pool is the device budget (KV and features together never exceed it; nothing
allocates past it mid-forward); a session in a turn is never moved; the books balance
(``MemoryManager.check_integrity``). One lock, taken after the session store's, never before.
"""
