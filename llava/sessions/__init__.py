"""Sessions: what a conversation is, who holds it, when it ends and what outlives the worker.

- ``session``: one conversation (messages, token history, turn lock) and its memory handle.
- ``store``: ``SessionStore``, the one map from session id to session: idle TTL, close,
  remembered ids (why an id is gone), one turn at a time per session.
- ``reaper``: frees expired sessions on a timer.
- ``persist``: the persistent tier (history and features on disk) a restarted worker adopts.

Invariants: a session id names at most one live session; a session in a turn is pinned (never
expired, moved or evicted under it); the store holds no bytes itself (llava.kv owns them) and
learns of evictions from the memory manager, never the other way round.
"""
