"""Whether the engine serves a checkpoint directory, decided from its small files before any weight.

``inspect_checkpoint`` reads ``config.json``, the generation config and the processor files
(tokenizer, image processor, chat template), builds the model on PyTorch's meta device (no
memory, about a second for a 7B), and runs every check the engine's start would run: the model
type, the step runner's view of the text model (llava.exec.runner: type, rope, sliding window,
layer parts), the image processor matching the model, the aspect-ratio mode, an end token, and
the chat template being append-only. What fails is refused in one line naming it
(UnsupportedCheckpoint), within seconds; a checkpoint that passes loads and serves. The callers:
``load_model`` (so Engine.from_config and each shard), ``make mar``, the container's start and
``python -m capacity`` (docs/models.md §Supported checkpoints).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoProcessor,
    GenerationConfig,
    LlavaForConditionalGeneration,
    LlavaNextForConditionalGeneration,
)

from llava.config import SettingsError
from llava.exec.runner import Runner
from llava.model.imageprep import image_aspect_ratio
from llava.model.prompt import ChatPrompt

# config.json's model_type → the model class and the processor class that counts its image tokens.
MODEL_CLASSES = {
    "llava": (LlavaForConditionalGeneration, "LlavaProcessor"),
    "llava_next": (LlavaNextForConditionalGeneration, "LlavaNextProcessor"),
}


class UnsupportedCheckpoint(SettingsError):
    """A checkpoint this engine does not serve; ``str()`` is one line naming what and why."""

    def __init__(self, model_dir: str, problem: str):
        super().__init__("model_dir", f"{model_dir} cannot be served: {problem}")


@dataclass(frozen=True)
class Inspected:
    """What the checks read, for the caller to load (or size) without reading it again."""

    config: object  # a LlavaConfig or LlavaNextConfig
    model_class: type
    processor: object
    prompt: ChatPrompt
    eos_token_ids: frozenset[int]
    image_aspect_ratio: str | None

    @property
    def family(self) -> str:
        return self.config.model_type


def inspect_checkpoint(model_dir: str | Path) -> Inspected:
    """Raise UnsupportedCheckpoint unless the engine serves ``model_dir``; reads no weights."""
    model_dir = str(model_dir)
    try:
        return _inspect(model_dir)
    except UnsupportedCheckpoint:
        raise
    except Exception as e:  # transformers' own refusals come in many types, often multi-line
        raise UnsupportedCheckpoint(model_dir, _flattened(e)) from e


def _inspect(model_dir: str) -> Inspected:
    model_type = _model_type(model_dir)
    if model_type not in MODEL_CLASSES:
        known = ", ".join(MODEL_CLASSES)
        raise UnsupportedCheckpoint(model_dir, f"model type {model_type!r} (serves: {known})")
    model_class, processor_class = MODEL_CLASSES[model_type]
    config = AutoConfig.from_pretrained(model_dir)
    problem = _runner_problem(model_class, config)
    if problem:
        raise UnsupportedCheckpoint(model_dir, problem)
    processor = AutoProcessor.from_pretrained(model_dir)
    problem = _processor_problem(processor, processor_class, config)
    if problem:
        raise UnsupportedCheckpoint(model_dir, problem)
    prompt = ChatPrompt(processor)
    prompt.check_stateful()  # ValueError naming the template's problem
    return Inspected(
        config=config,
        model_class=model_class,
        processor=processor,
        prompt=prompt,
        eos_token_ids=_eos_ids(model_dir, config, processor.tokenizer),
        image_aspect_ratio=image_aspect_ratio(config),
    )


def _model_type(model_dir: str) -> str | None:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UnsupportedCheckpoint(model_dir, "no config.json: not a llava-hf checkpoint dir")
    try:
        return json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise UnsupportedCheckpoint(model_dir, f"config.json is not a JSON object: {e}") from e


def _runner_problem(model_class: type, config) -> str | None:
    """The step runner's checks on the model built without memory (its modules, no weights)."""
    with torch.device("meta"):
        model = model_class(config)
    return Runner.supports(model)


def _processor_problem(processor, expected: str, config) -> str | None:
    """The processor must count image tokens the way the model makes features."""
    name = type(processor).__name__
    if name != expected:
        return f"processor {name} with a {config.model_type} model (needs {expected})"
    if not getattr(processor, "chat_template", None):
        return "no chat template (chat_template.json or the tokenizer's)"
    pinpoints = getattr(processor.image_processor, "image_grid_pinpoints", None)
    if config.model_type == "llava_next" and _pairs(pinpoints) != _pairs(
        config.image_grid_pinpoints
    ):
        return "the image processor's image_grid_pinpoints differ from config.json's"
    return None


def _pairs(points) -> list[tuple[int, int]]:
    return [tuple(point) for point in points or []]


def _eos_ids(model_dir: str, config, tokenizer) -> frozenset[int]:
    """The ids that end an answer: generation_config.json's, else the tokenizer's."""
    try:
        ids = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: the model config's own
        ids = GenerationConfig.from_model_config(config).eos_token_id
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        raise UnsupportedCheckpoint(model_dir, "no end-of-answer token: answers would never end")
    return frozenset(ids if isinstance(ids, list) else [ids])


def _flattened(error: Exception, limit: int = 300) -> str:
    """``Type: message`` on one line (a config validation error names the field on line 2)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:limit]}"
