"""A checkpoint the engine cannot serve is refused from its small files, in one line, before any
weight is read (llava.model.checkpoint); the real checkpoints' files are accepted."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from llava.config import EngineConfig
from llava.engine import Engine
from llava.model.checkpoint import UnsupportedCheckpoint, inspect_checkpoint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NEXT = FIXTURES / "llava-v1.6-mistral-7b-hf"
LLAVA_15 = FIXTURES / "llava-1.5-7b-hf"
# Renders only the last message: every turn rewrites what the KV cache holds.
LAST_MESSAGE_ONLY = "{% for m in messages[-1:] %}{{ m['content'][-1]['text'] }}{% endfor %}"


def edited(tmp_path: Path, source: Path, config=None, text=None, template=None) -> Path:
    """A copy of ``source`` with config.json's top level and text_config updated."""
    out = tmp_path / source.name
    shutil.copytree(source, out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(config or {})
    raw["text_config"].update(text or {})
    (out / "config.json").write_text(json.dumps(raw))
    if template is not None:
        (out / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    return out


@pytest.mark.parametrize("source", [LLAVA_15, NEXT], ids=["llava-1.5-7b", "llava-v1.6-mistral"])
def test_the_real_checkpoints_files_are_accepted(source):
    inspected = inspect_checkpoint(source)
    assert inspected.model_class.__name__.startswith("Llava")
    assert inspected.eos_token_ids == frozenset({2})


@pytest.mark.parametrize(
    ("config", "text", "template", "named"),
    [
        ({"model_type": "llava_onevision"}, {}, None, "model type 'llava_onevision'"),
        ({}, {"model_type": "qwen2"}, None, "text model type 'qwen2'"),
        ({}, {"sliding_window": 4096}, None, "sliding_window 4096"),
        (
            {},
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            None,
            "rope type 'dynamic'",
        ),
        ({"vision_feature_select_strategy": "cls"}, {}, None, "vision_feature_select_strategy"),
        ({"image_grid_pinpoints": [[336, 672]]}, {}, None, "image_grid_pinpoints differ"),
        ({}, {}, LAST_MESSAGE_ONLY, "not append-only"),
    ],
    ids=["model-type", "text-model", "sliding-window", "rope", "strategy", "pinpoints", "template"],
)
def test_an_unsupported_checkpoint_is_refused_in_one_line_naming_what(
    tmp_path, config, text, template, named
):
    directory = edited(tmp_path, NEXT, config, text, template)
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
    directory = edited(tmp_path, NEXT, text={"model_type": "qwen2"})
    (directory / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(UnsupportedCheckpoint, match="text model type 'qwen2'"):
        Engine.from_config(EngineConfig(model_dir=str(directory), device="cpu"))
