"""Shared fixtures: the committed demo model, loaded once per test run."""

from __future__ import annotations

import gc
import itertools
import os
from pathlib import Path

import pytest

# The engine (torch, transformers) is imported where a fixture needs it, not here: every
# process that runs tests loads this file, the one that only hands tests out included.
REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL_DIR = REPO / "models" / "demo-llava"
# Every TorchServe, endpoint and container entrypoint a test starts inherits this: the served
# archive's persistent tier (/dev/shm/stateful-llava) is off, so tests never share that
# directory or adopt each other's sessions; the tier's own tests pass a temporary directory
# (docs/engine/sessions.md §Persistent tier).
os.environ["LLAVA_PERSIST_DIR"] = "null"
# Without a GPU, Triton kernels (llava.exec.triton_decode) run on CPU tensors through Triton's
# interpreter, which Triton picks when a kernel is defined: set before any test imports one.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Until the tests are collected, no garbage collection: importing torch, transformers and the
# test modules made the collector's full passes over all their objects cost about 3 s a process.
gc.disable()
# make test-fast runs the unit tier on every core (pytest-xdist): one torch thread a worker,
# so the workers do not fight over the cores (the tiny models gain nothing from more).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


# make test-fast (-m "not thorough") leaves the tests marked thorough out: there, the property
# tests draw fewer examples (hypothesis_examples); make test, -m thorough and no -m draw them all.
FAST_TIER = False


def pytest_configure(config):
    global FAST_TIER
    from _pytest.mark.expression import Expression

    markexpr = config.getoption("markexpr", "")
    if markexpr:  # an unmarked test selected, one marked only thorough left out
        selects = Expression.compile(markexpr).evaluate
        unmarked, thorough = (lambda *_, **__: False), (lambda name, **_: name == "thorough")
        FAST_TIER = selects(unmarked) and not selects(thorough)


def hypothesis_examples(thorough: int) -> int:
    """A property test's ``max_examples``: ``thorough`` where the thorough tests run, a fifth
    of it (at least 20) in make test-fast. Read when a test module is imported (collection),
    after pytest_configure."""
    return max(20, thorough // 5) if FAST_TIER else thorough


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    try:
        return (yield)
    finally:  # the objects the imports made are frozen: the tests' collections skip them
        gc.freeze()
        gc.enable()


def pytest_unconfigure(config):
    # The interpreter's last garbage collection walks every object the tests left: seconds
    # per process (botocore's and moto's models, engines, tensors), for memory the ending
    # process hands back anyway. Frozen objects are left out of that walk.
    gc.freeze()


@pytest.fixture(scope="module")
def moto_url():
    """moto's server on 127.0.0.1 for a module's tests (tests/aws_local.py): its URL."""
    from tests.aws_local import moto_endpoint

    with moto_endpoint() as url:
        yield url


@pytest.fixture(scope="session")
def demo_model():
    from llava.model.loading import load_model

    return load_model(str(DEMO_MODEL_DIR))


def recognized(demo_model, seed: int = 20_000):
    """Held-out images whose colour and shape the model names in a fresh, isolated session,
    in order, each tried when the caller asks for the next.

    The model is ~99 % accurate (tests/unit/test_demo_model.py checks that); these tests are about
    what sessions do to answers, so they start from images it is known to get right alone.
    """
    from demo_model.synthetic import held_out_samples
    from llava.config import EngineConfig
    from llava.engine import Engine
    from llava.kv.budget import MemoryBudget

    engine = Engine(demo_model, EngineConfig(model_dir="-"), MemoryBudget(1 << 30))
    for candidate in held_out_samples(200, seed=seed):
        session_id = engine.open(candidate.image).session_id
        color = engine.ask(session_id, "What color is the shape?").text
        shape = engine.ask(session_id, "And its shape?").text
        if (color, shape) == (candidate.color, candidate.shape):
            yield candidate


def recognized_samples(demo_model, n: int, seed: int = 20_000):
    """The first ``n`` of ``recognized``."""
    found = list(itertools.islice(recognized(demo_model, seed), n))
    if len(found) < n:
        raise AssertionError(f"the demo model recognized fewer than {n} of 200 held-out images")
    return found


@pytest.fixture(scope="module")
def sample(demo_model):
    return recognized_samples(demo_model, 1)[0]
