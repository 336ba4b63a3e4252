"""Several images in one session, as the engine holds them: each image's features computed once
and shared, a limit per session, nothing of a failed or refused turn's image kept, a rewind that
drops the images of the turns it drops, and every image kept by the persistent tier.

Token-equality with Hugging Face's own pipeline is tests/unit/test_multi_image_fidelity.py's;
here the control is the engine itself: a session that never had what was refused or rewound."""

from __future__ import annotations

import pytest

from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import InvalidRequest
from llava.kv.budget import MemoryBudget
from llava.kv.holding import Tier
from tests.conftest import recognized_samples

GREEDY = {"max_new_tokens": 6}


@pytest.fixture(scope="module")
def images(demo_model):
    return [sample.image for sample in recognized_samples(demo_model, 3)]


def new_engine(demo_model, **settings) -> Engine:
    config = EngineConfig(model_dir="-", session_ttl_s=600, **settings)
    return Engine(demo_model, config, MemoryBudget(1 << 30, host_bytes=1 << 28))


def counting_encodes(engine: Engine) -> list[int]:
    """Count the engine's vision-tower runs from now on (one entry per run)."""
    runs: list[int] = []
    encode = engine.encode_image

    def counted(inputs):
        runs.append(1)
        return encode(inputs)

    engine.encode_image = counted
    return runs


def twins(engine: Engine, image) -> tuple[str, str]:
    """Two sessions opened on one image: a control and the one a test does things to."""
    return engine.open(image).session_id, engine.open(image).session_id


def answers_alike(engine: Engine, control: str, opened: str, question: str) -> None:
    """``opened`` answers as ``control`` does: nothing of what was done to it shows."""
    expected = engine.ask(control, question, GREEDY)
    assert engine.ask(opened, question, GREEDY).token_ids == expected.token_ids
    engine.check_integrity()


def feature_bytes(engine: Engine) -> int:
    return engine.stats().bytes_by_tier[Tier.FEATURES]


def test_a_turns_image_joins_the_session_and_its_features_are_computed_once(demo_model, images):
    engine = new_engine(demo_model, prefix_sharing="all")
    first, second = images[:2]
    runs = counting_encodes(engine)
    opened = engine.open(first)
    engine.ask(opened.session_id, "What shape is it?", GREEDY)
    answer = engine.ask(opened.session_id, "And this one?", GREEDY, image=second)
    holding = engine.store.session(opened.session_id).holding
    assert (answer.images, len(holding.images), len(runs)) == (2, 2, 2)
    assert answer.image_tokens == holding.images[1].tokens == opened.image_tokens  # llava-1.5
    assert answer.new_tokens < answer.image_tokens + 40  # the history came from the KV
    # another session with the same two images computes neither again, and one that starts
    # its KV anew reuses the first one's blocks up to the new question ("all": every block is
    # shared), the second image's included
    other = engine.open(first)
    engine.ask(other.session_id, "What shape is it?", GREEDY)
    engine.memory.move_down(engine.store.session(other.session_id).holding)  # to the host
    engine.memory.move_down(engine.store.session(other.session_id).holding)  # features only
    again = engine.ask(other.session_id, "And this one?", GREEDY, image=second)
    assert len(runs) == 2 and engine.stats().memory.feature_hits >= 2
    assert again.token_ids == answer.token_ids
    assert again.cached_tokens > answer.cached_tokens + answer.image_tokens
    sharer = engine.store.session(other.session_id).holding
    assert [i.blocks for i in sharer.images] == [i.blocks for i in holding.images]
    engine.check_integrity()


def test_past_the_limit_a_turns_image_is_refused_and_the_session_goes_on(demo_model, images):
    engine = new_engine(demo_model, max_images_per_session=2)
    control, opened = twins(engine, images[0])
    for session_id in (control, opened):
        engine.ask(session_id, "What shape is it?", GREEDY, image=images[1])
    runs = counting_encodes(engine)
    with pytest.raises(InvalidRequest, match="max_images_per_session") as refused:
        engine.ask(opened, "And this one?", GREEDY, image=images[2])
    assert refused.value.code == "TOO_MANY_IMAGES"
    assert not runs  # refused before its features were computed
    session = engine.store.session(opened)
    assert (session.turns, session.images) == (1, 2)
    answers_alike(engine, control, opened, "And its color?")


def test_a_failed_turn_lets_go_of_the_image_it_brought(demo_model, images):
    engine = new_engine(demo_model, prefix_sharing="off")
    control, opened = twins(engine, images[0])
    held = feature_bytes(engine)

    def hang_up(_text, _token_id):
        raise RuntimeError("the caller went away")

    with pytest.raises(Exception, match="went away"):
        engine.ask(opened, "And this one?", GREEDY, image=images[1], on_token=hang_up)
    session = engine.store.session(opened)
    assert (session.turns, session.images, feature_bytes(engine)) == (0, 1, held)
    answers_alike(engine, control, opened, "What shape is it?")


def test_rewinding_past_the_turn_that_brought_an_image_drops_it(demo_model, images):
    engine = new_engine(demo_model, prefix_sharing="off")
    control, opened = twins(engine, images[0])
    engine.ask(control, "What shape is it?", GREEDY)
    engine.ask(opened, "What shape is it?", GREEDY)
    held = feature_bytes(engine)
    engine.ask(opened, "And this one?", GREEDY, image=images[1])
    assert feature_bytes(engine) > held
    expected = engine.ask(control, "And its color?", GREEDY)
    answer = engine.ask(opened, "And its color?", GREEDY, rewind_turns=1)
    assert answer.token_ids == expected.token_ids
    assert (answer.images, answer.turns, feature_bytes(engine)) == (1, 2, held)
    # rewinding every turn keeps the open's image: the first question shows it again
    first = engine.ask(opened, "What shape is it?", GREEDY, rewind_turns=2)
    assert (first.images, first.image_tokens) == (1, 0)  # its tokens are still in the KV
    engine.check_integrity()


def test_a_text_only_session_takes_its_first_image_on_a_later_turn(demo_model, images):
    engine = new_engine(demo_model)
    opened = engine.open().session_id
    engine.ask(opened, "Hello.", GREEDY)
    answer = engine.ask(opened, "What shape is it?", GREEDY, image=images[0])
    assert (answer.images, answer.image_tokens) == (1, engine.open(images[0]).image_tokens)
    # rewinding past it leaves a text-only session, which renders no image
    text_only = engine.ask(opened, "Hello again.", GREEDY, rewind_turns=2)
    assert (text_only.images, text_only.image_tokens) == (0, 0)
    engine.check_integrity()


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.FEATURES, Tier.PERSISTED])
def test_every_tier_keeps_every_image(demo_model, images, tmp_path, tier):
    engine = new_engine(demo_model, persist_dir=str(tmp_path / "tier"), prefix_sharing="off")
    control, opened = twins(engine, images[0])
    for session_id in (control, opened):
        engine.ask(session_id, "What shape is it?", GREEDY, image=images[1])
    holding = engine.store.session(opened).holding
    while holding.tier is not tier:
        engine.memory.move_down(holding)
    expected = engine.ask(control, "And this one?", GREEDY, image=images[2])
    answer = engine.ask(opened, "And this one?", GREEDY, image=images[2])
    assert (answer.token_ids, answer.tier, answer.images) == (expected.token_ids, tier, 3)
    engine.check_integrity()


def test_a_restarted_worker_adopts_a_session_with_all_its_images(demo_model, images, tmp_path):
    directory = str(tmp_path / "tier")
    control_engine = new_engine(demo_model)
    control = control_engine.open(images[0]).session_id
    first = new_engine(demo_model, persist_dir=directory)
    opened = first.open(images[0]).session_id
    for engine, session_id in ((control_engine, control), (first, opened)):
        engine.ask(session_id, "What shape is it?", GREEDY)
        engine.ask(session_id, "And this one?", GREEDY, image=images[1])
    keys = [image.key for image in first.store.session(opened).holding.images]
    first.stop()
    second = new_engine(demo_model, persist_dir=directory)
    adopted = second.store.session(opened)
    assert [image.key for image in adopted.holding.images] == keys
    assert adopted.tier is Tier.PERSISTED and adopted.opening_images == 1
    expected = control_engine.ask(control, "And its color?", GREEDY)
    answer = second.ask(opened, "And its color?", GREEDY)
    assert (answer.token_ids, answer.images) == (expected.token_ids, 2)
    # the open's image still leads the first question after a rewind of every turn
    expected = control_engine.ask(control, "What color?", GREEDY, rewind_turns=3)
    assert second.ask(opened, "What color?", GREEDY, rewind_turns=3).token_ids == (
        expected.token_ids
    )
    second.check_integrity()


def test_the_same_image_twice_is_held_once_and_freed_with_its_session(demo_model, images):
    engine = new_engine(demo_model)
    runs = counting_encodes(engine)
    opened = engine.open(images[0]).session_id
    held = feature_bytes(engine)
    answer = engine.ask(opened, "Is it the same?", GREEDY, image=images[0])
    assert (answer.images, len(runs), feature_bytes(engine)) == (2, 1, held)
    engine.check_integrity()  # its blocks are referenced twice, by one holding
    engine.close(opened)
    engine.check_integrity()
    pool = engine.memory.pool
    assert pool.free_blocks == pool.total_blocks  # free or reclaimable, every one


def test_an_image_brought_where_a_rewound_one_was_is_computed_not_reused(demo_model, images):
    """Every image token is one id: after a rewind past the turn that brought an image, a
    new image in its place matches the old ids, never the old image's KV."""
    engine = new_engine(demo_model, prefix_sharing="off")
    control, opened = twins(engine, images[0])
    engine.ask(opened, "And this one?", GREEDY, image=images[1])
    expected = engine.ask(control, "And this one?", GREEDY, image=images[2])
    answer = engine.ask(opened, "And this one?", GREEDY, image=images[2], rewind_turns=1)
    assert answer.image_tokens == expected.image_tokens  # all of the new image's tokens
    assert (answer.token_ids, answer.images) == (expected.token_ids, 2)
    engine.check_integrity()


def test_a_session_rewound_to_no_image_is_kept_without_one(demo_model, images, tmp_path):
    """Its persisted features go with its last image: a restarted worker adopts it whole."""
    directory = str(tmp_path / "tier")
    first = new_engine(demo_model, persist_dir=directory)
    opened = first.open().session_id
    first.ask(opened, "Hello.", GREEDY, image=images[0])
    assert (tmp_path / "tier" / f"{opened}.features").exists()
    assert first.ask(opened, "Hello again.", GREEDY, rewind_turns=1).images == 0
    assert not (tmp_path / "tier" / f"{opened}.features").exists()
    first.stop()
    second = new_engine(demo_model, persist_dir=directory)
    assert second.adopted == 1 and second.ask(opened, "And now?", GREEDY).images == 0
