"""Checkpoints the engine does not serve, made from the fixtures (every file of the real
checkpoints but the weights) with one thing changed: what ``make mar``, the container's start,
``python -m capacity`` and ``inspect_checkpoint`` must refuse in one line."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LLAVA_15 = FIXTURES / "llava-1.5-7b-hf"
LLAVA_NEXT = FIXTURES / "llava-v1.6-mistral-7b-hf"
# Renders only the last user message: every turn rewrites the prompt a session's cache holds.
LAST_MESSAGE_ONLY = (
    "{% set m = messages[-1] %}USER: {% for c in m['content'] %}"
    "{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}<image>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} ASSISTANT:{% endif %}"
)


def edit_config(change: Callable[[dict], None]) -> Callable[[Path], None]:
    """An edit that applies ``change`` to a checkpoint's config.json."""

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
    """A copy of ``fixture`` at ``path`` with a dummy weights file (``make mar`` wants one; a
    refusal that read it would fail on it instead of naming the problem), then ``edit``."""
    shutil.copytree(fixture, path)
    save_file({"x": torch.zeros(1)}, path / "model.safetensors")
    if edit is not None:
        edit(path)
    return path


def unsupported_checkpoint(path: Path, case: str) -> tuple[Path, str]:
    """A checkpoint at ``path`` that the engine does not serve, and what its refusal names."""
    fixture, edit, says = UNSUPPORTED[case]
    return fixture_copy(path, fixture, edit), says
