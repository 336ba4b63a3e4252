"""The engine loop and what it runs: requests in, batched steps out.

- ``loop``: ``EngineLoop``, the one thread that owns the model; admits requests, ends the
  cancelled and the late, runs a step over the plan, hands each request its next id.
- ``scheduler``: which waiting requests start and how many ids each feeds a step; when a
  request short of memory waits and when it is refused (Busy).
- ``work``: the requests themselves (``OpenRequest``, ``TurnRequest``): what each takes on
  admission, feeds, and commits or undoes at its end.

Invariants: every future is resolved exactly once; turns of one session run one at a time in
arrival order; a request that fails, fails alone.
"""
