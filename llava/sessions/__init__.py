"""Sessions: what a conversation is, who holds it, when it ends and what outlives the worker.

- ``session``: one conversation (messages, token history, turn lock) and its memory handle.
- ``store``: ``SessionStore``, the one map from session id to session: idle TTL, close,
  remembered ids (why an id is gone), one turn at a time per session.
- ``lease``: a session taken for one turn, in one call, and given back in one (commit or
  abort): the only way a request reaches a session's state.
- ``tier``: the persistent tier's one owner (writing, reading back, adopting); its files are
  ``persist``'s.
- ``reaper``: frees expired sessions on a timer.

Invariants: a session id names at most one live session; a session in a turn is pinned (never
expired, moved or evicted under it); the store holds no bytes itself (llava.kv owns them) and
learns of evictions from the memory manager, never the other way round.
"""
