"""``make mar`` refuses a checkpoint the engine does not serve, in one line, within seconds, from
its small files (llava.model.checkpoint), before anything is archived.

The checkpoints: tests/checkpoints.py. The container's start refuses the same way
(tests/serving/test_container_entrypoint.py).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checkpoints import (
    LLAVA_15,
    LLAVA_NEXT,
    UNSUPPORTED,
    fixture_copy,
    unsupported_checkpoint,
)
from tests.conftest import REPO

REFUSAL_S = 30  # a bound, not a benchmark: seconds, not a weight load
# Child processes, each importing the engine (seconds apiece on a CPU): make test runs them;
# the refusals themselves are checked in-process in tests/unit/test_checkpoint_inspect.py.
pytestmark = pytest.mark.thorough


def make_mar(*args: str | Path) -> tuple[subprocess.CompletedProcess, float]:
    command = [sys.executable, "-m", "serving.mar", *map(str, args)]
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    return done, time.monotonic() - began


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_make_mar_refuses_an_unsupported_checkpoint_in_one_line_within_seconds(tmp_path, case):
    checkpoint, says = unsupported_checkpoint(tmp_path / "checkpoint", case)
    store = tmp_path / "store"
    refused, took = make_mar("--model-dir", checkpoint, "--export-path", store)
    print(f"{case}: refused in {took:.1f} s: {refused.stderr.strip()}")
    assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith(f"make mar: {checkpoint} cannot be served: ")
    assert says in refused.stderr
    assert refused.stderr.rstrip().endswith("MODEL_DIR=<a llava-hf checkpoint dir> chooses another")
    assert not store.exists()  # refused before anything was built
    assert took < REFUSAL_S


@pytest.mark.parametrize("fixture", [LLAVA_15, LLAVA_NEXT], ids=lambda f: f.name)
def test_make_mar_archives_a_supported_checkpoint(tmp_path, fixture):
    """The fixtures as published pass the checks, so their copies are archived (the dummy
    weights would only fail when a worker loads them)."""
    checkpoint, store = fixture_copy(tmp_path / "checkpoint", fixture), tmp_path / "store"
    built, _ = make_mar("--model-dir", checkpoint, "--weights", "inside", "--export-path", store)
    assert built.returncode == 0, built.stderr
    assert (store / "llava.mar").is_file()
