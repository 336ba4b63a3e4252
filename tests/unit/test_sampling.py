"""Choosing ids on the device (llava.sampling.sampler): greedy is the masked argmax, a seeded
draw is a function of (seed, count) alone, and draws follow the filtered softmax."""

from __future__ import annotations

import torch

from llava.sampling.chooser import Chooser
from llava.sampling.params import GenerationParams
from llava.sampling.sampler import Sampler, uniform_noise

VOCAB = 12
BANNED = [0, 1]
EOS = frozenset({2})


def chooser(generated: int = 0, **params) -> Chooser:
    made = Chooser(GenerationParams(max_new_tokens=100, **params), EOS)
    made.generated = [5] * generated
    return made


def sampler() -> Sampler:
    return Sampler(VOCAB, BANNED, EOS, "cpu")


def test_greedy_is_the_argmax_without_banned_ids_and_without_eos_before_min_new_tokens():
    logits = torch.zeros(3, VOCAB)
    logits[:, 0] = 9  # banned
    logits[:, 2] = 8  # eos
    logits[:, 7] = 7
    rows = [
        chooser(),
        chooser(min_new_tokens=2, generated=1),
        chooser(min_new_tokens=2, generated=2),
    ]
    assert sampler().sample(logits, rows).tolist() == [2, 7, 2]


def test_a_seeded_draw_depends_on_its_seed_and_count_not_on_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    params = {"do_sample": True, "temperature": 1.3, "top_k": 6, "top_p": 0.9}
    rows = [chooser(seed=7, generated=i, **params) for i in range(3)]
    rows += [chooser(), chooser(seed=8, **params), chooser(seed=7, **params)]
    together = sampler().sample(logits, rows).tolist()
    alone = [sampler().sample(logits[i : i + 1], [rows[i]]).item() for i in range(6)]
    assert together == alone
    assert together == sampler().sample(logits, rows).tolist()  # and it repeats


def test_top_k_one_and_a_tiny_top_p_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(8, VOCAB)
    greedy = sampler().sample(logits, [chooser() for _ in range(8)])
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        rows = [chooser(seed=s, do_sample=True, temperature=2.0, **params) for s in range(8)]
        assert torch.equal(sampler().sample(logits, rows), greedy)


def test_draws_follow_the_filtered_softmax():
    """4,000 draws (counts 0..3999 of one seed) against the expected frequencies."""
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, 4:8] = torch.tensor([2.0, 1.0, 0.5, 0.0])
    rows_params = {"do_sample": True, "temperature": 1.0, "top_k": 3, "seed": 3}
    draws = 4000
    # one batch of the 4,000 rows: a draw is a function of (seed, count), not of its batch
    rows = [chooser(generated=count, **rows_params) for count in range(draws)]
    tokens = sampler().sample(logits.expand(draws, VOCAB), rows)
    counts = torch.bincount(tokens, minlength=VOCAB).float()
    expected = torch.zeros(VOCAB)
    expected[4:7] = torch.softmax(torch.tensor([2.0, 1.0, 0.5]), 0) * draws
    assert counts[7] == 0 and counts[:4].sum() == 0  # outside top-k, and the tail
    assert ((counts - expected).abs() < 4 * expected.clamp(min=1).sqrt()).all(), counts


def test_noise_is_uniform_in_the_open_unit_interval():
    noise = uniform_noise(torch.tensor([0, 2**62]), torch.tensor([0, 5]), 50_000)
    assert noise.min() > 0 and noise.max() < 1
    assert abs(noise.mean().item() - 0.5) < 0.01
    assert not torch.equal(noise[0], noise[1])


def test_a_top_k_past_the_vocabulary_cuts_nothing_and_leaves_its_batch_alone():
    """The wire allows top_k up to 1,000,000, more than any vocabulary: min(top_k, vocab), as
    HF's TopKLogitsWarper (unclamped, it indexed past the row: a 500, or on a GPU a
    device-side assert)."""
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB)
    greedy = sampler().sample(logits[:1], [chooser()])

    def row(top_k: int) -> Chooser:
        return chooser(seed=5, do_sample=True, temperature=1.5, top_k=top_k)

    ids = sampler().sample(logits, [chooser(), row(10**6)])
    assert ids[0] == greedy[0]
    no_cut = sampler().sample(logits[1:], [row(0)])
    assert ids[1] == no_cut[0] == sampler().sample(logits[1:], [row(VOCAB)])[0]
    assert ids[1].item() not in BANNED
