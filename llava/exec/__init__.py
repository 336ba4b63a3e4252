"""One forward step over many sequences packed together, on KV held in the pool.

- ``runner``: ``Runner``, the packed step through the checkpoint's own layers.
- ``step_meta``: every index tensor a step needs, built once per step.
- ``attention``: paged attention of a step's decode rows over the pool (flex or SDPA).
- ``graphs``: decode steps at bucketed static shapes, replayed as CUDA graphs.

Invariants: a batched step gives each sequence exactly the logits it would get alone (greedy
output equals a full recompute); a failed flex compile or graph capture degrades to the eager
path (logged once, counted), it never takes the worker down.
"""
