"""One turn's sampling state (``Chooser``); and the model's own forward on a DynamicCache,
the reference the step runner is tested against.

Each turn in a batch has its own ``Chooser`` (its parameters, its seed, its ids so far), so a
batched step gives each sequence exactly what it would get alone: greedy is the argmax of its
own row, and sampling draws noise from its own seed and count (llava.sampling).
"""

from __future__ import annotations

import secrets

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPooling

from llava.generation import GenerationParams


@torch.inference_mode()
def prefill(
    model, ids: list[int], cache: DynamicCache, image_features: torch.Tensor | None = None
) -> torch.Tensor:
    """Run ``ids`` through the model on top of ``cache``; return the last position's logits
    (tests/unit/test_runner.py checks llava.runner against this)."""
    image = {}
    if image_features is not None:
        pooled = BaseModelOutputWithPooling(pooler_output=[image_features])
        image = {"mm_encoder_outputs": {"image": pooled}}
    input_ids = torch.tensor([ids], device=model.device)
    out = model(
        input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **image
    )
    return out.logits[0, -1].float()


class Chooser:
    """One turn's sampling state: its parameters, its seed, the ids chosen so far. The ids
    themselves are chosen for the whole batch at once on the device (llava.sampling): banned
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
