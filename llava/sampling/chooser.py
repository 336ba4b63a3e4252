"""One turn's sampling state (``Chooser``).

Each turn in a batch has its own ``Chooser`` (its parameters, its seed, its ids so far), so a
batched step gives each sequence exactly what it would get alone: greedy is the argmax of its
own row, and sampling draws noise from its own seed and count (llava.sampling.sampler).
"""

from __future__ import annotations

import secrets

from llava.sampling.params import GenerationParams


class Chooser:
    """One turn's sampling state: its parameters, its seed, the ids chosen so far. The ids
    themselves are chosen for the whole batch at once on the device (llava.sampling.sampler): banned
    ids never, end ids not before ``min_new_tokens``."""

    def __init__(self, params: GenerationParams, eos_token_ids: frozenset[int]):
        self.params = params
        self.eos_token_ids = eos_token_ids
        # An unseeded sampled turn still needs a seed for its noise: a fresh random one.
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generated: list[int] = []

    @property
    def ended(self) -> bool:
        return bool(self.generated) and self.generated[-1] in self.eos_token_ids

    @property
    def exhausted(self) -> bool:
        return len(self.generated) >= self.params.max_new_tokens

    def record(self, token: int) -> None:
        self.generated.append(token)
