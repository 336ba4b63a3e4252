"""The durable store (llava/sessions/durable.py, objects.py, writeback.py): sessions that
outlive their instance, resumed by another engine token for token; a store that stalls or
fails never holds up a turn and loses nothing it had; every bad record refused with its own
code (docs/engine/sessions.md §Durable store).

Two engines on two persistent-tier directories and one durable directory stand for two
instances of an endpoint; the S3 tests run the same code against moto's S3 server on loopback
(no AWS here)."""

from __future__ import annotations

import base64
import dataclasses
import os
import threading
import time

import pytest

from llava.config import EngineConfig, SettingsError
from llava.engine import Engine
from llava.errors import (
    DurableStoreOff,
    RecordCorrupt,
    RecordExpired,
    RecordForeign,
    RecordNotFound,
    SessionNotFound,
)
from llava.kv.budget import MemoryBudget
from llava.sessions import writeback
from llava.sessions.durable import DurableSessions, record_name
from llava.sessions.objects import DirectoryObjects, StoreError
from llava.sessions.record import Snapshot
from llava.sessions.session import Tier

QUESTIONS = ["What shape is it?", "And its color?", "Say that again.", "What color is the shape?"]


def instance(demo_model, tmp_path, name: str, **settings) -> Engine:
    """One instance's engine: its own persistent tier, the shared durable directory."""
    settings = {"durable_store": str(tmp_path / "durable"), **settings}
    config = EngineConfig(model_dir="unused", persist_dir=str(tmp_path / name), **settings)
    return Engine(demo_model, config, MemoryBudget(1 << 30))


def names(tmp_path, kind: str) -> list[str]:
    folder = tmp_path / "durable" / kind
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_session_resumed_on_another_instance_answers_as_if_never_moved(
    demo_model, sample, tmp_path
):
    first = instance(demo_model, tmp_path, "a")
    twin = first.open(sample.image).session_id
    expected = [first.ask(twin, q).token_ids for q in QUESTIONS]
    opened = first.open(sample.image)
    for question in QUESTIONS[:3]:
        first.ask(opened.session_id, question)
    assert first.flush_durable(10) == []
    assert len(names(tmp_path, "features")) == 1  # both sessions' image, written once
    first.stop()  # the instance goes, its disk with it: only the durable store is left

    second = instance(demo_model, tmp_path, "b")
    resumed = second.resume(opened.session_id)
    assert resumed.session_id != opened.session_id
    assert (resumed.resumed.from_session_id, resumed.resumed.turns) == (opened.session_id, 3)
    assert resumed.resumed.images == 1 and resumed.image_tokens > 0
    assert second.store.session(resumed.session_id).tier is Tier.PERSISTED  # parked
    answer = second.ask(resumed.session_id, QUESTIONS[3])
    assert answer.token_ids == expected[3] and answer.turns == 4
    assert second.flush_durable(10) == []
    # the new record replaces the old one: the old id is resumed no more
    assert names(tmp_path, "sessions") == sorted(
        record_name(i).split("/")[1] for i in (twin, resumed.session_id)
    )
    with pytest.raises(RecordNotFound):
        second.resume(opened.session_id)


def test_a_call_for_an_id_only_the_store_holds_adopts_it_under_that_id(
    demo_model, sample, tmp_path
):
    first = instance(demo_model, tmp_path, "a")
    twin = first.open(sample.image).session_id
    expected = [first.ask(twin, q).text for q in QUESTIONS[:2]]
    session_id = first.open(sample.image).session_id
    first.ask(session_id, QUESTIONS[0])
    expires = first.store.expires_at(first.store.session(session_id))
    first.flush_durable(10)
    first.stop()

    second = instance(demo_model, tmp_path, "b")
    answer = second.ask(session_id, QUESTIONS[1])
    assert answer.text == expected[1] and answer.turns == 2
    assert answer.tier is Tier.PERSISTED and answer.expires_at >= expires
    with pytest.raises(SessionNotFound):  # an id no one wrote stays unknown
        second.ask("never-opened-0123456789abcdefXYZ", QUESTIONS[0])


def test_a_resume_takes_the_features_this_instance_holds_not_the_stores(
    demo_model, sample, tmp_path
):
    first = instance(demo_model, tmp_path, "a")
    session_id = first.open(sample.image).session_id
    first.ask(session_id, QUESTIONS[0])
    first.flush_durable(10)
    for path in (tmp_path / "durable" / "features").iterdir():
        path.unlink()  # were they read, the resume would fail as corrupt
    resumed = first.resume(session_id)
    assert first.ask(resumed.session_id, QUESTIONS[1]).turns == 2


def test_close_and_expiry_delete_the_record_and_eviction_keeps_it(demo_model, sample, tmp_path):
    engine = instance(demo_model, tmp_path, "a", session_ttl_s=60)
    closed = engine.open(sample.image).session_id
    kept = engine.open(None).session_id
    engine.flush_durable(10)
    assert len(names(tmp_path, "sessions")) == 2
    engine.close(closed)
    engine.flush_durable(10)
    assert names(tmp_path, "sessions") == [record_name(kept).split("/")[1]]
    with pytest.raises(RecordNotFound):
        engine.resume(closed)


def test_bad_records_are_refused_each_with_its_code_and_nothing_else_touched(
    demo_model, sample, tmp_path
):
    engine = instance(demo_model, tmp_path, "a", session_ttl_s=2)
    session_id = engine.open(sample.image).session_id
    other = engine.open(None, tenant="tenant-b").session_id
    engine.flush_durable(10)
    path = tmp_path / "durable" / record_name(session_id)
    whole = path.read_bytes()

    with pytest.raises(RecordNotFound):  # another tenant's record: as if there were none
        engine.resume(other)
    path.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    with pytest.raises(RecordCorrupt):
        engine.resume(session_id)
    foreign = DurableSessions(DirectoryObjects(tmp_path / "durable"), "another-model", 10**6)
    snapshot = dataclasses.replace(engine.durable.read(other, time.time()).snapshot)
    path.write_bytes(
        foreign.record_object(dataclasses.replace(snapshot, session_id=session_id), [])
    )
    with pytest.raises(RecordForeign):
        engine.resume(session_id)
    path.write_bytes(whole)
    later = time.time() + 3
    with pytest.raises(RecordExpired):
        engine.durable.read(session_id, later)
    assert engine.resume(other, tenant="tenant-b").resumed.turns == 0  # untouched


def test_a_store_that_stalls_never_holds_up_a_turn_and_catches_up(demo_model, sample, tmp_path):
    engine = instance(demo_model, tmp_path, "a")
    stall = Stall(engine)
    session_id = engine.open(sample.image).session_id  # the writer blocks on its put
    assert stall.entered.wait(10)
    answers = [engine.ask(session_id, q) for q in QUESTIONS[:3]]  # answered while stalled
    counters = engine.stats().durable
    # the open's write in flight, and one write waiting with the latest of three turns
    assert counters.pending == 2 and counters.lag_s > 0
    stall.release.set()
    assert engine.flush_durable(10) == []
    record = engine.durable.read(session_id, time.time())
    assert record.snapshot.turns == 3 and answers[-1].turns == 3  # the latest state, once


def test_a_failing_store_loses_nothing_it_had_and_retries(demo_model, sample, tmp_path, caplog):
    engine = instance(demo_model, tmp_path, "a")
    session_id = engine.open(sample.image).session_id
    engine.ask(session_id, QUESTIONS[0])
    engine.flush_durable(10)
    objects = engine.durable.objects
    put = objects.put
    failing = threading.Event()
    failing.set()

    def broken_put(name, data):
        if failing.is_set():
            raise StoreError("throttled")
        put(name, data)

    objects.put = broken_put
    engine.ask(session_id, QUESTIONS[1])  # answered; its write fails and is retried
    deadline = time.monotonic() + 10
    while engine.stats().durable.failures < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().durable.failures >= 2
    assert engine.durable.read(session_id, time.time()).snapshot.turns == 1  # still whole
    failing.clear()
    assert engine.flush_durable(10) == []
    assert engine.durable.read(session_id, time.time()).snapshot.turns == 2
    assert "durable store: write of" in caplog.text


def test_twenty_dirty_sessions_are_flushed_within_the_budget(demo_model, sample, tmp_path):
    engine = instance(demo_model, tmp_path, "a")
    stall = Stall(engine)
    ids = [engine.open(sample.image if i % 2 else None).session_id for i in range(20)]
    assert engine.stats().durable.pending >= 19
    stall.release.set()
    started = time.monotonic()
    assert engine.flush_durable(20) == []
    assert time.monotonic() - started < 20
    assert len(names(tmp_path, "sessions")) == 20
    assert all(engine.durable.read(i, time.time()).snapshot.turns == 0 for i in ids)


def test_a_flush_that_cannot_finish_names_the_sessions_left(demo_model, sample, tmp_path):
    engine = instance(demo_model, tmp_path, "a")
    stall = Stall(engine)  # released only once the flush gave up
    ids = {engine.open(None).session_id for _ in range(3)}
    try:
        assert set(engine.flush_durable(0.3)) == ids
    finally:
        stall.release.set()  # the writer thread is not left blocked


def test_no_id_reaches_a_key_and_no_other_name_is_written(tmp_path):
    objects = DirectoryObjects(tmp_path)
    for bad in ("../escape", "sessions/../../x", "sessions/ABC", "features/" + "0" * 63):
        with pytest.raises(ValueError):
            objects.put(bad, b"x")
    assert list(tmp_path.iterdir()) == []
    name = record_name("../../etc/passwd-abc")
    assert name.startswith("sessions/") and set(name[9:]) <= set("0123456789abcdef")


def test_resuming_without_a_store_says_so(demo_model, sample, tmp_path):
    engine = Engine(demo_model, EngineConfig(model_dir="unused"), MemoryBudget(1 << 30))
    with pytest.raises(DurableStoreOff):
        engine.resume("some-session-id-0123456789abcdef")


def test_a_bad_store_setting_fails_the_start_in_one_line(demo_model, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(SettingsError, match="durable_store.*cannot be used"):
        instance(demo_model, tmp_path, "a", durable_store=str(tmp_path / "file" / "x"))
    with pytest.raises(SettingsError, match="needs the persistent tier"):
        EngineConfig(model_dir="m", durable_store=str(tmp_path))
    with pytest.raises(SettingsError, match="durable_store"):
        EngineConfig(model_dir="m", persist_dir=str(tmp_path), durable_store="s3://Bad_Bucket/x")


class Stall:
    """The engine's store, its record and features writes blocked until ``release``."""

    def __init__(self, engine: Engine):
        self.entered, self.release = threading.Event(), threading.Event()
        objects = engine.durable.objects
        put = objects.put

        def stalled_put(name, data):
            self.entered.set()
            self.release.wait()
            put(name, data)

        objects.put = stalled_put


def test_features_of_one_image_are_one_object_whatever_the_sessions(demo_model, sample, tmp_path):
    engine = instance(demo_model, tmp_path, "a")
    for _ in range(3):
        engine.open(sample.image)
    engine.flush_durable(10)
    assert len(names(tmp_path, "features")) == 1
    assert engine.stats().durable.feature_writes == 1


@pytest.fixture
def workers():
    """In-process workers (the real handler: scripts/handler_harness.py), stopped after the
    test with their reapers."""
    from scripts.handler_harness import InProcessWorker

    made = []

    def worker(engine: Engine) -> InProcessWorker:
        made.append(InProcessWorker(engine))
        return made[-1]

    yield worker
    for each in made:
        each.stop()


def test_the_wire_resume_answers_an_open_that_says_what_it_resumed(
    demo_model, sample, tmp_path, workers
):
    from tests.intake_servers import image_bytes

    first = workers(instance(demo_model, tmp_path, "a"))
    b64 = base64.b64encode(image_bytes(sample.image)).decode()
    session_id = first.invoke({"requestType": "NEW_SESSION", "image": {"b64": b64}}).json()[
        "sessionId"
    ]
    header = {"X-Amzn-SageMaker-Session-Id": session_id}
    assert first.invoke({"requestType": "SESSION", "inputs": QUESTIONS[0]}, header).status == 200
    assert first.service.engine.flush_durable(10) == []
    second = workers(instance(demo_model, tmp_path, "b"))
    resume = {"requestType": "NEW_SESSION", "resumeFrom": session_id}
    with_image = second.invoke({**resume, "image": {"b64": b64}})
    assert (with_image.status, with_image.json()["error"]["code"]) == (400, "INVALID_REQUEST")

    reply = second.invoke(resume, {"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"})
    assert reply.status == 200, reply.text
    body = reply.json()
    assert body["resumed"] == {"from": session_id, "turns": 1, "images": 1}
    new_id = body["sessionId"]
    assert reply.headers["X-Amzn-SageMaker-New-Session-Id"].startswith(f"{new_id}; Expires=")
    assert second.service.engine.flush_durable(10) == []
    again = second.invoke(resume)
    assert (again.status, again.json()["error"]["code"]) == (404, "SESSION_RECORD_NOT_FOUND")
    asked = second.invoke(
        {"requestType": "SESSION", "inputs": QUESTIONS[1]},
        {"X-Amzn-SageMaker-Session-Id": new_id},
    )
    assert asked.status == 200 and asked.json()["turns"] == 2
    assert asked.json()["usage"]["tier"] == "persisted"


def test_shared_features_older_than_the_refresh_age_are_written_again(
    demo_model, sample, tmp_path, monkeypatch
):
    engine = instance(demo_model, tmp_path, "a")
    first = engine.open(sample.image).session_id
    engine.flush_durable(10)
    [name] = names(tmp_path, "features")
    path = tmp_path / "durable" / "features" / name
    old = time.time() - writeback.REFRESH_FEATURES_S - 60
    os.utime(path, (old, old))  # as if written long ago: the lifecycle rule would take it
    monkeypatch.setattr(writeback, "REFRESH_FEATURES_S", 0.0)  # this writer checked it long ago
    engine.ask(first, QUESTIONS[0])  # a turn: its record names the image again
    engine.flush_durable(10)
    assert path.stat().st_mtime > old + 60 and engine.stats().durable.feature_writes == 2


def test_a_session_committed_again_keeps_its_place_in_the_writers_queue(tmp_path):
    """Oldest first: a session dirtied again while waiting is written with its newest state
    where it stood, not behind the sessions that came after it."""
    objects = DirectoryObjects(tmp_path)
    order, gate = [], threading.Event()
    put = objects.put

    def recording_put(name, data):
        gate.wait()
        order.append(name)
        put(name, data)

    objects.put = recording_put
    writer = writeback.WriteBehind(DurableSessions(objects, "m", 100), lambda snapshot: [])

    def state(session_id: str, turns: int) -> Snapshot:
        return Snapshot(session_id, [1, 2], [], turns, time.time(), 60.0)

    writer.dirty(state("first", 0))  # taken by the writer, which waits at the gate
    deadline = time.monotonic() + 5
    while writer.counters().pending != 1 or writer._pending:  # the writer holds it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    writer.dirty(state("a", 0))
    writer.dirty(state("b", 0))
    writer.dirty(state("a", 1))
    gate.set()
    assert writer.flush(5) == []
    assert order == [record_name(i) for i in ("first", "a", "b")]
    assert DurableSessions(objects, "m", 100).read("a", time.time()).snapshot.turns == 1
    writer.stop()
