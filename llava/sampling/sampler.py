"""The next id of every sequence in a step, chosen on the device in one batched pass.

Greedy rows take the argmax; sampled rows draw with the Gumbel-max trick: the argmax of
``logits / temperature + Gumbel noise`` over the ids that survive top-k and top-p is a draw
from the renormalised softmax, the distribution ``torch.multinomial`` would draw from. The
noise comes from a counter-based hash of (the turn's seed, how many ids it has generated, the
vocabulary index), not from a generator's state, so a row's draw is the same whatever else is
in the batch, and a seeded turn repeats exactly; nothing reads back to the host until the ids
are copied out (docs/engine/execution.md §Sampling on the device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llava.sampling.chooser import Chooser

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27: products of 32-bit values stay below 2**63 in int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) of int64 tensors holding 32-bit values."""
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` float32 uniforms in (0, 1), a pure function of (seed, counter, index)."""
    row = _mix32(_mix32(seeds & _MASK32) ^ (seeds >> 32) & _MASK32)
    row = _mix32((row + counters * 0x9E3779B) & _MASK32)
    index = torch.arange(vocab, device=seeds.device)
    bits = _mix32((row[:, None] ^ index) * 0x2C1B3C6 + 0x165667B1 & _MASK32)
    return ((bits >> 8).float() + 0.5) / float(1 << 24)  # 24 bits: exact in float32


@dataclass(frozen=True)
class SamplingRows:
    """Each row's sampling parameters as device tensors (one upload per step)."""

    hold_eos: torch.Tensor  # [rows] bool: fewer ids than min_new_tokens so far
    greedy: torch.Tensor  # [rows] bool
    values: torch.Tensor  # [rows, 3] float32: temperature, top_p, top_k (vocab when off)
    counters: torch.Tensor  # [rows, 2] int64: seed, ids generated so far


class Sampler:
    """Per engine: the ids no answer may contain and the end ids, as device masks."""

    def __init__(self, vocab: int, banned_ids: list[int], eos_ids: frozenset[int], device):
        self.vocab = vocab
        self.device = torch.device(device)
        self.banned = torch.zeros(vocab, device=self.device)
        self.banned[torch.tensor(banned_ids, dtype=torch.long)] = float("-inf")
        self.eos = torch.zeros(vocab, device=self.device)
        self.eos[torch.tensor(sorted(eos_ids), dtype=torch.long)] = float("-inf")

    def row_values(self, choosers: Sequence[Chooser]) -> tuple[list, list, list]:
        """Each row's (hold_eos, greedy), (temperature, top_p, top_k) and (seed, ids so far),
        as host lists: what ``rows`` uploads (a decode graph stages them with its inputs)."""
        flags = [(len(c.generated) < c.params.min_new_tokens, c.params.greedy) for c in choosers]
        # top_k is bounded by the wire, not by the model: at or above the vocabulary it cuts
        # nothing (HF's TopKLogitsWarper: min(top_k, vocab)), and never indexes past the row.
        values = [
            (c.params.temperature, c.params.top_p, min(c.params.top_k or self.vocab, self.vocab))
            for c in choosers
        ]
        counters = [(c.seed, len(c.generated)) for c in choosers]
        return flags, values, counters

    def rows(self, choosers: Sequence[Chooser]) -> SamplingRows:
        flags, values, counters = self.row_values(choosers)
        flags_t = torch.tensor(flags, dtype=torch.bool).to(self.device, non_blocking=True)
        return SamplingRows(
            flags_t[:, 0],
            flags_t[:, 1],
            torch.tensor(values, dtype=torch.float32).to(self.device, non_blocking=True),
            torch.tensor(counters, dtype=torch.long).to(self.device, non_blocking=True),
        )

    def choose(self, logits: torch.Tensor, rows: SamplingRows, any_sampled: bool = True):
        """``[rows]`` int64 ids on the device, one per row of float32 ``logits``. With
        ``any_sampled`` False (the host knows every row is greedy) the draw is skipped; a
        captured graph always draws and keeps the greedy rows' argmax."""
        logits = logits + self.banned + torch.where(rows.hold_eos[:, None], self.eos, 0.0)
        greedy = logits.argmax(-1)
        if not any_sampled:
            return greedy
        drawn = _draw(logits, rows.values, rows.counters)
        return torch.where(rows.greedy, greedy, drawn)

    def sample(self, logits: torch.Tensor, choosers: Sequence[Chooser]) -> torch.Tensor:
        any_sampled = not all(c.params.greedy for c in choosers)
        return self.choose(logits, self.rows(choosers), any_sampled)


def _draw(logits: torch.Tensor, values: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the smallest prefix of the sorted probabilities
    whose mass reaches top_p, at least one id), then a Gumbel-max draw."""
    temperature, top_p, top_k = values[:, :1], values[:, 1:2], values[:, 2:].long()
    scaled = logits / temperature
    ordered, order = scaled.sort(-1, descending=True)
    kth = ordered.gather(1, top_k - 1)
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p
    ordered = ordered.masked_fill(drop, float("-inf"))
    kept = torch.empty_like(scaled).scatter_(1, order, ordered)
    noise = uniform_noise(counters[:, 0], counters[:, 1], logits.shape[-1])
    return (kept - torch.log(-torch.log(noise))).argmax(-1)
