"""STAND-IN for kvrunner's step runner (docs/design-sched.md §Stand-in): runs each sequence
alone on its SessionKV's DynamicCache. Replaced on merge."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from llava.kv_pool import KVPool, SessionKV


@dataclass
class StepInput:
    kv: SessionKV
    ids: list[int]
    image_features: torch.Tensor | None = None


class Runner:
    def __init__(self, model, pool: KVPool):
        self.model = model
        self.pool = pool

    @torch.inference_mode()
    def step(self, batch: list[StepInput]) -> torch.Tensor:
        rows = []
        for item in batch:
            if len(item.kv.blocks) * self.pool.block_tokens < item.kv.length + len(item.ids):
                raise RuntimeError("no room reserved for the step's ids")
            extra = {}
            if item.image_features is not None:
                pooled = BaseModelOutputWithPooling(pooler_output=[item.image_features])
                extra = {"mm_encoder_outputs": {"image": pooled}}
            out = self.model(
                input_ids=torch.tensor([item.ids], device=self.model.device),
                past_key_values=item.kv.cache,
                use_cache=True,
                logits_to_keep=1,
                **extra,
            )
            item.kv.length += len(item.ids)
            rows.append(out.logits[0, -1].float())
        return torch.stack(rows)

    @staticmethod
    def supports(model) -> str | None:
        return None
