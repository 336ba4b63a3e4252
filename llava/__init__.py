"""The stateful-llava engine: sessions on one image, turns that prefill only their new tokens.

- ``engine``: ``Engine``, the one object a transport uses (open, ask, close); ``shards``: one
  engine per device behind the same surface; ``config``: ``EngineConfig``, every setting;
  ``errors``: the typed errors a caller can see, each with a stable code.
- ``sessions/``: conversations, the store that maps ids to them, the lease a turn takes its
  session by, expiry, the persistent tier.
- ``kv/``: every byte a session holds (the device pool, the host tier) and the budgets.
- ``sched/``: the engine loop, the scheduler, and the requests they run.
- ``exec/``: one packed forward step over the pool (attention, step metadata, CUDA graphs).
- ``sampling/``: from a step's logits to each answer's ids and text.
- ``model/``: the checkpoint (whether it is served), its chat template, its images' features.
- ``intake/``: an image source (URL, s3://, bytes) to an RGB image, safely by default.

Importable and testable without TorchServe (``handlers/`` adapts it to the wire). Imports run
one way (tests/unit/test_tree_map.py): ``shards`` → ``engine`` → ``sched`` → ``sessions``,
``model`` → ``exec`` → ``kv``, ``sampling`` → ``config`` → ``intake`` → ``errors``,
``counters``, ``files`` (``model`` asks ``exec``'s runner which text models it computes
exactly). What happens in one ask: docs/engine/life-of-a-turn.md.
"""
