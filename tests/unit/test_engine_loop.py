"""The engine loop on the demo model: batched turns equal turns alone, per-session order,
deadlines, cancellation, one failing turn failing alone (docs/engine/scheduling.md §Engine loop)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import Busy, ShardFailed
from llava.exec import compiler
from llava.kv.budget import MemoryBudget
from llava.sched.loop import device_lost
from llava.sessions.session import Tier
from tests.unit.test_reaper import wait_until

QUESTIONS = [
    "What color is the shape?",
    "And its shape?",
    "Say that again.",
    "What is in the picture?",
    "What shape is it?",
]


def new_engine(demo_model, **settings) -> Engine:
    return Engine(demo_model, EngineConfig("-", **settings), MemoryBudget(64 << 20))


def record_batch_sizes(engine: Engine) -> list[int]:
    sizes: list[int] = []
    step = engine.runner.next_ids
    engine.runner.next_ids = lambda batch: sizes.append(len(batch)) or step(batch)
    return sizes


def conversation(engine: Engine, index: int, image) -> list[tuple[int, ...]]:
    """Session ``index``: its own image (or none), number of turns and answer lengths."""
    session_id = engine.open(image).session_id
    answers = []
    for turn in range(2 + index % 4):
        parameters = {"max_new_tokens": 3 + (index + turn) % 6, "min_new_tokens": index % 3}
        answers.append(engine.ask(session_id, QUESTIONS[turn], parameters).token_ids)
    return answers


def test_eight_sessions_batched_answer_exactly_as_each_alone(demo_model):
    images = [sample.image for sample in held_out_samples(7, seed=50_000)] + [None]
    alone = new_engine(demo_model, max_batch=1)
    expected = [conversation(alone, i, image) for i, image in enumerate(images)]
    engine = new_engine(demo_model)
    sizes = record_batch_sizes(engine)
    results: dict[int, list] = {}
    start = threading.Barrier(len(images), timeout=60)

    def client(index: int) -> None:
        start.wait()
        results[index] = conversation(engine, index, images[index])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(images))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [results.get(i) for i in range(len(images))] == expected
    assert max(sizes) >= 4  # the sessions really shared steps


def test_seeded_sampling_in_a_batch_equals_sampling_alone(demo_model, sample):
    params = {"do_sample": True, "temperature": 1.5, "top_k": 5, "seed": 11, "max_new_tokens": 8}

    def sampled(engine: Engine) -> tuple[int, ...]:
        return engine.ask(engine.open(sample.image).session_id, QUESTIONS[3], params).token_ids

    alone = sampled(new_engine(demo_model))
    engine = new_engine(demo_model)
    others = [engine.open(sample.image).session_id for _ in range(3)]
    threads = [
        threading.Thread(target=engine.ask, args=(s, QUESTIONS[0], {"max_new_tokens": 8}))
        for s in others
    ]
    for thread in threads:
        thread.start()
    assert sampled(engine) == alone
    for thread in threads:
        thread.join(timeout=60)


def test_concurrent_asks_on_one_session_run_in_arrival_order(demo_model, sample):
    waiting = len(QUESTIONS) - 1  # behind the first: the default (0) refuses them
    engine = Engine(demo_model, EngineConfig("-", max_waiting_asks=waiting), MemoryBudget(64 << 20))
    session_id = engine.open(sample.image).session_id
    release = threading.Event()
    blocker = threading.Thread(target=engine.loop.call, args=(release.wait,))
    blocker.start()  # the loop is held: every ask below queues, in a known order
    wait_until(lambda: engine.loop._inbox.qsize() == 0, 10, "the loop to take the blocker")
    answers: dict[int, tuple] = {}
    threads = []
    for turn, question in enumerate(QUESTIONS):

        def ask(turn=turn, question=question):
            answers[turn] = engine.ask(session_id, question, {"max_new_tokens": 5}).token_ids

        threads.append(threading.Thread(target=ask))
        threads[-1].start()
        wait_until(lambda n=turn + 1: engine.loop._inbox.qsize() == n, 10, "the ask queued")
    release.set()
    for thread in [blocker, *threads]:
        thread.join(timeout=60)
    concurrent = engine.store.session(session_id)
    sequential = new_engine(demo_model)
    again = sequential.open(sample.image).session_id
    expected = [sequential.ask(again, q, {"max_new_tokens": 5}).token_ids for q in QUESTIONS]
    assert [answers[t] for t in range(len(QUESTIONS))] == expected
    assert concurrent.messages == sequential.store.session(again).messages


def test_a_turn_past_its_deadline_ends_unfinished_and_the_next_turn_works(demo_model, sample):
    engine = new_engine(demo_model)
    session_id = engine.open(sample.image).session_id
    engine.config = dataclasses.replace(engine.config, turn_deadline_s=1e-9)
    late = engine.ask(session_id, "What color is the shape?")
    assert (late.finished, late.stop_reason, late.token_ids) == (False, "deadline", ())
    engine.config = dataclasses.replace(engine.config, turn_deadline_s=50)
    answer = engine.ask(session_id, "What color is the shape?")
    assert (answer.finished, answer.stop_reason, answer.text) == (True, "eos", sample.color)


def test_a_cancelled_turn_stops_at_the_next_step_and_is_committed(demo_model, sample):
    engine = new_engine(demo_model)
    session_id = engine.open(sample.image).session_id
    streamed: list[int | None] = []
    params = {"max_new_tokens": 40, "min_new_tokens": 40}
    answer = engine.ask(
        session_id,
        "What is in the picture?",
        params,
        on_token=lambda _text, token_id: streamed.append(token_id),
        cancelled=lambda: len(streamed) >= 3,
    )
    assert (answer.finished, answer.stop_reason, len(answer.token_ids)) == (False, "cancelled", 3)
    session = engine.store.session(session_id)
    assert session.token_ids[-3:] == list(answer.token_ids) and session.turns == 1
    follow_up = engine.ask(session_id, "What color is the shape?")
    assert follow_up.stop_reason == "eos" and follow_up.cached_tokens > 0


def test_a_failing_turn_fails_alone_and_keeps_its_history(demo_model):
    a, b = held_out_samples(2, seed=60_000)
    engine = new_engine(demo_model)
    alone = new_engine(demo_model)
    expected = alone.ask(alone.open(b.image).session_id, QUESTIONS[3], {"max_new_tokens": 12})
    failing = engine.open(a.image).session_id
    healthy = engine.open(b.image).session_id
    engine.ask(failing, QUESTIONS[0])
    history = list(engine.store.session(failing).token_ids)

    def broken_stream(_text, _token_id):
        raise RuntimeError("the client's socket broke")

    outcome = {}

    def healthy_turn():
        outcome["b"] = engine.ask(healthy, QUESTIONS[3], {"max_new_tokens": 12})

    thread = threading.Thread(target=healthy_turn)
    thread.start()
    with pytest.raises(RuntimeError, match="socket broke"):
        engine.ask(failing, QUESTIONS[1], {"max_new_tokens": 12}, on_token=broken_stream)
    thread.join(timeout=60)
    assert outcome["b"].token_ids == expected.token_ids
    session = engine.store.session(failing)
    assert session.tier is Tier.FEATURES and session.token_ids == history
    assert engine.ask(failing, QUESTIONS[1]).text == a.shape


def test_a_step_that_fails_for_one_sequence_fails_only_its_turn(demo_model):
    a, b = held_out_samples(2, seed=61_000)
    long = {"max_new_tokens": 30, "min_new_tokens": 30}
    alone = new_engine(demo_model)
    expected = alone.ask(alone.open(b.image).session_id, QUESTIONS[3], long).token_ids
    engine = new_engine(demo_model)
    failing, healthy = engine.open(a.image).session_id, engine.open(b.image).session_id
    history = list(engine.store.session(failing).token_ids)
    poisoned = engine.store.session(failing).kv
    step = engine.runner.next_ids
    sizes = []

    def step_failing_for_one(batch):
        sizes.append(len(batch))
        if any(item.kv is poisoned for item in batch):
            raise RuntimeError("this sequence breaks the step")
        return step(batch)

    engine.runner.next_ids = step_failing_for_one
    streaming = threading.Event()
    outcome = {}

    def healthy_turn():
        outcome["b"] = engine.ask(healthy, QUESTIONS[3], long, lambda *_: streaming.set())

    thread = threading.Thread(target=healthy_turn)
    thread.start()
    assert streaming.wait(timeout=60)
    with pytest.raises(RuntimeError, match="breaks the step"):
        engine.ask(failing, QUESTIONS[0])
    thread.join(timeout=60)
    assert 2 in sizes  # the two really shared a step, and the healthy one went on alone
    assert outcome["b"].token_ids == expected
    session = engine.store.session(failing)
    assert session.tier is Tier.FEATURES and session.token_ids == history
    engine.runner.next_ids = step
    assert engine.ask(failing, QUESTIONS[0]).text == a.color


def test_the_loops_thread_compiles_under_the_engines_compiler_settings(demo_model):
    """torch's compiler settings are per thread: one set at import, in this thread, was not in
    force in the loop's, where the compiles run (a ninth flex graph failed under the default
    recompile limit of 8)."""
    engine = new_engine(demo_model)
    fresh = []
    thread = threading.Thread(target=lambda: fresh.append(torch._dynamo.config.recompile_limit))
    thread.start()
    thread.join()
    assert fresh != [compiler.RECOMPILE_LIMIT]  # what any other thread starts with
    in_loop = engine.loop.call(lambda: torch._dynamo.config.recompile_limit)
    assert in_loop == compiler.RECOMPILE_LIMIT


def out_of_device_memory(*_args):
    """What a full CUDA device raises. A CPU cannot run out of device memory, so this one error
    is made here, not met; tests/unit/test_gpu.py fills a real device."""
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_turn_the_device_has_no_memory_for_is_answered_kv_memory_full(demo_model):
    sample = held_out_samples(1, seed=62_000)[0]
    engine = new_engine(demo_model)
    session_id = engine.open(sample.image).session_id
    engine.ask(session_id, QUESTIONS[0])
    history = list(engine.store.session(session_id).token_ids)
    step, engine.runner.next_ids = engine.runner.next_ids, out_of_device_memory
    with pytest.raises(Busy) as refused:
        engine.ask(session_id, QUESTIONS[1])
    assert (refused.value.code, refused.value.retry_after_s) == ("KV_MEMORY_FULL", 1.0)
    assert isinstance(refused.value.__cause__, torch.cuda.OutOfMemoryError)
    assert engine.store.session(session_id).token_ids == history
    # the step, then its retry alone (the allocator's cache handed back between them)
    assert engine.stats().runner.device_out_of_memory == 2
    engine.runner.next_ids = step
    assert engine.ask(session_id, QUESTIONS[1]).text == sample.shape
    engine.check_integrity()


def test_an_open_whose_vision_tower_the_device_has_no_memory_for_holds_nothing(
    demo_model, monkeypatch
):
    sample = held_out_samples(1, seed=62_500)[0]
    engine = new_engine(demo_model)
    monkeypatch.setattr(engine, "encode_image", out_of_device_memory)
    with pytest.raises(Busy, match="ran out of memory"):
        engine.open(sample.image)
    stats = engine.stats()
    assert (stats.sessions, stats.total_bytes, stats.runner.device_out_of_memory) == (0, 0, 1)
    monkeypatch.undo()
    assert engine.ask(engine.open(sample.image).session_id, QUESTIONS[0]).text == sample.color
    engine.check_integrity()


def test_a_batched_step_the_device_has_no_memory_for_answers_each_turn_alone(demo_model):
    a, b = held_out_samples(2, seed=63_000)
    long = {"max_new_tokens": 30, "min_new_tokens": 30}
    alone = new_engine(demo_model)
    expected = [alone.ask(alone.open(s.image).session_id, QUESTIONS[3], long).token_ids
                for s in (a, b)]  # fmt: skip
    engine = new_engine(demo_model)
    first, second = (engine.open(s.image).session_id for s in (a, b))
    step, sizes = engine.runner.next_ids, []

    def full_once_for_two(batch):
        sizes.append(len(batch))
        if len(batch) > 1 and sizes.count(2) == 1:
            out_of_device_memory()
        return step(batch)

    engine.runner.next_ids = full_once_for_two
    streaming = threading.Event()
    outcome = {}

    def first_turn():
        outcome[first] = engine.ask(first, QUESTIONS[3], long, lambda *_: streaming.set())

    thread = threading.Thread(target=first_turn)
    thread.start()
    assert streaming.wait(timeout=60)
    outcome[second] = engine.ask(second, QUESTIONS[3], long)
    thread.join(timeout=60)
    assert 2 in sizes and engine.stats().runner.device_out_of_memory == 1
    assert [outcome[first].token_ids, outcome[second].token_ids] == expected
    engine.check_integrity()


DEVICE_ASSERT = torch.AcceleratorError("CUDA error: device-side assert triggered")


@pytest.mark.parametrize(
    "error, lost",
    [
        (DEVICE_ASSERT, True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("../aten/src/ATen/native/cuda/Indexing.cu: device-side assert"), True),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (torch.AcceleratorError("CUDA error: out of memory"), False),
        (RuntimeError("index 95 is out of bounds for dimension 1 with size 12"), False),
        (ValueError("CUDA error"), False),
    ],
)
def test_only_errors_that_poison_the_device_lose_it(error, lost):
    assert device_lost(error) is lost


def test_a_step_that_loses_the_device_fails_every_request_stops_and_tells_on_fatal_once(
    demo_model,
):
    a, b = held_out_samples(2, seed=62_000)
    engine = new_engine(demo_model)
    told: list[BaseException] = []
    engine.on_fatal = told.append
    first, second = engine.open(a.image).session_id, engine.open(b.image).session_id
    release = threading.Event()
    blocker = threading.Thread(target=engine.loop.call, args=(release.wait,))
    blocker.start()  # the loop is held: both asks below are in flight when the step fails
    wait_until(lambda: engine.loop._inbox.qsize() == 0, 10, "the loop to take the blocker")

    def device_assert(batch):
        raise DEVICE_ASSERT

    engine.runner.next_ids = device_assert
    outcomes: dict[str, BaseException] = {}

    def ask(session_id):
        try:
            engine.ask(session_id, QUESTIONS[0])
        except Exception as error:
            outcomes[session_id] = error

    threads = [threading.Thread(target=ask, args=(s,)) for s in (first, second)]
    for thread in threads:
        thread.start()
    wait_until(lambda: engine.loop._inbox.qsize() == 2, 10, "both asks queued")
    release.set()
    for thread in [blocker, *threads]:
        thread.join(timeout=60)
    assert all(isinstance(outcomes.get(s), ShardFailed) for s in (first, second)), outcomes
    assert "device failed (AcceleratorError)" in outcomes[first].message
    wait_until(lambda: not engine.loop._thread.is_alive(), 10, "the loop thread to end")
    assert not engine.loop.alive and told == [DEVICE_ASSERT]
    with pytest.raises(ShardFailed):  # refused at once, not queued for a loop that is gone
        engine.ask(first, QUESTIONS[1])
    assert told == [DEVICE_ASSERT]


@pytest.mark.parametrize(
    "error, answered",
    [
        (RuntimeError("an ordinary bug"), RuntimeError),
        (torch.cuda.OutOfMemoryError("CUDA out of memory"), Busy),  # KV_MEMORY_FULL, to retry
    ],
)
def test_a_step_error_that_leaves_the_device_usable_fails_its_turn_alone(
    demo_model, error, answered
):
    sample = held_out_samples(1, seed=63_000)[0]
    engine = new_engine(demo_model)
    told: list[BaseException] = []
    engine.on_fatal = told.append
    session_id = engine.open(sample.image).session_id
    step = engine.runner.next_ids

    def failing_step(batch):
        raise error

    engine.runner.next_ids = failing_step
    with pytest.raises(answered):
        engine.ask(session_id, QUESTIONS[0])
    engine.runner.next_ids = step
    assert engine.loop.alive and told == []
    assert engine.ask(session_id, QUESTIONS[0]).text == sample.color
