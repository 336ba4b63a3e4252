"""Choosing one sequence's next id from its logits: the per-turn sampling state; and the
model's own forward on a DynamicCache, the reference the step runner is tested against.

Each turn in a batch has its own ``Chooser`` (its parameters, its seeded generator, its
count of ids so far), so a batched step gives each sequence exactly what it would get alone:
greedy is an argmax of its own row, sampling draws from its own generator.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPooling

from llava.generation import GenerationParams


@torch.inference_mode()
def prefill(
    model, ids: list[int], cache: DynamicCache, image_features: torch.Tensor | None = None
) -> torch.Tensor:
    """Run ``ids`` through the model on top of ``cache``; return the last position's logits
    (tests/test_runner.py checks llava.runner against this)."""
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
    """Banned ids are never chosen (llava.logits_mask); end ids not before ``min_new_tokens``."""

    def __init__(
        self,
        params: GenerationParams,
        eos_token_ids: frozenset[int],
        banned_ids: list[int],
        device: torch.device,
    ):
        self.params = params
        self.eos_token_ids = eos_token_ids
        self._eos = torch.tensor(sorted(eos_token_ids), device=device)
        self._banned = torch.tensor(banned_ids, dtype=torch.long, device=device)
        self._generator = None
        if not params.greedy and params.seed is not None:
            self._generator = torch.Generator(device=device).manual_seed(params.seed)
        self.generated: list[int] = []

    @property
    def ended(self) -> bool:
        return bool(self.generated) and self.generated[-1] in self.eos_token_ids

    @property
    def exhausted(self) -> bool:
        return len(self.generated) >= self.params.max_new_tokens

    def choose(self, logits: torch.Tensor) -> int:
        """The next id from this sequence's logits row (float32, [vocab])."""
        logits = logits.index_fill(0, self._banned, float("-inf"))
        if len(self.generated) < self.params.min_new_tokens:
            logits = logits.index_fill(0, self._eos, float("-inf"))
        token = _pick(logits, self.params, self._generator)
        self.generated.append(token)
        return token


def _pick(logits: torch.Tensor, params: GenerationParams, generator) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
