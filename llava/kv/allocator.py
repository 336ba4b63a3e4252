"""The CUDA caching allocator's settings, applied before CUDA starts (llava.model.loading).

``expandable_segments:True``: the allocator grows one mapped segment per stream instead of
reserving a new fixed segment for each size it cannot fit, so what it reserves beside the
pool (activations, graphs, the host tier's staging chunks) stays close to what is in use
rather than fragmenting (docs/engine/memory.md §Host copies). Torch reads the setting once,
when its allocator starts: setting it later changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# torch's variable, then the older name it still reads when the first is unset
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> None:
    """Ask for expandable segments, unless an operator configured the allocator: their
    setting (either variable, whatever it says) stands as it is."""
    if not any(environ.get(name) for name in ALLOC_CONF_VARIABLES):
        environ[ALLOC_CONF_VARIABLES[0]] = EXPANDABLE_SEGMENTS
