"""The model's own forward on a ``DynamicCache``: the reference the step runner is checked
against (tests/unit/test_runner.py, scripts/bench/runner.py). Not on the serving path."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPooling


@torch.inference_mode()
def prefill(
    model, ids: list[int], cache: DynamicCache, image_features: torch.Tensor | None = None
) -> torch.Tensor:
    """Run ``ids`` through the model on top of ``cache``; return the last position's logits."""
    image = {}
    if image_features is not None:
        pooled = BaseModelOutputWithPooling(pooler_output=[image_features])
        image = {"mm_encoder_outputs": {"image": pooled}}
    input_ids = torch.tensor([ids], device=model.device)
    out = model(
        input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **image
    )
    return out.logits[0, -1].float()
