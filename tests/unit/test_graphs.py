"""Decode steps at static shapes (llava.exec.graphs), on CPU: padded to a bucket they answer what
the packed step answers, and the whole step is one graph for torch.compile (no graph break),
which is what lets CUDA capture it. The capture itself runs only on CUDA (make gpu-check); its
loop (a bucket that fails is left eager, out of memory stops) runs here with the CUDA pieces
stood in for."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

import llava.exec.graphs
from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.exec.graphs import BUCKETS, DecodeGraphs, StaticDecode, bucket_for
from llava.exec.runner import Runner, RunnerCounters, StepInput
from llava.sampling.chooser import Chooser
from llava.sampling.params import GenerationParams
from llava.sampling.sampler import Sampler
from tests.unit.test_engine import SMALL_BUDGET, answers_of
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
    runner = Runner(subject.model, pool, Sampler(vocab, [0, 1], EOS, "cpu"), attention="flex")
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
    step = StaticDecode.empty(size, runner.pool_slots // runner.pool.block_tokens, "cpu")
    step.fill(batch, [item.chooser for item in batch], runner.pool.set_aside(), runner.sampler)
    return step


@pytest.mark.thorough  # flex attention compiled on a CPU (seconds)
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


@pytest.mark.thorough  # a whole-step torch.compile: seconds on a CPU
def test_the_decode_step_compiles_as_one_graph(decoding):
    """fullgraph=True raises at the first graph break; the compiled step (AOT-traced, run by
    the eager backend) gives the eager step's ids."""
    runner, kvs, _other = decoding
    step = static_step(runner, decode_batch(kvs), 4)
    compiled = torch.compile(runner.decode, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.inference_mode():
        eager = runner.decode(*step.inputs())
        assert torch.equal(compiled(*step.inputs()), eager)


# -- the capture loop on CPU: llava.exec.graphs' CUDA pieces stood in for -------------------------
class EagerGraph:
    """Stands in for a captured CUDA graph: a replay runs the step eagerly into its output."""

    replays = 0

    def __init__(self, runner, step: StaticDecode):
        self.runner, self.step = runner, step

    def replay(self) -> None:
        EagerGraph.replays += 1
        with torch.inference_mode():
            self.step.out.copy_(self.runner.decode(*self.step.inputs()))


class SevensGraph:
    """Stands in for a captured graph whose step answers id 7 in every row (no model work)."""

    def replay(self) -> None:
        pass


def capture_failing_at(bucket: int, error: BaseException, eager: bool = True):
    """A stand-in for llava.exec.graphs._capture that raises ``error`` for ``bucket``; the others
    are "captured" as an EagerGraph (``eager``) or a SevensGraph."""

    def capture(runner, step: StaticDecode) -> None:
        if step.ids.shape[0] == bucket:
            raise error
        if eager:
            with torch.inference_mode():
                step.out = runner.decode(*step.inputs())
            step.graph = EagerGraph(runner, step)
        else:
            step.out, step.graph = torch.full_like(step.ids, 7), SevensGraph()

    return capture


@pytest.fixture
def cpu_captures(monkeypatch):
    monkeypatch.setattr(llava.exec.graphs, "capturable", lambda device: True)
    monkeypatch.setattr(llava.exec.graphs, "_reserved_bytes", lambda device: 0)


@pytest.mark.thorough  # flex attention compiled on a CPU (seconds)
@pytest.mark.parametrize(
    ("error", "captured", "failed"),
    [
        (RuntimeError("inductor failed\nits log"), [1, 4], {2: "RuntimeError: inductor failed"}),
        (torch.cuda.OutOfMemoryError("out of memory"), [1], {}),  # stops, as before
    ],
    ids=["error", "out-of-memory"],
)
def test_a_bucket_that_fails_to_capture_is_left_eager(
    decoding, cpu_captures, monkeypatch, caplog, error, captured, failed
):
    runner, kvs, _other = decoding
    monkeypatch.setattr(llava.exec.graphs, "_capture", capture_failing_at(2, error, eager=False))
    graphs = DecodeGraphs(runner)
    with caplog.at_level(logging.WARNING, logger="llava.exec.graphs"):
        assert graphs.capture(4, budget_bytes=1 << 30) == captured
    assert graphs.failed == failed
    warnings = [r.getMessage() for r in caplog.records if r.name == "llava.exec.graphs"]
    assert warnings == [
        f"decode graph of bucket {size} not captured (its steps run eagerly): {why}"
        for size, why in failed.items()
    ]
    two = decode_batch(kvs)[:2]
    assert graphs.run(two[:1], [i.chooser for i in two[:1]]) == [7]
    expected = [7, 7] if 4 in captured else None  # a batch of 2 fits only bucket 4
    assert graphs.run(two, [i.chooser for i in two]) == expected


@pytest.mark.thorough  # flex attention compiled on a CPU (seconds)
def test_an_engine_whose_graph_capture_fails_answers_as_the_default(
    demo_model, cpu_captures, monkeypatch, caplog
):
    failure = RuntimeError("capture failed\nCUDA error: operation not permitted when capturing")
    monkeypatch.setattr(llava.exec.graphs, "_capture", capture_failing_at(2, failure))
    image = held_out_samples(1, seed=35_000)[0].image
    config = EngineConfig(model_dir="-", attention="flex", max_batch=2)
    engine = Engine(demo_model, config, SMALL_BUDGET)
    with caplog.at_level(logging.WARNING, logger="llava.exec.graphs"):
        engine.warm_up()
    assert sorted(engine.runner.graphs.steps) == [1]
    assert engine.runner.graphs.failed == {2: "RuntimeError: capture failed"}
    warnings = [r.getMessage() for r in caplog.records if r.name == "llava.exec.graphs"]
    assert len(warnings) == 1 and "bucket 2" in warnings[0] and "capture failed" in warnings[0]
    assert engine.stats().runner == RunnerCounters(graph_capture_failures=1)
    replays = EagerGraph.replays
    reference = Engine(demo_model, EngineConfig(model_dir="-"), SMALL_BUDGET)
    assert answers_of(engine, image) == answers_of(reference, image)
    assert EagerGraph.replays > replays  # the captured bucket served the decode steps
    engine.check_integrity()  # the graphs' scratch block is on the books


@pytest.mark.thorough  # flex attention compiled on a CPU (seconds)
def test_a_small_pool_still_gets_graphs_up_to_the_floor(decoding, cpu_captures, monkeypatch):
    """A twentieth of a small pool holds no graph (seen on an H200 with a 1 GiB pool): the
    graphs' budget is never under GRAPHS_BUDGET_FLOOR, and captures stop past it."""
    runner, _kvs, _other = decoding
    assert runner.pool.allocated_bytes // 20 < 40 << 20
    never = capture_failing_at(0, RuntimeError("no bucket 0"), eager=False)
    monkeypatch.setattr(llava.exec.graphs, "_capture", never)
    readings = itertools.count(step=100 << 20)  # each capture reads before and after: +100 MiB
    monkeypatch.setattr(llava.exec.graphs, "_reserved_bytes", lambda device: next(readings))
    graphs = runner.capture_graphs(64)
    assert sorted(graphs.steps) == [1, 2, 4, 8, 16]  # 5 x 100 MiB fit 512 MiB, a sixth not
    assert graphs.reserved_bytes == 500 << 20


@pytest.mark.thorough  # flex attention compiled on a CPU (seconds)
def test_a_short_prefill_rides_in_a_decode_graph_beside_decode_rows(
    decoding, cpu_captures, monkeypatch
):
    """A question's ids (no image) as extra rows of a captured step, one row per id, beside
    three sessions' decode rows: each sequence's next id is what the eager packed step gives
    (flex for the decode rows, SDPA for the prefill)."""
    runner, kvs, other = decoding
    monkeypatch.setattr(llava.exec.graphs, "_capture", capture_failing_at(-1, RuntimeError()))
    graphs = DecodeGraphs(runner, buckets=(8,))
    assert graphs.capture(8, budget_bytes=1 << 30) == [8]
    question = StepInput(other, [40, 41, 42, 43, 44], None, Chooser(GenerationParams(), EOS))
    batch = [*decode_batch(kvs), question]  # 3 + 5 rows: bucket 8
    lengths = [item.kv.length for item in batch]
    replays = EagerGraph.replays
    from_graph = graphs.run(batch, [item.chooser for item in batch])
    assert EagerGraph.replays == replays + 1
    assert [item.kv.length for item in batch] == lengths  # the runner moves lengths, not run
    monkeypatch.setattr(runner, "graphs", None)  # another test may have left its graphs
    assert from_graph == runner.next_ids(batch)  # eager
    for item, length in zip(batch, lengths, strict=True):
        item.kv.crop(length)
    with_image = [StepInput(other, [40], torch.zeros(1, 8), question.chooser)]
    assert graphs.run(with_image, [question.chooser]) is None  # an image's rows run eagerly
    too_many = [StepInput(other, list(range(40, 49)), None, question.chooser)]
    assert graphs.run(too_many, [question.chooser]) is None  # 9 rows: no bucket holds them
