"""One forward step over many sequences packed together, on KV held in the pool.

The tokens of every sequence in the batch (a prefill tail or one decoded id each) are packed
into one [tokens, hidden] matrix with no padding, so each layer's projections and MLP run as
one batched matmul; only attention runs per sequence, over that sequence's own blocks (read
in place when they are adjacent, gathered otherwise). The layers' own modules do the maths,
so the weights, norms and rotary embedding are the checkpoint's
(docs/design.md §Step runner).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llava.kv_pool import KVPool, SessionKV, kv_geometry

# Rotary types whose frequencies do not depend on the batch: the model's rotary module gives
# each token the same angles alone or packed. "dynamic" and "longrope" rescale by the largest
# position in the forward, which a packed batch would share across sequences.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
TEXT_MODEL_TYPES = frozenset({"llama"})


@dataclass
class StepInput:
    kv: SessionKV
    ids: list[int]  # new ids appended after kv.length (a prefill tail, or one decoded id)
    image_features: torch.Tensor | None = None  # (image tokens in ids, hidden)


@dataclass(frozen=True)
class _Sequence:
    span: tuple[int, int]  # its [start, stop) in the packed tokens
    slots: slice | torch.Tensor  # its K/V pool slots 0..new length; a slice: read in place
    mask: torch.Tensor | None  # [new, past + new]: new token i sees the past and new 0..i


@dataclass(frozen=True)
class _Packed:
    """Per-step tensors shared by every layer."""

    positions: torch.Tensor  # [T] each token's true position (kv.length + offset)
    write_slots: torch.Tensor  # [T] pool slot each new token's K/V goes to
    sequences: list[_Sequence]


def _layer_problem(layer) -> str | None:
    attn = getattr(layer, "self_attn", None)
    parts = ("input_layernorm", "post_attention_layernorm", "mlp")
    if attn is None or any(not hasattr(layer, part) for part in parts):
        return f"decoder layer {type(layer).__name__} is not LLaMA-like"
    if any(not hasattr(attn, proj) for proj in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return f"attention {type(attn).__name__} has no q/k/v/o projections"
    return None


class Runner:
    def __init__(self, model, pool: KVPool):
        problem = self.supports(model)
        if problem:
            raise ValueError(f"the step runner cannot run this model: {problem}")
        text = model.config.text_config
        layers, kv_heads, head_dim = kv_geometry(text)
        shape = pool.kv.shape
        if (shape[0], shape[2], shape[4]) != (layers, kv_heads, head_dim):
            raise ValueError(f"KV pool shape {tuple(pool.kv.shape)} does not fit the model")
        if pool.kv.dtype != model.dtype or pool.kv.device != model.device:
            raise ValueError(
                f"KV pool is {pool.kv.dtype} on {pool.kv.device}, model is {model.dtype} on "
                f"{model.device}"
            )
        self.model = model
        self.pool = pool
        self.lm = model.model.language_model
        self.image_token_id = model.config.image_token_id
        self.heads = text.num_attention_heads
        self.kv_heads = kv_heads
        self.head_dim = head_dim

    @staticmethod
    def supports(model) -> str | None:
        """None when the runner computes exactly what this model's forward does, else why not."""
        text = model.config.text_config
        if text.model_type not in TEXT_MODEL_TYPES:
            return f"text model type {text.model_type!r} (runs: {sorted(TEXT_MODEL_TYPES)})"
        if getattr(text, "sliding_window", None):
            return "sliding-window attention"
        rope = getattr(text, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            return f"rope type {rope_type!r} (runs: {sorted(STATIC_ROPE_TYPES)})"
        lm = getattr(getattr(model, "model", None), "language_model", None)
        if lm is None or not hasattr(lm, "layers") or not hasattr(lm, "rotary_emb"):
            return "no LLaMA-like language model at model.model.language_model"
        for layer in lm.layers:
            problem = _layer_problem(layer)
            if problem:
                return problem
        return None

    @torch.inference_mode()
    def step(self, batch: list[StepInput]) -> torch.Tensor:
        """One forward over all sequences packed together (prefills and decodes may be mixed).

        Every kv must already have reserved room for its ids. Returns float32 logits
        [len(batch), vocab] at each sequence's last new position; each kv.length grows by
        len(ids). On an error no kv.length changes.
        """
        packed = self._pack(batch)
        hidden = self._embed(batch, packed)
        cos, sin = self.lm.rotary_emb(hidden, packed.positions[None])
        rotary = (cos[0, :, None, :], sin[0, :, None, :])  # [T, 1, head_dim]: broadcast on heads
        for index, layer in enumerate(self.lm.layers):
            attended = self._attention(index, layer, layer.input_layernorm(hidden), rotary, packed)
            hidden = hidden + attended
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = torch.tensor([s.span[1] - 1 for s in packed.sequences], device=hidden.device)
        logits = self.model.lm_head(self.lm.norm(hidden[last]))
        for item in batch:
            item.kv.length += len(item.ids)
        return logits.float()

    # -- one step's pieces -----------------------------------------------------------------
    def _pack(self, batch: list[StepInput]) -> _Packed:
        if not batch:
            raise ValueError("empty batch")
        if len({id(item.kv) for item in batch}) != len(batch):
            raise ValueError("a sequence appears twice in one step")
        device = self.pool.kv.device
        positions, write_slots, sequences = [], [], []
        start = 0
        for item in batch:
            kv, n = item.kv, len(item.ids)
            if kv.pool is not self.pool:
                raise ValueError("a SessionKV from another pool")
            if n == 0:
                raise ValueError("a sequence with no new ids")
            if kv.length + n > kv.capacity:
                raise ValueError(
                    f"{n} new ids after {kv.length} need {kv.length + n} reserved tokens, "
                    f"{kv.capacity} are: reserve first"
                )
            stop = kv.length + n
            positions.append(torch.arange(kv.length, stop, device=device))
            write_slots.append(kv.slots(kv.length, stop))
            slots = kv.contiguous_slots(stop)
            mask = None
            if n > 1:
                mask = torch.ones(n, stop, dtype=torch.bool, device=device).tril(kv.length)
            sequences.append(
                _Sequence((start, start + n), kv.slots(0, stop) if slots is None else slots, mask)
            )
            start += n
        return _Packed(torch.cat(positions), torch.cat(write_slots), sequences)

    def _embed(self, batch: list[StepInput], packed: _Packed) -> torch.Tensor:
        """Token embeddings, image features in the image-token positions (found on the host:
        no device sync per sequence)."""
        device = self.pool.kv.device
        flat = [i for item in batch for i in item.ids]
        where, features = [], []
        for item, sequence in zip(batch, packed.sequences, strict=True):
            start = sequence.span[0]
            image_at = [
                start + i for i, token in enumerate(item.ids) if token == self.image_token_id
            ]
            rows = 0 if item.image_features is None else item.image_features.shape[0]
            if rows != len(image_at):
                raise ValueError(
                    f"{len(image_at)} image tokens in the new ids but {rows} image feature rows"
                )
            if rows:
                where.extend(image_at)
                features.append(item.image_features)
        hidden = self.lm.embed_tokens(torch.tensor(flat, device=device))
        if where:
            rows = torch.cat(features).to(device, hidden.dtype)
            hidden[torch.tensor(where, device=device)] = rows
        return hidden

    def _attention(self, index: int, layer, x: torch.Tensor, rotary, packed: _Packed):
        attn = layer.self_attn
        tokens = x.shape[0]
        q = attn.q_proj(x).view(tokens, self.heads, self.head_dim)
        k = attn.k_proj(x).view(tokens, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(tokens, self.kv_heads, self.head_dim)
        q, k = _rotate(q, rotary), _rotate(k, rotary)
        keys, values = self.pool.kv[index]  # [kv_heads, slots, head_dim] each
        keys.index_copy_(1, packed.write_slots, k.transpose(0, 1))
        values.index_copy_(1, packed.write_slots, v.transpose(0, 1))
        out = torch.empty_like(q)
        for sequence in packed.sequences:
            start, stop = sequence.span
            if isinstance(sequence.slots, slice):  # adjacent blocks: no copy
                seq_keys, seq_values = keys[:, sequence.slots], values[:, sequence.slots]
            else:
                seq_keys = keys.index_select(1, sequence.slots)
                seq_values = values.index_select(1, sequence.slots)
            out[start:stop] = F.scaled_dot_product_attention(
                q[start:stop].transpose(0, 1),
                seq_keys,
                seq_values,
                attn_mask=sequence.mask,
                scale=attn.scaling,
                enable_gqa=self.heads != self.kv_heads,
            ).transpose(0, 1)
        return attn.o_proj(out.view(tokens, -1))


def _rotate(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding of [T, heads, head_dim] (the rotate-half form LLaMA checkpoints use)."""
    cos, sin = rotary
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
