"""Engine shards on the CPU: two shards ("cpu,cpu"), each its own demo model copy, loop
thread, KV pool and memory manager: the same code path as two GPUs
(docs/engine/scheduling.md §Engine shards)."""

from __future__ import annotations

import threading

import pytest

from demo_model.synthetic import held_out_samples
from llava import shards as shards_module
from llava.config import EngineConfig, SettingsError, load_config
from llava.engine import Engine
from llava.errors import InvalidRequest, SessionIdInUse, SessionNotFound, ShardFailed
from llava.kv.budget import MemoryBudget
from llava.kv.holding import Tier
from llava.shards import FAILURES_UNTIL_UNREADY, ShardedEngine
from scripts.handler_harness import InProcessWorker
from tests.conftest import DEMO_MODEL_DIR
from tests.memory_helpers import FakeClock

BLOCK = 36_864  # the demo model's KV block (tests/test_handler_in_process.py)
HOST_BUDGET = 40 * BLOCK  # the instance's host tier: 20 blocks per shard
QUESTIONS = ["What color is the shape?", "And its shape?", "Say that again."]
SESSION = "X-Amzn-SageMaker-Session-Id"


@pytest.fixture(scope="module")
def clock():
    return FakeClock()


@pytest.fixture(scope="module")
def sharded(clock):
    config = EngineConfig(
        model_dir=str(DEMO_MODEL_DIR),
        device="cpu,cpu",
        session_budget_bytes=300 * BLOCK,
        host_budget_bytes=HOST_BUDGET,
        session_ttl_s=60,
        # these tests reuse images and count bytes: every open computes and holds its own
        prefix_sharing="off",
    )
    engine = ShardedEngine.from_config(config, clock=clock)
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def images():
    return [s.image for s in held_out_samples(8, seed=29_000)]


@pytest.fixture(scope="module")
def first_answers(demo_model, images) -> list[tuple[int, ...]]:
    """The greedy ids of QUESTIONS[0] as the first turn about images[0] and images[1], each on
    a plain engine's session that never moved or failed: what a shard's answers must equal."""
    alone = Engine(demo_model, EngineConfig(model_dir="-"), MemoryBudget(1 << 30))
    try:
        return [alone.ask(alone.open(i).session_id, QUESTIONS[0]).token_ids for i in images[:2]]
    finally:
        alone.stop()


def close_all(sharded, ids):
    for session_id in ids:
        sharded.close(session_id)


def test_each_shard_is_its_own_engine_and_the_host_budget_is_shared(sharded):
    first, second = sharded.shards
    assert first.loaded.model is not second.loaded.model  # a model copy per shard
    assert first.loop is not second.loop and first.memory.pool is not second.memory.pool
    hosts = [e.memory.budget.host_bytes for e in sharded.shards]
    assert hosts == [HOST_BUDGET // 2] * 2 and sum(hosts) <= HOST_BUDGET
    assert [s.device for s in sharded.stats()] == ["cpu", "cpu"]
    assert all(s.ready for s in sharded.stats())


def test_opens_go_to_the_shard_with_the_most_free_memory(sharded, images):
    ids = [sharded.open(image).session_id for image in images[:4]]
    try:
        # equal sessions: the emptier shard wins, ties go to the first
        assert [sharded.shard_of(i) for i in ids] == [0, 1, 0, 1]
        for index, engine in enumerate(sharded.shards):
            assert {i for i in ids if i in engine.store} == {
                i for i in ids if sharded.shard_of(i) == index
            }
        sharded.close(ids[0])  # shard 0 now holds less: the next open goes there
        ids[0] = sharded.open(images[4]).session_id
        assert sharded.shard_of(ids[0]) == 0
    finally:
        close_all(sharded, ids)


def test_an_open_goes_to_the_shard_that_holds_its_image_while_it_has_room(images):
    config = EngineConfig(model_dir=str(DEMO_MODEL_DIR), device="cpu,cpu")
    sharded = ShardedEngine.from_config(config)
    try:
        first = sharded.open(images[0]).session_id
        holder = sharded.shard_of(first)  # now the fuller shard
        again = sharded.open(images[0])
        assert sharded.shard_of(again.session_id) == holder and again.cached_tokens > 0
        assert sharded.shard_of(sharded.open(images[1]).session_id) != holder  # the emptier
    finally:
        sharded.stop()


def test_an_open_of_another_tenant_is_placed_as_if_no_shard_held_its_image(images):
    config = EngineConfig(model_dir=str(DEMO_MODEL_DIR), device="cpu,cpu")
    sharded = ShardedEngine.from_config(config)
    try:
        holder = sharded.shard_of(sharded.open(images[0], tenant="acme").session_id)
        other = sharded.open(images[0], tenant="globex")  # to the emptier shard, computed anew
        assert sharded.shard_of(other.session_id) != holder and other.cached_tokens == 0
        same = sharded.open(images[0], tenant="acme")
        assert sharded.shard_of(same.session_id) == holder and same.cached_tokens > 0
    finally:
        sharded.stop()


def test_placement_counts_an_open_in_flight_as_what_an_open_holds(sharded, images):
    """Before any open has returned, the facade's estimate is Engine.open_bytes."""
    session_id = sharded.open(images[0]).session_id
    engine = sharded.shards[sharded.shard_of(session_id)]
    held = engine.memory.held_bytes(engine.store.session(session_id).holding)
    assert held == engine.open_bytes() > 0
    sharded.close(session_id)


def test_simultaneous_opens_spread_across_the_shards(sharded, images):
    ids, start = [], threading.Barrier(6, timeout=60)

    def client(image):
        start.wait()
        ids.append(sharded.open(image).session_id)

    threads = [threading.Thread(target=client, args=(image,)) for image in images[:6]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        assert len(ids) == 6
        per_shard = [sum(sharded.shard_of(i) == s for i in ids) for s in (0, 1)]
        assert per_shard == [3, 3]
    finally:
        close_all(sharded, ids)


def test_every_turn_runs_on_its_sessions_shard(sharded, images):
    ids = [sharded.open(image).session_id for image in images[:2]]
    try:
        on_second = next(i for i in ids if sharded.shard_of(i) == 1)
        steps = [e.loop.steps for e in sharded.shards]
        for question in QUESTIONS:
            sharded.ask(on_second, question, {"max_new_tokens": 4})
        assert sharded.shards[0].loop.steps == steps[0]  # shard 0 ran nothing
        assert sharded.shards[1].loop.steps > steps[1]
        assert sharded.shards[1].store.counters().turns >= len(QUESTIONS)
    finally:
        close_all(sharded, ids)


def test_answers_equal_one_shard_answers(sharded, demo_model, images):
    """Greedy answers of sessions spread over two shards, token for token the answers of the
    same conversations on one plain engine."""
    alone = Engine(demo_model, EngineConfig(model_dir="-"), MemoryBudget(1 << 30))
    try:
        expected = []
        for image in images[:2]:
            session_id = alone.open(image).session_id
            expected.append([alone.ask(session_id, q).token_ids for q in QUESTIONS])
        ids = [sharded.open(image).session_id for image in images[:2]]
        assert {sharded.shard_of(i) for i in ids} == {0, 1}
        got = [[sharded.ask(i, q).token_ids for q in QUESTIONS] for i in ids]
        close_all(sharded, ids)
    finally:
        alone.stop()
    assert got == expected


def test_a_failing_shard_fails_only_its_own_turns(sharded, images, first_answers, monkeypatch):
    """Injected: shard 1's runner raises on every step (what a device fault does to it); the
    loop and memory code around it are the real ones."""
    ids = [sharded.open(image).session_id for image in images[:2]]
    healthy, failing = sorted(ids, key=sharded.shard_of)
    before = sharded.ask(healthy, QUESTIONS[0]).text

    def device_fault(inputs):
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(sharded.shards[1].runner, "next_ids", device_fault)
    results: dict[str, object] = {}

    def call(session_id):
        try:
            results[session_id] = sharded.ask(session_id, QUESTIONS[0]).text
        except Exception as error:  # the failing shard's typed error
            results[session_id] = error

    threads = [threading.Thread(target=call, args=(i,)) for i in (healthy, failing)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results[healthy] == before
    assert isinstance(results[failing], ShardFailed)
    assert results[failing].code == "SHARD_FAILED" and "shard 1" in results[failing].message
    # shard 1 now holds less (the failed turn's KV was dropped): an open is placed there,
    # and fails alone too
    with pytest.raises(ShardFailed):
        sharded.open(images[2])
    with pytest.raises(ShardFailed):
        sharded.ask(failing, QUESTIONS[1])
    assert [s.ready for s in sharded.stats()] == [True, False]  # three failures in a row
    elsewhere = sharded.open(images[3]).session_id  # so new sessions go to shard 0
    assert sharded.shard_of(elsewhere) == 0
    monkeypatch.undo()  # the fault clears: the failed session answers again, history kept
    again = sharded.ask(failing, QUESTIONS[0])
    assert again.tier is Tier.FEATURES and again.text
    assert again.token_ids == first_answers[ids.index(failing)]  # as if it had never failed
    assert [s.ready for s in sharded.stats()] == [True, True]
    sharded.check_integrity()
    close_all(sharded, [*ids, elsewhere])
    assert all(s.engine.sessions == 0 for s in sharded.stats())


def test_memory_is_accounted_per_shard_exactly(sharded, images):
    ids = [sharded.open(image).session_id for image in images[:4]]
    try:
        for session_id in ids:
            sharded.ask(session_id, QUESTIONS[0], {"max_new_tokens": 4})
        first = sharded.shards[0]
        moved = next(i for i in ids if sharded.shard_of(i) == 0)
        assert first.memory.move_down(first.store.session(moved).holding) is Tier.HOST
        sharded.check_integrity()
        for index, shard in enumerate(sharded.stats()):
            engine = sharded.shards[index]
            mine = [i for i in ids if sharded.shard_of(i) == index]
            held = sum(engine.memory.held_bytes(engine.store.session(i).holding) for i in mine)
            assert shard.engine.total_bytes == held and shard.engine.sessions == len(mine)
            host = shard.engine.bytes_by_tier[Tier.HOST]
            assert (host > 0) == (index == 0) and host <= shard.engine.budget.host_bytes
    finally:
        close_all(sharded, ids)
    for engine in sharded.shards:
        assert engine.memory.pool.free_blocks == engine.memory.pool.total_blocks
        assert engine.stats().total_bytes == 0


def test_a_chosen_id_is_unique_across_the_shards(sharded, images):
    first = sharded.open(images[0], "conversation-29-7f3a9c2e1b4d6a8f0c5e").session_id
    assert sharded.shard_of(first) == 0
    with pytest.raises(SessionIdInUse):  # placement would pick shard 1: it is still refused
        sharded.open(images[1], "conversation-29-7f3a9c2e1b4d6a8f0c5e")
    sharded.close(first)
    with pytest.raises(SessionIdInUse, match="used recently"):
        sharded.open(images[1], "conversation-29-7f3a9c2e1b4d6a8f0c5e")
    assert sharded.close("conversation-29-7f3a9c2e1b4d6a8f0c5e") == "SESSION_CLOSED"
    with pytest.raises(SessionNotFound, match="not known to this server"):
        sharded.ask("never-opened", "Hi")


def test_one_chosen_id_opened_twice_at_once_opens_once(sharded, images):
    """Two opens race for one id: whichever is second is refused, on either shard."""
    results, start = [], threading.Barrier(2, timeout=60)

    def client(image):
        start.wait()
        try:
            results.append(sharded.open(image, "raced-29-7f3a9c2e1b4d6a8f0c5e").session_id)
        except SessionIdInUse as error:
            results.append(error)

    threads = [threading.Thread(target=client, args=(image,)) for image in images[:2]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(map(type, results), key=str) == sorted([str, SessionIdInUse], key=str)
    assert sum("raced-29-7f3a9c2e1b4d6a8f0c5e" in engine.store for engine in sharded.shards) == 1
    sharded.check_integrity()
    sharded.close("raced-29-7f3a9c2e1b4d6a8f0c5e")


def test_a_session_the_facade_did_not_open_is_found_on_its_shard(sharded, images, first_answers):
    """As a session re-attached by a shard at start would be: opened on shard 1 directly."""
    direct = sharded.shards[1].open(images[0], "direct-29-7f3a9c2e1b4d6a8f0c5e").session_id
    assert sharded.shard_of(direct) == 1
    answer = sharded.ask(direct, QUESTIONS[0])
    assert answer.text and answer.token_ids == first_answers[0]
    with pytest.raises(SessionIdInUse):
        sharded.open(images[1], "direct-29-7f3a9c2e1b4d6a8f0c5e")
    sharded.check_integrity()
    assert sharded.close(direct) is None


def test_sessions_expire_on_their_own_shard(sharded, images, clock):
    ids = [sharded.open(image).session_id for image in images[:2]]
    assert {sharded.shard_of(i) for i in ids} == {0, 1}
    clock.now += 61
    assert sharded.reap() == 2
    for session_id in ids:
        with pytest.raises(SessionNotFound) as gone:
            sharded.ask(session_id, "Hi")
        assert gone.value.code == "SESSION_EXPIRED"
    assert all(s.engine.store.expired >= 1 for s in sharded.stats())


def test_through_the_handler_a_failing_shard_answers_a_typed_500(sharded, monkeypatch):
    worker = InProcessWorker(sharded)
    try:
        ids = []
        for _ in range(2):
            reply = worker.invoke({"requestType": "NEW_SESSION"})
            assert reply.status == 200, reply.text
            ids.append(reply.json()["sessionId"])
        healthy, failing = sorted(ids, key=sharded.shard_of)
        monkeypatch.setattr(  # injected, as above: shard 1's steps raise
            sharded.shards[1].runner, "next_ids", lambda inputs: 1 / 0
        )
        body = {"requestType": "SESSION", "inputs": "Hi", "parameters": {"max_new_tokens": 2}}
        bad = worker.invoke(body, {SESSION: failing})
        assert bad.status == 500 and bad.json()["error"]["code"] == "SHARD_FAILED"
        assert worker.invoke(body, {SESSION: healthy}).status == 200
    finally:
        monkeypatch.undo()
        worker.stop()
        close_all(sharded, ids)


def test_a_bad_device_setting_fails_the_start_in_one_line(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # as on this CPU host
    with pytest.raises(SettingsError) as raised:
        load_config({}, {"LLAVA_DEVICE": "cpu;cpu"}, str(DEMO_MODEL_DIR))
    assert str(raised.value).startswith("bad setting LLAVA_DEVICE: 'cpu;cpu' is not auto, or")
    config = EngineConfig(model_dir=str(DEMO_MODEL_DIR), device="cpu,cuda:1")
    with pytest.raises(SettingsError) as raised:
        ShardedEngine.from_config(config)
    line = "bad setting device: 'cpu,cuda:1' names cuda:1, but CUDA is not available here"
    assert str(raised.value) == line


def test_a_shard_that_cannot_be_built_fails_the_start_and_stops_the_others(demo_model, monkeypatch):
    """Injected: the second shard's engine raises while it is built (as a pool that cannot
    be allocated would); the load is the shared demo model, to keep this cheap."""
    built = []

    def engine_or_fault(*args, **kwargs):
        if built:
            raise RuntimeError("injected: the second shard cannot allocate its pool")
        built.append(Engine(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(shards_module, "load_model", lambda *args: demo_model)
    monkeypatch.setattr(shards_module, "Engine", engine_or_fault)
    config = EngineConfig(
        model_dir="-", device="cpu,cpu", session_budget_bytes=64 * BLOCK, host_budget_bytes=0
    )
    with pytest.raises(RuntimeError, match="injected"):
        ShardedEngine.from_config(config)
    assert len(built) == 1 and not built[0].loop.alive


def test_gpu_checks_shard_table_runs_on_two_cpu_shards():
    """make gpu-check runs it on "cuda:0,cuda:0"; here its code path on the CPU."""
    from scripts.gpu.steps import shard_table

    _tokens_per_s, rows = shard_table("cpu,cpu", 4, 3, 300 * BLOCK)
    assert rows == [("cpu", 2, 12), ("cpu", 2, 12)]


# Two two-shard workers, one after the other (four model loads): make test-fast keeps a restart
# on one engine (test_persist.py's test_a_new_engine_continues_a_session_as_if_nothing_happened)
# and a session a shard holds that the facade did not open
# (test_a_session_the_facade_did_not_open_is_found_on_its_shard).
@pytest.mark.thorough
def test_a_restarted_two_shard_worker_continues_each_session_on_its_shard(images, tmp_path):
    """The persistent tier with shards: shard k keeps its entries in <persist_dir>/shard-k
    with half the cap, so a new worker with the same devices re-attaches every session to the
    shard that held it, and its next answer equals an uninterrupted session's."""
    config = EngineConfig(
        model_dir=str(DEMO_MODEL_DIR),
        device="cpu,cpu",
        session_budget_bytes=300 * BLOCK,
        persist_dir=str(tmp_path),
        persist_max_bytes=1 << 24,
    )
    first = ShardedEngine.from_config(config)
    ids = [first.open(image).session_id for image in images[:2]]
    for session_id in ids:
        for question in QUESTIONS[:2]:
            first.ask(session_id, question)
    homes = {i: first.shard_of(i) for i in ids}
    expected = {}
    for image, session_id in zip(images[:2], ids, strict=True):  # uninterrupted, closed again
        control = first.open(image).session_id
        expected[session_id] = [first.ask(control, q).text for q in QUESTIONS][-1]
        first.close(control)
    assert sorted(homes.values()) == [0, 1]
    assert [e.persistent.journal.max_bytes for e in first.shards] == [1 << 23] * 2
    first.stop()  # the worker "dies": only the directory is used below

    for session_id, home in homes.items():
        assert (tmp_path / f"shard-{home}" / f"{session_id}.state").exists()
    second = ShardedEngine.from_config(config)
    try:
        assert [e.adopted for e in second.shards] == [1, 1]
        for session_id, home in homes.items():
            assert second.ask(session_id, QUESTIONS[2]).text == expected[session_id]
            assert second.shard_of(session_id) == home
    finally:
        second.stop()


def test_a_top_k_past_the_vocabulary_is_answered_and_its_shard_stays_ready(sharded, images):
    """The wire allows top_k up to 1,000,000: it cuts nothing past the vocabulary (unclamped
    it indexed past the logits row, a SHARD_FAILED counted against the shard)."""
    session_id = sharded.open(images[0]).session_id
    params = {"top_k": 1_000_000, "seed": 3, "max_new_tokens": 4}
    answer = sharded.ask(session_id, QUESTIONS[0], params)
    assert answer.finished or len(answer.token_ids) == 4
    assert [s.ready for s in sharded.stats()] == [True, True]
    assert sharded.ask(session_id, QUESTIONS[1]).turns == 2  # the session goes on
    close_all(sharded, [session_id])


def test_a_callers_bad_text_is_refused_and_never_counts_against_its_shard(
    sharded, images, first_answers
):
    """A lone surrogate made the tokenizer raise TypeError inside the loop: a SHARD_FAILED,
    and three in a row took the shard out of placement."""
    session_id = sharded.open(images[0]).session_id
    for _ in range(FAILURES_UNTIL_UNREADY + 1):
        with pytest.raises(InvalidRequest, match="'inputs' cannot be tokenized"):
            sharded.ask(session_id, "What \ud800 color?")
        with pytest.raises(InvalidRequest, match="'system' cannot be tokenized"):
            sharded.open(images[1], system="Be \udfff brief.")
    assert [s.ready for s in sharded.stats()] == [True, True]
    answer = sharded.ask(session_id, QUESTIONS[0])
    assert answer.text and answer.token_ids == first_answers[0]  # the refusals left no trace
    close_all(sharded, [session_id])


def test_every_shard_failing_is_fatal_and_told_once(sharded, images, first_answers, monkeypatch):
    told: list[BaseException] = []
    monkeypatch.setattr(sharded, "on_fatal", told.append)
    monkeypatch.setattr(sharded, "_fatal_told", False)
    opened = [sharded.open(image).session_id for image in images[:2]]
    ids = sorted(opened, key=sharded.shard_of)
    assert [sharded.shard_of(i) for i in ids] == [0, 1]

    def device_fault(inputs):
        raise RuntimeError("injected fault")

    for engine in sharded.shards:
        monkeypatch.setattr(engine.runner, "next_ids", device_fault)
    for session_id, told_after in zip(ids, ([], [ShardFailed]), strict=True):
        for _ in range(FAILURES_UNTIL_UNREADY):
            with pytest.raises(ShardFailed):
                sharded.ask(session_id, QUESTIONS[0])
        assert [type(error) for error in told] == told_after  # one shard left: not yet
    with pytest.raises(ShardFailed):
        sharded.ask(ids[0], QUESTIONS[0])
    assert len(told) == 1  # told once
    monkeypatch.undo()
    answers = [sharded.ask(session_id, QUESTIONS[0]) for session_id in ids]
    assert all(answer.text for answer in answers)
    assert [a.token_ids for a in answers] == [first_answers[opened.index(i)] for i in ids]
    close_all(sharded, ids)
