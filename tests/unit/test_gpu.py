"""The engine on CUDA: skipped cleanly where there is none (CI never has one)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import Busy
from llava.kv.holding import Tier
from llava.shards import ShardedEngine
from tests.conftest import DEMO_MODEL_DIR
from tests.unit.test_engine import CONVERSATION, full_recompute, prompt_of_last_turn
from tests.unit.test_engine_loop import record_batch_sizes

# The demo model's engines get a bounded pool: the device's default share would be millions of
# its tiny blocks, and every step's block tables and mask are as wide as the pool.
POOL_BYTES = 1 << 30

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sessions_on_cuda_answer_and_reuse_their_cache(sample, dtype):
    engine = Engine.from_config(
        EngineConfig(
            model_dir=str(DEMO_MODEL_DIR),
            device="cuda",
            dtype=dtype,
            session_budget_bytes=POOL_BYTES,
        )
    )
    assert engine.loaded.device.type == "cuda"
    session_id = engine.open(sample.image).session_id
    answer = engine.ask(session_id, "What color is the shape?")
    assert answer.text == sample.color and answer.tier is Tier.KV
    assert engine.stats().bytes_by_tier[Tier.KV] > 0
    if dtype == "float32":  # token-exact equality is a fp32 promise
        for question in CONVERSATION[1:]:
            answer = engine.ask(session_id, question, {"max_new_tokens": 6})
            prompt = prompt_of_last_turn(engine, session_id, answer)
            expected = full_recompute(engine, prompt, sample.image, 6)
            assert list(answer.token_ids) == expected, question
    engine.close(session_id)
    assert engine.stats().total_bytes == 0


def test_two_shards_on_one_gpu_load_there_and_split_its_memory():
    """The last GPU (not merely the current one), named twice: two shards share it."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    config = EngineConfig(model_dir=str(DEMO_MODEL_DIR), device=f"{device},{device}")
    sharded = ShardedEngine.from_config(config)
    try:
        _free, total = torch.cuda.mem_get_info(device)
        for engine in sharded.shards:
            assert {p.device for p in engine.loaded.model.parameters()} == {device}
            budget = engine.memory.budget.device_bytes
            assert 0 < budget <= total * config.session_budget_fraction / 2
    finally:
        sharded.stop()


def test_a_turn_restored_from_pinned_host_memory_answers_as_never_moved(sample):
    """The CUDA host tier: pinned memory and a side stream (not run where there is no GPU)."""
    config = EngineConfig(
        model_dir=str(DEMO_MODEL_DIR),
        device="cuda",
        dtype="float32",
        session_budget_bytes=POOL_BYTES,
    )
    engine = Engine.from_config(config)
    moved, kept = (engine.open(sample.image).session_id for _ in range(2))
    for session_id in (moved, kept):
        engine.ask(session_id, CONVERSATION[0], {"max_new_tokens": 6})
    holding = engine.store.session(moved).holding
    assert engine.memory.move_down(holding) is Tier.HOST
    assert holding.host.data.is_pinned()
    restored = engine.ask(moved, CONVERSATION[1], {"max_new_tokens": 6})
    never_moved = engine.ask(kept, CONVERSATION[1], {"max_new_tokens": 6})
    assert restored.tier is Tier.HOST and restored.token_ids == never_moved.token_ids
    engine.check_integrity()


def batched_and_alone(engine_for, images) -> tuple[list, list]:
    """Greedy answers of 8 sessions asked at once, and of each asked alone."""
    alone_engine = engine_for(max_batch=1)
    alone = [
        alone_engine.ask(alone_engine.open(image).session_id, "What color is the shape?").text
        for image in images
    ]
    engine = engine_for(max_batch=8)
    ids = [engine.open(image).session_id for image in images]
    with ThreadPoolExecutor(len(ids)) as pool:
        batched = list(pool.map(lambda s: engine.ask(s, "What color is the shape?").text, ids))
    return batched, alone


def cuda_engine(
    dtype: str, prefix_sharing: str = "opening", system_prompt: str = "", **settings
) -> Engine:
    config = EngineConfig(
        model_dir=str(DEMO_MODEL_DIR),
        device="cuda",
        dtype=dtype,
        session_budget_bytes=POOL_BYTES,
        prefix_sharing=prefix_sharing,
        system_prompt=system_prompt,
        **settings,
    )
    engine = Engine.from_config(config)
    engine.warm_up()  # captures the decode graphs
    return engine


def test_decode_graphs_are_captured_and_answer_as_the_eager_step():
    images = [s.image for s in held_out_samples(8, seed=35_000)]
    engine = cuda_engine("float32", max_batch=8)
    assert sorted(engine.runner.graphs.steps) == [1, 2, 4, 8]
    assert engine.runner.graphs.reserved_bytes > 0
    ids = [engine.open(image).session_id for image in images]
    with ThreadPoolExecutor(8) as pool:
        replayed = list(pool.map(lambda s: engine.ask(s, "And its shape?").token_ids, ids))
    engine.runner.graphs = None  # the same turns again, eagerly
    eager = [engine.ask(engine.open(i).session_id, "And its shape?").token_ids for i in images]
    assert replayed == eager


def test_bf16_batched_answers_equal_each_alone():
    """bf16 tolerance: batching changes the matmul shapes and so the rounding; on the demo
    model's answers (one word, large margins) every answer must still be the same."""
    images = [s.image for s in held_out_samples(8, seed=36_000)]
    batched, alone = batched_and_alone(lambda **o: cuda_engine("bfloat16", **o), images)
    assert batched == alone


def test_shared_prefix_blocks_on_cuda_answer_as_an_engine_that_shares_nothing():
    """Sessions on one image and system prompt reference the same pool blocks; the paged
    attention and the decode graphs read them where they lie (fp32: token-exact)."""
    system = "You answer about one picture, in one word."
    image = held_out_samples(1, seed=37_000)[0].image
    answers = {share: four_sessions_on(image, system, share) for share in (False, True)}
    assert answers[True] == answers[False]


def four_sessions_on(image, system: str, share: bool) -> list[tuple[int, ...]]:
    """Two turns of four sessions on one image and the operator's system prompt, asked at
    once (the decode graphs' batches)."""
    sharing = "opening" if share else "off"
    engine = cuda_engine("float32", sharing, system, max_batch=4)
    ids = [engine.open(image).session_id for _ in range(4)]
    assert engine.memory.stats().counters.prefix_hits == (3 if share else 0)

    def two_turns(session_id: str) -> tuple[int, ...]:
        first = engine.ask(session_id, "What color is the shape?", {"max_new_tokens": 6})
        return first.token_ids + engine.ask(session_id, "And its shape?").token_ids

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(two_turns, ids))
    engine.check_integrity()
    return answers


def fill_device(device: torch.device) -> list[torch.Tensor]:
    """Take every byte the device can still hand out, in halving sizes down to 512 B (the
    allocator's smallest block), its cached blocks too: afterwards no allocation succeeds."""
    ballast: list[torch.Tensor] = []
    size = torch.cuda.mem_get_info(device)[0]
    while size >= 512:
        try:
            ballast.append(torch.empty(size, dtype=torch.uint8, device=device))
        except torch.cuda.OutOfMemoryError:
            size //= 2
    return ballast


def test_a_full_device_answers_kv_memory_full_and_the_worker_keeps_serving():
    """Every byte the device had free taken (another process, a leak): turns and opens are
    answered or refused KV_MEMORY_FULL, never an out-of-memory error; with the memory back,
    every session goes on."""
    samples = held_out_samples(6, seed=38_000)
    engine = cuda_engine("float32", max_batch=4)
    ids = [engine.open(s.image).session_id for s in samples[:3]]
    device = engine.loaded.device
    outcomes = []
    ballast = fill_device(device)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(512, dtype=torch.uint8, device=device)
        with ThreadPoolExecutor(6) as pool:
            asked = [pool.submit(engine.ask, i, "And its shape?") for i in ids]
            opened = [pool.submit(engine.open, s.image) for s in samples[3:]]
            for future in asked + opened:
                try:
                    future.result()  # anything but Busy fails the test
                    outcomes.append("answered")
                except Busy as refused:
                    outcomes.append(refused.code)
    finally:
        del ballast
        torch.cuda.empty_cache()
    assert "KV_MEMORY_FULL" in outcomes and set(outcomes) <= {"answered", "KV_MEMORY_FULL"}
    assert engine.stats().runner.device_out_of_memory >= outcomes.count("KV_MEMORY_FULL")
    engine.check_integrity()
    for session_id in ids:  # answered or refused, each session goes on
        assert engine.ask(session_id, "What color is the shape?").text
    assert engine.ask(engine.open(samples[5].image).session_id, "And its shape?").text


def test_a_top_k_past_the_vocabulary_batched_with_other_turns_is_answered_and_they_go_on():
    """The wire allows top_k up to 1,000,000 (hardening: it cuts nothing past the vocabulary);
    on CUDA, in one batch with greedy turns, then every session's next turn."""
    samples = held_out_samples(4, seed=39_000)
    engine = cuda_engine("bfloat16", max_batch=4)
    ids = [engine.open(s.image).session_id for s in samples]
    sizes = record_batch_sizes(engine)
    params = [{"max_new_tokens": 8}] * 3 + [{"top_k": 1_000_000, "seed": 3, "max_new_tokens": 8}]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i, p: engine.ask(i, "What color is the shape?", p), ids,
                                params))  # fmt: skip
    assert max(sizes) > 1 and all(a.token_ids for a in answers)
    for session_id in ids:
        assert engine.ask(session_id, "And its shape?").turns == 2
    engine.check_integrity()
