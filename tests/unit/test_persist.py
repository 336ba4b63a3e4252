"""The persistent tier (llava/sessions/persist.py): entries written at open and after each committed
turn, adopted by a new engine of the same model; every bad entry is removed with a log line
and never used (docs/engine/sessions.md §Persistent tier)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig, SettingsError
from llava.engine import Engine
from llava.errors import SessionNotFound, log_id
from llava.kv.budget import MemoryBudget
from llava.model import weights_digest as weights
from llava.model.loading import load_model
from llava.model.weights_digest import RECORD
from llava.sessions.location import check_directory, persistence
from llava.sessions.persist import (
    FEATURES,
    GONE_LOG,
    STATE,
    SessionJournal,
    Snapshot,
    _pack,
)
from llava.sessions.session import Tier
from serving.interrupted import StreamEnd
from tests.conftest import DEMO_MODEL_DIR
from tests.memory_helpers import FakeClock, one_pixel_changed

QUESTIONS = ["What shape is it?", "And its color?", "Say that again.", "What color is the shape?"]
MODEL = "model-a"
VOCAB = 100  # the journal-only tests' vocabulary: ids 0..99
TTL = 600.0  # the journal-only tests' session TTL: how long gone ids are remembered


def new_engine(demo_model, directory, clock=time.monotonic, **settings) -> Engine:
    config = EngineConfig(model_dir="unused", persist_dir=str(directory), **settings)
    return Engine(demo_model, config, MemoryBudget(1 << 30), clock=clock)


def snapshot(session_id="s1", turns=1, last_used=None, ttl_s=60.0, image_rows=0) -> Snapshot:
    """A state; with ``image_rows``, of a session with one (unshared) image of that many."""
    last_used = time.time() if last_used is None else last_used
    images = ((None, image_rows),) if image_rows else ()
    return Snapshot(session_id, [1, 2, 3], [{"role": "user"}], turns, last_used, ttl_s, images)


def test_a_new_engine_continues_a_session_as_if_nothing_happened(demo_model, sample, tmp_path):
    control = new_engine(demo_model, tmp_path / "control")
    control_id = control.open(sample.image).session_id
    expected = [control.ask(control_id, q).text for q in QUESTIONS]

    first = new_engine(demo_model, tmp_path / "tier")
    opened = first.open(sample.image)
    answers = [first.ask(opened.session_id, q).text for q in QUESTIONS[:3]]
    first.stop()  # the worker "dies": nothing of it is used below but the directory
    (tmp_path / "tier" / "junk.state").write_bytes(b"\x00" * 100)  # never crashes the start
    SessionJournal(tmp_path / "tier", 1 << 20, "another-model", VOCAB, TTL).save(
        snapshot("foreign")
    )

    second = new_engine(demo_model, tmp_path / "tier")
    assert second.adopted == 1
    assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == sorted(
        [
            f"{opened.session_id}.features",
            f"{opened.session_id}.state",
            RECORD,  # the weights' digest, kept so that a restart does not rehash them
        ]
    )  # sorted both: a random id may sort after RECORD's "weights"
    session = second.store.session(opened.session_id)
    assert session.tier is Tier.PERSISTED and session.turns == 3  # adopted parked
    assert second.stats().total_bytes == 0  # nothing read into memory before its turn
    answer = second.ask(opened.session_id, QUESTIONS[3])
    assert answers + [answer.text] == expected
    assert answer.tier is Tier.PERSISTED and answer.expires_at >= opened.expires_at


def test_a_turn_that_did_not_commit_leaves_the_previous_state(demo_model, sample, tmp_path):
    first = new_engine(demo_model, tmp_path)
    session_id = first.open(sample.image).session_id
    first.ask(session_id, QUESTIONS[0])

    def broken_transport(text, token_id):
        raise ConnectionError("the reply's connection broke mid-turn")

    with pytest.raises(ConnectionError):
        first.ask(session_id, QUESTIONS[1], on_token=broken_transport)
    second = new_engine(demo_model, tmp_path)
    assert second.store.session(session_id).turns == 1


def test_close_and_expiry_remove_entries(demo_model, sample, tmp_path):
    clock = FakeClock()
    engine = new_engine(demo_model, tmp_path, clock=clock, session_ttl_s=1)
    closed = engine.open(sample.image).session_id
    expiring = engine.open(None).session_id
    engine.close(closed)
    assert not list(tmp_path.glob(f"{closed}.*"))
    clock.now += 1.5
    assert engine.store.reap() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [GONE_LOG, RECORD]  # why they went
    lines = (tmp_path / GONE_LOG).read_text().splitlines()
    assert [line.rsplit(" ", 1)[0] for line in lines] == [  # each with when it went
        f"{closed} SESSION_CLOSED",
        f"{expiring} SESSION_EXPIRED",
    ]


def test_entries_of_another_model_are_removed_with_a_log_line(tmp_path, caplog):
    SessionJournal(tmp_path, 1 << 20, "model-b", VOCAB, TTL).save(
        snapshot(image_rows=4), torch.ones(4, 8)
    )
    with caplog.at_level(logging.WARNING, "llava.sessions.persist"):
        assert SessionJournal(tmp_path, 1 << 20, MODEL, VOCAB, TTL).load(time.time()).live == []
    assert "another model's entry" in caplog.text
    assert not list(tmp_path.iterdir())


def test_an_entry_from_before_sessions_held_several_images_is_adopted(demo_model, sample, tmp_path):
    """A state naming its one image by ``imageKey``, without ``images`` (the layout before a
    session could hold several), is a session whose open brought that image."""
    control = new_engine(demo_model, tmp_path / "control")
    control_id = control.open(sample.image).session_id
    first = new_engine(demo_model, tmp_path / "tier")
    opened = first.open(sample.image).session_id
    model = first.persistent.journal.model
    first.stop()
    header, _, _ = SessionJournal(tmp_path / "tier", 1 << 20, model, VOCAB, TTL)._unpack(
        opened, STATE
    )
    [image] = header.pop("images")
    del header["openingImages"]
    header["imageKey"] = image["key"]
    (tmp_path / "tier" / f"{opened}{STATE}").write_bytes(_pack(STATE, header, b""))
    second = new_engine(demo_model, tmp_path / "tier")
    session = second.store.session(opened)
    assert [i.tokens for i in session.holding.images] == [image["tokens"]]
    assert session.opening_images == 1
    expected = control.ask(control_id, QUESTIONS[0]).token_ids
    assert second.ask(opened, QUESTIONS[0]).token_ids == expected


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
@pytest.mark.parametrize("suffix", [STATE, FEATURES])
def test_corrupt_or_truncated_entries_are_removed(tmp_path, caplog, damage, suffix):
    journal = SessionJournal(tmp_path, 1 << 20, MODEL, VOCAB, TTL)
    journal.save(snapshot("bad", image_rows=4), torch.ones(4, 8))
    journal.save(snapshot("good", image_rows=4), torch.ones(4, 8))
    path = tmp_path / f"bad{suffix}"
    data = path.read_bytes()
    damaged = {
        "flip": data[:20] + bytes([data[20] ^ 1]) + data[21:],
        "truncate": data[: len(data) // 2],
        "empty": b"",
    }[damage]
    path.write_bytes(damaged)
    reopened = SessionJournal(tmp_path, 1 << 20, MODEL, VOCAB, TTL)
    with caplog.at_level(logging.WARNING, "llava.sessions.persist"):
        adopted = reopened.load(time.time()).live
    assert [e.snapshot.session_id for e in adopted] == ["good"]
    assert adopted[0].features_shape == (4, 8)
    assert torch.equal(reopened.features("good"), torch.ones(4, 8))
    assert log_id("bad") in caplog.text  # logs name a session by a keyed hash of its id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.features", "good.state"]


def test_expired_orphaned_and_unfinished_files_are_removed(tmp_path):
    journal = SessionJournal(tmp_path, 1 << 20, MODEL, VOCAB, TTL)
    journal.save(snapshot("old", last_used=time.time() - 120, ttl_s=60))
    journal.save(snapshot("orphan", image_rows=2), torch.ones(2, 2))
    (tmp_path / "orphan.state").unlink()
    (tmp_path / ".tmp-live.state-1-2").write_bytes(b"half")
    journal.save(snapshot("live"))
    adopted = SessionJournal(tmp_path, 1 << 20, MODEL, VOCAB, TTL).load(time.time()).live
    assert [e.snapshot.session_id for e in adopted] == ["live"]
    assert [p.name for p in tmp_path.iterdir()] == ["live.state"]


def test_an_id_that_is_no_file_name_is_not_persisted(tmp_path):
    journal = SessionJournal(tmp_path / "d", 1 << 20, MODEL, VOCAB, TTL)
    (tmp_path / "d").mkdir()
    assert journal.save(snapshot("../escape")) is False
    assert not list(tmp_path.rglob("*escape*"))


def test_the_directory_never_grows_past_its_cap(tmp_path, caplog):
    (tmp_path / "probe").mkdir()
    (tmp_path / "cap").mkdir()
    probe = SessionJournal(tmp_path / "probe", 1 << 20, MODEL, VOCAB, TTL)
    probe.save(snapshot("probe", image_rows=64), torch.ones(64, 64))
    per_session = probe.total_bytes
    journal = SessionJournal(tmp_path / "cap", int(per_session * 2.5), MODEL, VOCAB, TTL)
    with caplog.at_level(logging.WARNING, "llava.sessions.persist"):
        kept = [
            journal.save(snapshot(f"s{i}", image_rows=64), torch.ones(64, 64)) for i in range(4)
        ]
    assert kept == [True, True, False, False]
    assert "directory is full" in caplog.text
    assert sum(p.stat().st_size for p in (tmp_path / "cap").iterdir()) <= journal.max_bytes
    # a lower cap at the next start keeps the most recent entries that fit
    smaller = SessionJournal(tmp_path / "cap", per_session, MODEL, VOCAB, TTL)
    assert [e.snapshot.session_id for e in smaller.load(time.time()).live] == ["s1"]
    assert sorted(p.name for p in (tmp_path / "cap").iterdir()) == ["s1.features", "s1.state"]


def test_a_full_directory_degrades_to_sessions_lost(demo_model, sample, tmp_path):
    control = Engine(demo_model, EngineConfig(model_dir="unused"), MemoryBudget(1 << 30))
    expected = control.ask(control.open(sample.image).session_id, QUESTIONS[0]).token_ids
    engine = new_engine(demo_model, tmp_path, persist_max_bytes=100)  # too small for any
    session_id = engine.open(sample.image).session_id
    answer = engine.ask(session_id, QUESTIONS[0])
    assert answer.text and answer.token_ids == expected  # the turn is not failed
    restarted = new_engine(demo_model, tmp_path)
    with pytest.raises(SessionNotFound):
        restarted.ask(session_id, QUESTIONS[1])


def test_a_restarted_worker_adopts_more_sessions_than_its_device_holds_and_loses_none(
    demo_model, sample, tmp_path
):
    """Every live session is adopted parked, even more than the device holds at once: each
    comes back on its turn (parking the other) and answers as if nothing happened. One that
    expired while no worker held it is answered as expired, not as an id never seen, and
    closing it is the idempotent close."""
    short = {"max_new_tokens": 4}
    images = (
        sample.image,
        one_pixel_changed(sample.image),
        held_out_samples(1, seed=20_777)[0].image,
    )
    control = new_engine(demo_model, tmp_path / "control")
    ids = [control.open(image).session_id for image in images]
    expected = [[control.ask(i, q, short).token_ids for q in QUESTIONS[:2]] for i in ids]
    one_session = control.memory.held_bytes(control.store.session(ids[0]).holding)

    first = new_engine(demo_model, tmp_path / "tier")
    held = [first.open(image).session_id for image in images]
    answers = [[first.ask(i, QUESTIONS[0], short).token_ids] for i in held]
    first.stop()
    SessionJournal(tmp_path / "tier", 1 << 20, first.persistent.journal.model, VOCAB, TTL).save(
        snapshot("idle", last_used=time.time() - 120, ttl_s=60)  # expired while down
    )
    config = EngineConfig(model_dir="unused", persist_dir=str(tmp_path / "tier"))
    block = control.memory.pool.bytes_per_block
    one_at_a_time = Engine(demo_model, config, MemoryBudget(one_session + block))
    assert one_at_a_time.adopted == 3
    for answered, session_id in zip(answers, held, strict=True):
        answer = one_at_a_time.ask(session_id, QUESTIONS[1], short)
        assert answer.tier is Tier.PERSISTED
        answered.append(answer.token_ids)
    assert answers == expected
    counters = one_at_a_time.stats().memory
    assert (counters.parked, counters.evicted) == (1, 0)  # the first made room for the third
    with pytest.raises(SessionNotFound) as refused:
        one_at_a_time.ask("idle", QUESTIONS[0])
    assert refused.value.code == "SESSION_EXPIRED"
    assert one_at_a_time.close("idle") == "SESSION_EXPIRED"
    one_at_a_time.check_integrity()


def test_a_restarted_worker_still_tells_why_earlier_sessions_went(demo_model, sample, tmp_path):
    """Ids that were closed, expired or evicted before the crash are answered with that code
    by the next worker (the gone log), not as ids never seen; a torn last line is skipped."""
    first = new_engine(demo_model, tmp_path, session_ttl_s=60)
    closed, expiring, live = (first.open(sample.image).session_id for _ in range(3))
    first.close(closed)
    first.store._remove(expiring, "SESSION_EXPIRED")  # what the reaper does past the TTL
    first.stop()
    with open(tmp_path / GONE_LOG, "a") as log:
        log.write("half-writ")  # the worker died in the middle of a line
    second = new_engine(demo_model, tmp_path)
    assert second.adopted == 1 and live in second.store
    for session_id, code in ((closed, "SESSION_CLOSED"), (expiring, "SESSION_EXPIRED")):
        with pytest.raises(SessionNotFound) as refused:
            second.ask(session_id, QUESTIONS[0])
        assert refused.value.code == code
    with pytest.raises(SessionNotFound) as never:
        second.ask("never-seen", QUESTIONS[0])
    assert never.value.code == "SESSION_NOT_FOUND"


def test_a_bad_directory_or_cap_fails_the_start_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SettingsError, match="^bad setting persist_dir: .* not a writable"):
        check_directory(str(blocker / "sessions"), None)
    with pytest.raises(SettingsError, match="^bad setting persist_max_bytes: .*file system"):
        check_directory(str(tmp_path), 1 << 60)
    with pytest.raises(SettingsError, match="persist_dir"):
        EngineConfig(model_dir="x", persist_dir="relative/dir")
    assert check_directory(str(tmp_path), None) > 0
    assert os.access(tmp_path, os.W_OK)


def test_a_directory_under_the_floor_gives_way_to_the_fallback_in_one_log_line(tmp_path, caplog):
    small, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    measured = check_directory(str(tmp_path), None)  # half the file system the test writes to

    def config(**settings) -> EngineConfig:
        return EngineConfig(model_dir="x", persist_dir=small, **settings)

    with caplog.at_level(logging.INFO, "llava.sessions.location"):
        assert persistence(config(persist_min_bytes=measured)) == (small, measured)
        assert caplog.messages == [f"persistent tier: {small}, up to {measured >> 20} MiB"]
        caplog.clear()
        floor = config(persist_min_bytes=measured + 1, persist_fallback_dir=disk)
        assert persistence(floor) == (disk, measured)
        assert len(caplog.messages) == 1 and f"using {disk} instead" in caplog.messages[0]
        caplog.clear()
        capped = config(
            persist_min_bytes=measured + 1, persist_fallback_dir=disk, persist_max_bytes=5
        )
        assert persistence(capped) == (small, 5)  # a stated cap is the operator's choice
    blocker = tmp_path / "file"
    blocker.write_text("")
    unwritable = config(persist_min_bytes=measured + 1, persist_fallback_dir=str(blocker / "x"))
    with pytest.raises(SettingsError, match="^bad setting persist_fallback_dir: .* not a writable"):
        persistence(unwritable)
    assert persistence(EngineConfig(model_dir="x")) is None  # the tier off


def test_a_stream_is_finished_only_by_a_whole_last_line_that_is_not_a_token():
    token = b'{"token": {"id": 5, "text": "red"}}\n'
    final = b'{"generation": {"text": "red"}, "usage": {}}\n'
    error = b'{"error": {"code": "TURN_INTERRUPTED", "message": "m"}}\n'
    for stream, finished in [
        (token + final, True),
        (token + error, True),
        (token, False),
        (token + final[:-1], False),  # the final reply cut before its newline
        (token + final[:10], False),
        (b"", False),
    ]:
        for cut in range(len(stream) + 1):  # however the bytes arrive
            end = StreamEnd()
            end.feed(stream[:cut])
            end.feed(stream[cut:])
            assert end.finished is finished, (stream, cut)


def test_a_failing_write_never_fails_the_turn(demo_model, sample, tmp_path, monkeypatch):
    engine = new_engine(demo_model, tmp_path)
    session_id = engine.open(sample.image).session_id

    def broken(snapshot, features=None):
        raise RuntimeError("a bug in the tier")

    monkeypatch.setattr(engine.persistent.journal, "save", broken)
    assert engine.ask(session_id, QUESTIONS[0]).text == sample.shape
    assert [p.name for p in tmp_path.iterdir()] == [RECORD]  # not persisted, rather than stale


def test_the_gone_log_keeps_each_id_one_ttl_by_time_however_many(tmp_path, monkeypatch):
    monkeypatch.setattr("llava.sessions.persist.REMEMBERED_GONE", 3)
    clock = [1_000_000.0]
    monkeypatch.setattr("llava.sessions.persist.time.time", lambda: clock[0])
    journal = SessionJournal(tmp_path, 1 << 20, MODEL, VOCAB, TTL)
    for n in range(10):  # more than any count it keeps, all within one TTL
        journal.remove(f"s{n}", "SESSION_CLOSED")
        clock[0] += 1
    assert len((tmp_path / GONE_LOG).read_text().splitlines()) == 10
    clock[0] += TTL - 5.5  # s0..s4 went more than a TTL ago, s5..s9 less
    for n in range(10, 17):  # past twice what was kept: rewritten without the old ones
        journal.remove(f"s{n}", "SESSION_EXPIRED")
    assert "s0 " not in (tmp_path / GONE_LOG).read_text()
    loaded = SessionJournal(tmp_path, 1 << 20, MODEL, VOCAB, TTL).load(clock[0])
    assert loaded.gone == {f"s{n}": "SESSION_CLOSED" for n in range(5, 10)} | {
        f"s{n}": "SESSION_EXPIRED" for n in range(10, 17)
    }
    much_later = SessionJournal(tmp_path, 1 << 20, MODEL, VOCAB, TTL).load(clock[0] + 2 * TTL)
    assert list(much_later.gone) == ["s14", "s15", "s16"]  # the newest REMEMBERED_GONE


# -- the tier on a shared host ------------------------------------------------------------


def test_the_directory_and_the_gone_log_are_private(tmp_path, monkeypatch):
    monkeypatch.setattr("llava.sessions.persist.REMEMBERED_GONE", 1)
    previous = os.umask(0o022)  # the usual umask: files made with defaults would be 0644
    try:
        directory = tmp_path / "shm" / "sessions"
        check_directory(str(directory), None)
        journal = SessionJournal(directory, 1 << 20, MODEL, VOCAB, TTL)
        journal.remove("s1", "SESSION_CLOSED")
        appended = (directory / GONE_LOG).stat().st_mode & 0o777
        for n in range(3):  # past twice what is kept: the log is rewritten
            journal.remove(f"s{n}", "SESSION_CLOSED")
        rewritten = (directory / GONE_LOG).stat().st_mode & 0o777
    finally:
        os.umask(previous)
    assert directory.stat().st_mode & 0o777 == 0o700
    assert (appended, rewritten) == (0o600, 0o600)


def own_directory(path: Path, mode: int) -> Path:
    path.mkdir()
    path.chmod(mode)
    return path


def link_to_a_private_directory(path: Path) -> None:
    own_directory(path.with_name("real"), 0o700)
    path.symlink_to(path.with_name("real"))


@pytest.mark.parametrize(
    "make, problem",
    [
        (link_to_a_private_directory, "a symbolic link"),
        (functools.partial(own_directory, mode=0o770), r"writable by its group .*\(mode 770\)"),
        (functools.partial(own_directory, mode=0o1777), r"writable by its group .*\(mode 777\)"),
    ],
    ids=["symlink", "group-writable", "world-writable"],
)
def test_an_unsafe_directory_fails_the_start_in_one_line(tmp_path, make, problem):
    make(tmp_path / "sessions")
    config = EngineConfig(model_dir="x", persist_dir=str(tmp_path / "sessions"))
    with pytest.raises(SettingsError, match=f"^bad setting persist_dir: .*{problem}") as refused:
        persistence(config)
    assert "\n" not in str(refused.value)


def test_a_directory_of_another_user_fails_the_start(tmp_path, monkeypatch):
    """Faked: the tests run as one user, so this process claims another uid (os.geteuid)."""
    directory = own_directory(tmp_path / "sessions", 0o700)
    monkeypatch.setattr(os, "geteuid", lambda: directory.stat().st_uid + 1)
    config = EngineConfig(model_dir="x", persist_dir=str(directory))
    with pytest.raises(SettingsError, match="^bad setting persist_dir: .*belongs to uid"):
        persistence(config)


def test_a_directory_under_one_others_may_change_fails_the_start(tmp_path):
    shared = own_directory(tmp_path / "shared", 0o777)  # no sticky bit: entries can be renamed
    with pytest.raises(SettingsError, match=r"^bad setting persist_dir: .*shared, above it, may"):
        check_directory(str(shared / "sessions"), None)
    shared.chmod(0o1777)  # as /dev/shm and /tmp are
    assert check_directory(str(shared / "sessions"), None) > 0


def test_an_own_directory_others_may_read_is_narrowed(tmp_path):
    directory = own_directory(tmp_path / "sessions", 0o755)  # as an older start left it
    check_directory(str(directory), None)
    assert directory.stat().st_mode & 0o777 == 0o700


def test_adopted_token_ids_outside_the_vocabulary_are_dropped(tmp_path, caplog):
    journal = SessionJournal(tmp_path, 1 << 20, MODEL, VOCAB, TTL)
    for session_id, ids in (("past-end", [1, VOCAB]), ("negative", [-1, 2]), ("good", [0, 99])):
        journal.save(Snapshot(session_id, ids, [], 1, time.time(), 60.0))
    with caplog.at_level(logging.WARNING, "llava.sessions.persist"):
        adopted = SessionJournal(tmp_path, 1 << 20, MODEL, VOCAB, TTL).load(time.time()).live
    assert [e.snapshot.session_id for e in adopted] == ["good"]
    assert caplog.text.count("token ids outside the vocabulary (0..99)") == 2
    assert [p.name for p in tmp_path.iterdir()] == [f"good{STATE}"]


@pytest.fixture
def model_copy(tmp_path, monkeypatch):
    """The demo checkpoint copied where a test may change it; no digest known in-process."""
    monkeypatch.setattr(weights, "_known", {})
    return Path(shutil.copytree(DEMO_MODEL_DIR, tmp_path / "model"))


def change_one_weight(model_dir: Path) -> None:
    """A "fine-tune" of the same shape: one value changed, the file's size unchanged."""
    path = model_dir / "model.safetensors"
    size = path.stat().st_size
    with safe_open(path, "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += 1
    save_file(tensors, path, metadata)
    assert path.stat().st_size == size


def test_the_weights_are_hashed_once_and_again_when_a_file_changes(
    model_copy, tmp_path, monkeypatch
):
    hashed = []
    real = weights._hash
    monkeypatch.setattr(weights, "_hash", lambda files: hashed.append(files) or real(files))
    model_files = sorted(p.name for p in model_copy.iterdir())
    model_copy.chmod(0o555)  # read-only, as /opt/ml/model is on SageMaker
    records = tmp_path / "records"
    records.mkdir()

    first = weights.weights_digest(model_copy, records)
    assert len(hashed) == 1
    assert (records / weights.RECORD).stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in model_copy.iterdir()) == model_files  # nothing written there
    monkeypatch.setattr(weights, "_known", {})  # a restarted worker: only the record is left
    assert weights.weights_digest(model_copy, records) == first and len(hashed) == 1

    model_copy.chmod(0o755)
    change_one_weight(model_copy)
    changed = weights.weights_digest(model_copy, records)
    assert changed != first and len(hashed) == 2


def test_a_fine_tune_of_the_same_shape_does_not_adopt_the_old_models_sessions(
    model_copy, sample, tmp_path, caplog
):
    first = new_engine(load_model(str(model_copy)), tmp_path / "tier")
    session_id = first.open(sample.image).session_id
    first.ask(session_id, QUESTIONS[0])
    first.stop()
    change_one_weight(model_copy)
    tuned = load_model(str(model_copy))
    with caplog.at_level(logging.WARNING, "llava.sessions.persist"):
        second = new_engine(tuned, tmp_path / "tier")
    assert second.adopted == 0 and "another model's entry" in caplog.text
    assert second.persistent.journal.model != first.persistent.journal.model
    with pytest.raises(SessionNotFound):
        second.ask(session_id, QUESTIONS[1])


def test_a_model_built_in_memory_cannot_keep_sessions(demo_model, tmp_path):
    in_memory = dataclasses.replace(demo_model, model_dir=None)
    with pytest.raises(SettingsError, match="^bad setting persist_dir: .*loaded from a directory"):
        new_engine(in_memory, tmp_path)
