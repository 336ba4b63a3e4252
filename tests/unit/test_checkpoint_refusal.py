"""``make mar`` refuses a checkpoint the engine does not serve, in one line, within seconds, from
its small files (llava.model.checkpoint), before anything is archived.

The checkpoints are copies of the fixtures (every file of the real checkpoints but the weights)
with one thing changed, and a dummy ``model.safetensors``: ``make mar`` wants weights there, and
a refusal that read them would fail on the dummy instead of naming the problem. The container's
start refuses the same way (tests/serving/test_container_entrypoint.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures"
LLAVA_15 = FIXTURES / "llava-1.5-7b-hf"
LLAVA_NEXT = FIXTURES / "llava-v1.6-mistral-7b-hf"
REFUSAL_S = 30  # a bound, not a benchmark: seconds, not a weight load
# Renders only the last user message: every turn rewrites the prompt a session's cache holds.
LAST_MESSAGE_ONLY = (
    "{% set m = messages[-1] %}USER: {% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}<image>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)


def edit_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(checkpoint: Path) -> None:
        config = json.loads((checkpoint / "config.json").read_text())
        change(config)
        (checkpoint / "config.json").write_text(json.dumps(config, indent=2))

    return edit


def last_message_only(checkpoint: Path) -> None:
    (checkpoint / "chat_template.json").write_text(json.dumps({"chat_template": LAST_MESSAGE_ONLY}))


# (fixture, edit, what the one line names)
UNSUPPORTED = {
    "qwen2 text model": (
        LLAVA_15,
        edit_config(lambda c: c["text_config"].update(model_type="qwen2")),
        "text model type 'qwen2'",
    ),
    "sliding window": (
        LLAVA_NEXT,
        edit_config(lambda c: c["text_config"].update(sliding_window=1024)),
        "sliding-window attention (sliding_window 1024)",
    ),
    "paligemma": (
        LLAVA_15,
        edit_config(lambda c: c.update(model_type="paligemma")),
        "model type 'paligemma'",
    ),
    "template not append-only": (LLAVA_15, last_message_only, "chat template is not append-only"),
}


def fixture_copy(path: Path, fixture: Path, edit: Callable[[Path], None] | None = None) -> Path:
    """A copy of ``fixture`` at ``path`` with a dummy weights file, then ``edit`` applied."""
    shutil.copytree(fixture, path)
    save_file({"x": torch.zeros(1)}, path / "model.safetensors")
    if edit is not None:
        edit(path)
    return path


def unsupported_checkpoint(path: Path, case: str) -> tuple[Path, str]:
    """A checkpoint at ``path`` that the engine does not serve, and what its refusal names."""
    fixture, edit, says = UNSUPPORTED[case]
    return fixture_copy(path, fixture, edit), says


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
