"""How many sessions an instance holds, by arithmetic: ``python -m capacity`` (``make capacity``).

- ``sizing``: the per-session bytes at each memory tier from the engine's own accounting, and
  the fit on an instance (the AWS instance table included).

An operator's tool beside the engine, not in it: it reads a checkpoint's config and tokenizer
(no weights) and calls into ``llava`` for every number.
"""
