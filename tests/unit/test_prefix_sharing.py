"""Shared prefixes on the demo model: sessions on one image and system prompt reuse what
another computed, and answer token for token as an engine that shares nothing; an image with
one pixel changed never shares the image's KV; by default a caller's text is never reused by
another session, so usage cannot confirm a guess of it, and tenants share nothing
(docs/engine/memory.md §Shared prefixes)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.errors import InvalidRequest
from llava.kv.budget import MemoryBudget
from llava.kv.holding import Tier
from tests.memory_helpers import one_pixel_changed

SYSTEM = "You answer about one picture. Name its color first, then its shape, in one word each."
QUESTIONS = ["What color is the shape?", "And its shape?", "Say that again."]
MAX_NEW = {"max_new_tokens": 6}
# Another session's question, and a wrong guess of it: as many tokens, the first one differs.
ASKED = "color, please: look at the picture and tell me in one word what color the shape is."
GUESSED_WRONG = (
    "shape, please: look at the picture and tell me in one word what color the shape is."
)
# A caller's own system prompt, and a wrong guess of it (as many tokens, a word swapped).
OWN_SYSTEM = "Answer about the picture: say its color first, then its shape, one word each."
GUESSED_SYSTEM = "Answer about the picture: say its shape first, then its color, one word each."


def new_engine(demo_model, sharing: str = "opening", budget: int = 64 << 20, **settings) -> Engine:
    """The operator's system prompt is SYSTEM unless ``settings`` say otherwise. The default
    budget holds hundreds of these sessions: room enough, and the books the loop checks when
    idle (check_memory_when_idle walks every block of the pool) stay a few thousand blocks."""
    settings = {"system_prompt": SYSTEM, **settings}
    config = EngineConfig(
        model_dir="-", prefix_sharing=sharing, check_memory_when_idle=True, **settings
    )
    return Engine(demo_model, config, MemoryBudget(budget))


@pytest.fixture(scope="module")
def unshared(demo_model):
    return new_engine(demo_model, sharing="off")


def conversation(engine: Engine, session_id: str) -> list[tuple[int, ...]]:
    return [engine.ask(session_id, q, MAX_NEW).token_ids for q in QUESTIONS]


def reference(unshared: Engine, image) -> list[tuple[int, ...]]:
    """What an engine that shares nothing answers in a new session on ``image``."""
    session_id = unshared.open(image).session_id
    try:
        return conversation(unshared, session_id)
    finally:
        unshared.close(session_id)


def first_image_token(engine: Engine, system: str | None = SYSTEM) -> int:
    ids = engine.loaded.prompt.opening_ids(True, 4, system)
    return ids.index(engine.loaded.model.config.image_token_id)


def test_sessions_on_a_held_prefix_compute_only_what_differs_and_answer_alike(demo_model, unshared):
    engine = new_engine(demo_model)
    image = held_out_samples(1, seed=20_031)[0].image
    first = engine.open(image)  # the operator's system prompt: the opening is shared
    assert first.cached_tokens == 0
    opened = [engine.open(image) for _ in range(2)]
    block = engine.memory.pool.block_tokens
    opening = first.prefill_tokens
    for later in opened:
        assert later.cached_tokens == opening // block * block  # every full block
        assert later.prefill_tokens == 0  # the partial block left goes with the first question
    counters = engine.memory.stats().counters
    assert (counters.prefix_hits, counters.feature_hits) == (2, 2)  # no vision tower either
    expected = reference(unshared, image)
    for session_id in [first.session_id, *(o.session_id for o in opened)]:
        assert conversation(engine, session_id) == expected
    features = engine.stats().bytes_by_tier[Tier.FEATURES]
    assert features == len(engine.store.session(first.session_id).holding.feature_blocks) * (
        engine.memory.pool.bytes_per_block
    )  # held once for three sessions


def test_an_image_with_one_pixel_changed_never_shares_the_images_kv(demo_model, unshared):
    engine = new_engine(demo_model)
    image = held_out_samples(1, seed=20_032)[0].image
    changed = one_pixel_changed(image)
    engine.open(image)
    other = engine.open(changed)
    block = engine.memory.pool.block_tokens
    assert other.cached_tokens == first_image_token(engine) // block * block  # the system only
    assert engine.memory.stats().counters.feature_hits == 0
    assert conversation(engine, other.session_id) == reference(unshared, changed)


# Twelve opens of four near-identical images at once (seconds): make test-fast keeps one of them
# alone, test_an_image_with_one_pixel_changed_never_shares_the_images_kv.
@pytest.mark.thorough
def test_many_near_identical_images_opened_at_once_each_get_their_own(demo_model, unshared):
    engine = new_engine(demo_model)
    base = held_out_samples(1, seed=20_033)[0].image
    variants = [base]
    for _ in range(3):
        variants.append(one_pixel_changed(variants[-1]))
    images = [variants[i % 4] for i in range(12)]  # each variant three times
    with ThreadPoolExecutor(6) as pool:
        opened = list(pool.map(engine.open, images))
        answers = list(pool.map(lambda o: conversation(engine, o.session_id), opened))
    expected = [reference(unshared, image) for image in variants]
    assert answers == [expected[i % 4] for i in range(12)]
    assert (
        len({tuple(engine.store.session(o.session_id).holding.feature_blocks) for o in opened}) == 4
    )
    engine.check_integrity()


def test_a_session_whose_prefix_owner_closed_keeps_answering_and_its_blocks_stay_reusable(
    demo_model, unshared
):
    engine = new_engine(demo_model)
    image = held_out_samples(1, seed=20_034)[0].image
    owner = engine.open(image).session_id
    sharer = engine.open(image).session_id
    engine.close(owner)
    assert conversation(engine, sharer) == reference(unshared, image)
    engine.close(sharer)
    assert engine.memory.pool.free_blocks == engine.memory.pool.total_blocks
    again = engine.open(image)  # recently freed: still there
    assert again.cached_tokens > 0
    assert conversation(engine, again.session_id) == reference(unshared, image)


def test_a_system_prompt_is_shared_across_images_and_not_across_system_prompts(demo_model):
    long_system = SYSTEM * 3  # several blocks before the image
    engine = new_engine(demo_model, system_prompt=long_system)
    a, b = held_out_samples(2, seed=20_035)
    engine.open(a.image)
    across_images = engine.open(b.image)
    block = engine.memory.pool.block_tokens
    before_image = first_image_token(engine, long_system) // block * block
    assert across_images.cached_tokens == before_image > 0
    assert engine.open(a.image, system="Answer in one word.").cached_tokens == 0


def test_sharing_off_computes_every_open(demo_model):
    engine = new_engine(demo_model, sharing="off")
    image = held_out_samples(1, seed=20_036)[0].image
    opened = [engine.open(image) for _ in range(2)]
    assert [o.cached_tokens for o in opened] == [0, 0]
    assert opened[0].prefill_tokens == opened[1].prefill_tokens
    counters = engine.memory.stats().counters
    assert (counters.prefix_hits, counters.feature_hits) == (0, 0)


def test_shared_sessions_under_memory_pressure_answer_alike(demo_model, unshared):
    """A device budget for about three sessions, eight sessions on two images: they move
    down and come back on whatever is still shared; every answer is the unshared one."""
    probe = new_engine(demo_model)
    probe.open(held_out_samples(1, seed=20_037)[0].image)
    one_session = probe.stats().total_bytes
    engine = new_engine(demo_model, budget=3 * one_session)
    images = [s.image for s in held_out_samples(2, seed=20_038)]
    session_ids = [engine.open(images[i % 2]).session_id for i in range(8)]
    expected = [reference(unshared, image) for image in images]
    for i, session_id in enumerate(session_ids):
        assert conversation(engine, session_id) == expected[i % 2]
    counters = engine.memory.stats().counters
    assert counters.demoted + counters.evicted > 0  # the budget was felt
    engine.check_integrity()


def test_sessions_share_again_after_a_worker_restart(demo_model, unshared, tmp_path):
    def started() -> Engine:
        return new_engine(demo_model, persist_dir=str(tmp_path))

    image = held_out_samples(1, seed=20_039)[0].image
    before = started()
    session_ids = [before.open(image).session_id for _ in range(3)]
    before.stop()
    after = started()
    assert after.adopted == 3
    expected = reference(unshared, image)
    answers = [conversation(after, session_id) for session_id in session_ids]
    assert answers == [expected] * 3
    counters = after.memory.stats().counters
    assert counters.feature_hits == 2  # read back once, then held once for all three
    assert counters.prefix_hits >= 2  # the first recompute was shared


def asked_cold(engine: Engine, image, question: str) -> tuple[int, int]:
    """``(cachedTokens, newTokens)`` of ``question`` in a new session on ``image`` whose KV
    left the device first: its turn starts on whatever published blocks its keys find."""
    session_id = engine.open(image).session_id
    assert engine.memory.move_down(engine.store.session(session_id).holding) is Tier.FEATURES
    answer = engine.ask(session_id, question, MAX_NEW)
    return answer.cached_tokens, answer.new_tokens


def probe_question(engine: Engine, seed: int, owner_closed: bool = False):
    """A session asks ASKED; then usage of ASKED (a right guess) and of GUESSED_WRONG."""
    image = held_out_samples(1, seed=seed)[0].image
    owner = engine.open(image).session_id
    engine.ask(owner, ASKED, MAX_NEW)
    if owner_closed:
        engine.close(owner)
    right, wrong = asked_cold(engine, image, ASKED), asked_cold(engine, image, GUESSED_WRONG)
    assert sum(right) == sum(wrong)  # prompts of one length: only the text differs
    return right, wrong


@pytest.mark.parametrize("owner_closed", [False, True], ids=["owner-open", "owner-closed"])
def test_usage_cannot_confirm_another_sessions_question(demo_model, owner_closed):
    right, wrong = probe_question(new_engine(demo_model), 20_040, owner_closed)
    assert right == wrong
    assert right[0] > 0  # the opening is still shared


def test_sharing_all_reuses_another_sessions_question_as_before(demo_model):
    right, wrong = probe_question(new_engine(demo_model, sharing="all"), 20_041, True)
    assert right[0] > wrong[0] and right[1] < wrong[1]


@pytest.mark.parametrize("sharing", ["opening", "all"])
def test_a_callers_own_system_prompt_is_shared_only_under_all(demo_model, sharing):
    engine = new_engine(demo_model, sharing=sharing)
    image = held_out_samples(1, seed=20_042)[0].image
    engine.open(image, system=OWN_SYSTEM)
    right, wrong = (engine.open(image, system=s) for s in (OWN_SYSTEM, GUESSED_SYSTEM))
    openings = (engine.loaded.prompt.opening_ids(True, 4, s) for s in (OWN_SYSTEM, GUESSED_SYSTEM))
    assert len(set(map(len, openings))) == 1  # only the text differs
    if sharing == "opening":  # a right guess looks exactly like a wrong one
        assert right.cached_tokens == wrong.cached_tokens == 0
        assert right.prefill_tokens == wrong.prefill_tokens
    else:
        assert right.cached_tokens > wrong.cached_tokens


def test_the_operators_system_prompt_sent_as_ones_own_confirms_nothing(demo_model):
    engine = new_engine(demo_model)
    image = held_out_samples(1, seed=20_045)[0].image
    assert engine.open(image).cached_tokens == 0
    assert engine.open(image).cached_tokens > 0  # the operator's SYSTEM: shared
    assert engine.open(image, system=SYSTEM).cached_tokens == 0  # the caller's: never


def test_tenants_share_nothing_and_a_tenant_shares_with_itself(demo_model):
    engine = new_engine(demo_model, system_prompt=SYSTEM * 3)  # blocks before the image too
    image = held_out_samples(1, seed=20_043)[0].image
    vision_runs = []
    tower = engine.loaded.model.model.vision_tower
    hook = tower.register_forward_hook(lambda *_: vision_runs.append(1))
    try:
        first = engine.open(image, tenant="acme")
        others = [engine.open(image, tenant="globex"), engine.open(image)]  # no tenant: a third
        assert [o.cached_tokens for o in others] == [0, 0]
        assert len(vision_runs) == 3 and engine.memory.stats().counters.feature_hits == 0
        again = engine.open(image, tenant="acme")
    finally:
        hook.remove()
    block = engine.memory.pool.block_tokens
    assert again.cached_tokens == first.prefill_tokens // block * block
    assert len(vision_runs) == 3 and engine.memory.stats().counters.feature_hits == 1
    with pytest.raises(InvalidRequest, match="'tenant'"):
        engine.open(image, tenant="")


def test_an_adopted_session_keeps_its_tenant(demo_model, tmp_path):
    image = held_out_samples(1, seed=20_044)[0].image
    before = new_engine(demo_model, persist_dir=str(tmp_path))
    session_id = before.open(image, tenant="acme").session_id
    before.stop()
    after = new_engine(demo_model, persist_dir=str(tmp_path))
    sharing = after.store.session(session_id).sharing
    assert (sharing.tenant, sharing.opening_tokens > 0) == ("acme", True)
    after.ask(session_id, QUESTIONS[0], MAX_NEW)  # recomputed: publishes its opening again
    assert after.open(image, tenant="globex").cached_tokens == 0
    assert after.open(image, tenant="acme").cached_tokens > 0
