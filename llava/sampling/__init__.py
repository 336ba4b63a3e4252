"""From a step's logits to each answer's ids and text.

- ``params``: ``GenerationParams``, a turn's decoding settings, parsed and bounded once.
- ``chooser``: ``Chooser``, one turn's sampling state (seed, ids so far, when it ends).
- ``sampler``: ``Sampler``, the next id of every row chosen on the device in one pass.
- ``logits_mask``: ids an answer may never contain.
- ``detokenizer``: ids to text incrementally, for streaming.

Invariants: a row's draw depends only on its own seed and count, never on the batch; greedy is
the masked argmax; banned ids are never chosen.
"""
