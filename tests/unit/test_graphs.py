"""Decode steps at static shapes (llava.graphs), on CPU: padded to a bucket they answer what
the packed step answers, and the whole step is one graph for torch.compile (no graph break),
which is what lets CUDA capture it. The capture itself runs only on CUDA (make gpu-check)."""

from __future__ import annotations

import pytest
import torch

from demo_model.synthetic import held_out_samples
from llava.decoding import Chooser
from llava.generation import GenerationParams
from llava.graphs import BUCKETS, StaticDecode, bucket_for
from llava.runner import Runner, StepInput
from llava.sampling import Sampler
from tests.unit.test_runner import QUESTIONS, tiny_llava

EOS = frozenset({2})


def test_the_smallest_bucket_that_holds_the_batch():
    assert [bucket_for(n, BUCKETS) for n in (1, 3, 8, 9, 33, 64, 65)] == [
        1, 4, 8, 16, 64, 64, None,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def decoding():
    """Three sequences (two images, one text-only) prefilled, and a fourth left alone."""
    subject = tiny_llava()
    pool = subject.pool()
    pool.kv.zero_()  # eager flex (the compile test's backend) scores every slot of the pool
    vocab = subject.model.config.text_config.vocab_size
    runner = Runner(subject.model, pool, Sampler(vocab, [0, 1], EOS, "cpu"), attention="paged")
    images = [s.image for s in held_out_samples(2, seed=34_000)] + [None, None]
    kvs = []
    for index, image in enumerate(images):
        chunks = subject.chunks(image, [QUESTIONS[index % len(QUESTIONS)]])
        kv = pool.new_kv()
        kv.reserve(sum(len(ids) for ids, _ in chunks) + 8)
        for ids, features in chunks:
            runner.step([StepInput(kv, ids, features)])
        kvs.append(kv)
    return runner, kvs[:3], kvs[3]


def decode_batch(kvs) -> list[StepInput]:
    sampled = GenerationParams(do_sample=True, temperature=1.5, top_k=20, seed=9)
    choosers = [
        Chooser(GenerationParams(), EOS),
        Chooser(sampled, EOS),
        Chooser(GenerationParams(), EOS),
    ]
    return [
        StepInput(kv, [40 + i], None, c)
        for i, (kv, c) in enumerate(zip(kvs, choosers, strict=True))
    ]


def static_step(runner: Runner, batch, size: int) -> StaticDecode:
    scratch = runner.pool.new_kv()
    scratch.reserve(1)
    step = StaticDecode.empty(size, runner.pool_slots // runner.pool.block_tokens, "cpu")
    step.fill(batch, [item.chooser for item in batch], scratch.blocks[0], runner.sampler)
    return step


def test_a_decode_padded_to_its_bucket_answers_as_the_packed_step(decoding):
    runner, kvs, other = decoding
    other_slots = torch.tensor([b * 16 + o for b in other.blocks for o in range(16)])
    other_kv = runner.pool.kv[..., other_slots, :].clone()
    batch = decode_batch(kvs)
    step = static_step(runner, batch, 4)
    with torch.inference_mode():
        padded = runner.decode(*step.inputs())[:3].tolist()
    lengths = [kv.length for kv in kvs]
    assert runner.next_ids(decode_batch(kvs)) == padded
    assert [kv.length for kv in kvs] == [n + 1 for n in lengths]
    assert torch.equal(runner.pool.kv[..., other_slots, :], other_kv)  # padding wrote elsewhere
    for kv in kvs:
        kv.crop(kv.length - 1)


def test_the_decode_step_compiles_as_one_graph(decoding):
    """fullgraph=True raises at the first graph break; the compiled step (AOT-traced, run by
    the eager backend) gives the eager step's ids."""
    runner, kvs, _other = decoding
    step = static_step(runner, decode_batch(kvs), 4)
    compiled = torch.compile(runner.decode, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.inference_mode():
        eager = runner.decode(*step.inputs())
        assert torch.equal(compiled(*step.inputs()), eager)
