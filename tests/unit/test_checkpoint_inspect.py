"""A checkpoint the engine cannot serve is refused from its small files, in one line, before any
weight is read (llava.model.checkpoint); the real checkpoints' files are accepted."""

from __future__ import annotations

import time

import pytest

from llava.config import EngineConfig
from llava.engine import Engine
from llava.model.checkpoint import UnsupportedCheckpoint, inspect_checkpoint
from tests.checkpoints import LLAVA_15, LLAVA_NEXT, edit_config, fixture_copy, last_message_only


def top(**values):
    return edit_config(lambda config: config.update(values))


def text(**values):
    return edit_config(lambda config: config["text_config"].update(values))


@pytest.mark.parametrize(
    "source", [LLAVA_15, LLAVA_NEXT], ids=["llava-1.5-7b", "llava-v1.6-mistral"]
)
def test_the_real_checkpoints_files_are_accepted(source):
    inspected = inspect_checkpoint(source)
    assert inspected.model_class.__name__.startswith("Llava")
    assert inspected.eos_token_ids == frozenset({2})


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (top(model_type="llava_onevision"), "model type 'llava_onevision'"),
        (text(model_type="qwen2"), "text model type 'qwen2'"),
        (text(sliding_window=4096), "sliding_window 4096"),
        (text(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
        (top(vision_feature_select_strategy="cls"), "vision_feature_select_strategy"),
        (top(image_grid_pinpoints=[[336, 672]]), "image_grid_pinpoints differ"),
        (last_message_only, "not append-only"),
    ],
    ids=["model-type", "text-model", "sliding-window", "rope", "strategy", "pinpoints", "template"],
)
def test_an_unsupported_checkpoint_is_refused_in_one_line_naming_what(tmp_path, edit, named):
    directory = fixture_copy(tmp_path / "checkpoint", LLAVA_NEXT, edit)
    start = time.monotonic()
    with pytest.raises(UnsupportedCheckpoint) as refused:
        inspect_checkpoint(directory)
    assert time.monotonic() - start < 30  # seconds, never a load
    line = str(refused.value)
    assert named in line and str(directory) in line
    assert "\n" not in line


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(UnsupportedCheckpoint, match="no config.json"):
        inspect_checkpoint(tmp_path)


def test_the_engine_refuses_before_reading_weights(tmp_path):
    """The weights file is garbage: a start that read it first would fail on it instead."""
    directory = fixture_copy(tmp_path / "checkpoint", LLAVA_NEXT, text(model_type="qwen2"))
    (directory / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(UnsupportedCheckpoint, match="text model type 'qwen2'"):
        Engine.from_config(EngineConfig(model_dir=str(directory), device="cpu"))
