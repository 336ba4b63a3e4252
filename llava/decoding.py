"""Prefill and decode on top of a KV cache: the only place that runs the language model.

A turn passes the conversation's token ids and how many of them the cache already holds;
only the uncached tail is prefilled. Image features, when given, are scattered into the
image-token positions of that tail (so the vision tower never runs here).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPooling

from llava.generation import GenerationParams


@dataclass(frozen=True)
class Decoded:
    token_ids: tuple[int, ...]  # generated ids, ending with an eos id when the answer finished
    finished: bool  # False: stopped by max_new_tokens
    prefill_tokens: int
    prefill_s: float  # time to first token
    total_s: float


def _image_inputs(features: torch.Tensor | None) -> dict:
    if features is None:
        return {}
    return {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=[features])}}


@torch.inference_mode()
def prefill(
    model, ids: list[int], cache: DynamicCache, image_features: torch.Tensor | None = None
) -> torch.Tensor:
    """Run ``ids`` through the model on top of ``cache``; return the last position's logits."""
    input_ids = torch.tensor([ids], device=model.device)
    out = model(
        input_ids=input_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        **_image_inputs(image_features),
    )
    return out.logits[0, -1].float()


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


@torch.inference_mode()
def decode(
    model,
    history: list[int],
    cache: DynamicCache,
    image_features: torch.Tensor | None,
    params: GenerationParams,
    eos_token_ids: frozenset[int],
    on_token: Callable[[int], None] | None = None,
    banned_ids: list[int] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> Decoded:
    """Prefill ``history[cache length:]`` then decode up to ``params.max_new_tokens`` ids.

    ``banned_ids`` are never generated (llava.logits_mask). Afterwards the cache holds every id
    of ``history`` and every generated id but the last.
    """
    start = time.perf_counter()
    tail = history[cache.get_seq_length() :]
    generator = None
    if not params.greedy and params.seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(params.seed)
    # Features go only with a tail that still holds the image positions (a cold re-prefill).
    if model.config.image_token_id not in tail:
        image_features = None
    logits = prefill(model, tail, cache, image_features)
    prefill_s = time.perf_counter() - start
    generated: list[int] = []
    eos = torch.tensor(sorted(eos_token_ids), device=logits.device)
    banned = torch.tensor(banned_ids or [], dtype=torch.long, device=logits.device)
    while True:
        logits = logits.index_fill(0, banned, float("-inf"))
        if len(generated) < params.min_new_tokens:
            logits = logits.index_fill(0, eos, float("-inf"))
        token = _pick(logits, params, generator)
        generated.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos_token_ids or len(generated) == params.max_new_tokens:
            break
        if cancelled is not None and cancelled():  # ends like a max_new_tokens cut
            break
        logits = prefill(model, [token], cache)
    return Decoded(
        token_ids=tuple(generated),
        finished=generated[-1] in eos_token_ids,
        prefill_tokens=len(tail),
        prefill_s=prefill_s,
        total_s=time.perf_counter() - start,
    )
