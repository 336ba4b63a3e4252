"""Every Python snippet of the README runs as written: copied from README.md, run from the
repository root in a fresh interpreter (nothing prepared for it); the engine's answers are right."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from demo_model.synthetic import held_out_samples
from tests.conftest import REPO

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^## (.+)$", re.MULTILINE)
ENGINE = "The engine from Python, without TorchServe"
# the image the engine snippet asks about: held_out_samples(n, seed=...)[i].image
SAMPLE = re.compile(r"held_out_samples\((\d+), seed=([\d_]+)\)\[(\d+)\]\.image")
# Child processes, each loading the engine and the demo model: make test runs them.
pytestmark = pytest.mark.thorough


def python_snippets() -> dict[str, str]:
    """Each ```python block of README.md, by the heading it is under (one per heading)."""
    readme = (REPO / "README.md").read_text()
    snippets = {}
    for block in FENCE.finditer(readme):
        if block.group(1) == "python":
            heading = ([h.group(1) for h in HEADING.finditer(readme, 0, block.start())] or [""])[-1]
            assert heading not in snippets, f"two Python snippets under {heading!r}"
            snippets[heading] = block.group(2)
    return snippets


@pytest.fixture(scope="module")
def ran() -> dict[str, subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a reader's shell has
    return {
        heading: subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        for heading, code in python_snippets().items()
    }


def test_every_python_snippet_runs_as_written(ran):
    assert ENGINE in ran  # and whatever other snippets the README has
    failed = {heading: done.stderr[-2000:] for heading, done in ran.items() if done.returncode}
    assert failed == {}


def test_engine_from_python_snippet_runs(ran):
    lines = ran[ENGINE].stdout.splitlines()
    # the shape and colour of the snippet's own image, whichever sample it takes
    n, seed, index = SAMPLE.search(python_snippets()[ENGINE]).groups()
    sample = held_out_samples(int(n), seed=int(seed))[int(index)]
    assert lines[0].startswith(f"What shape is it? {sample.shape} (")
    assert lines[1].startswith(f"And its color? {sample.color} (")
