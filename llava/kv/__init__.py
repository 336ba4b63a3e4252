"""Every byte a session holds, and how many it may hold.

- ``pool``: the device's KV memory, one tensor allocated at start and handed out in blocks.
- ``prefix``: content keys of full blocks and images, and the index of published blocks, so
  sessions share what they have in common.
- ``memory``: ``MemoryManager``, the one owner of a session's bytes on every tier, one verb
  per moment of a turn, and the ladder that moves idle sessions down under pressure; what one
  session holds is a ``holding``; image features (``features``), the host tier (``host_tier``
  with ``host_copies``) and the audit (``integrity``) are its parts.
- ``budget``: the device and host byte budgets from the settings and the machine.

Invariants: the pool is the device budget (KV and features together never exceed it; nothing
allocates past it mid-forward); a session in a turn is never moved; the books balance
(``MemoryManager.check_integrity``). One lock, taken after the session store's, never before.
"""
