"""The LLaVA family as tiny random checkpoints: LLaVA-NeXT's anyres images on the Mistral, Vicuna
and Yi text models (tests/unit/test_family_fidelity.py says how each is made and checked)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from transformers import (
    AutoTokenizer,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    PreTrainedTokenizerBase,
)

from tests.mistral_tokenizer import mistral_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NEXT = FIXTURES / "llava-v1.6-mistral-7b-hf"
TILE_PX = 42  # 3 x 3 patches of 14 px a tile

# llava-hf/llava-v1.6-34b-hf's template (Yi-34B chat: ChatML), as its processor prints it.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{{'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def fixture_template(name: str) -> str:
    return json.loads((FIXTURES / name / "chat_template.json").read_text())["chat_template"]


def llama_tokenizer():
    """llava-1.5's LLaMA tokenizer (Vicuna's vocabulary), ``<image>`` 32000, ``<pad>`` 32001."""
    return AutoTokenizer.from_pretrained(FIXTURES / "llava-1.5-7b-hf")


@dataclass(frozen=True)
class Family:
    text: dict  # the text model's config (reduced sizes, the family's shape)
    template: str
    tokenizer: Callable[[], PreTrainedTokenizerBase] = llama_tokenizer


TINY_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
FAMILIES = {
    # Mistral-7B-Instruct-v0.2: GQA (32 query heads on 8 KV heads), rope theta 1e6, no window
    "v1.6-mistral": Family(
        {"num_attention_heads": 4, "num_key_value_heads": 2},  # the fixture's mistral text model
        fixture_template("llava-v1.6-mistral-7b-hf"),
        mistral_tokenizer,  # the checkpoint's own, from Mistral's SentencePiece model
    ),
    # Vicuna-7B/13B: LLaMA with one KV head per query head; llava-1.5's USER/ASSISTANT template
    "v1.6-vicuna": Family(
        {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 4},
        fixture_template("llava-1.5-7b-hf"),
    ),
    # Yi-34B: LLaMA's layers with GQA (56 query heads on 8 KV heads), rope theta 5e6, ChatML
    "v1.6-34b-yi": Family(
        {
            "model_type": "llama",
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e6},
        },
        CHATML,
    ),
}


def build_family(out: Path, family: Family, tile_px: int = TILE_PX) -> None:
    """A tiny random checkpoint of ``family`` in ``out``: its tiles ``tile_px`` square (the
    checkpoint's pinpoints scaled alike; 336 is the checkpoint's own geometry)."""
    scale = tile_px / 336
    raw = json.loads((NEXT / "config.json").read_text())
    raw["text_config"].update(TINY_TEXT, **family.text)
    raw["vision_config"].update(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=tile_px, projection_dim=32,
    )  # fmt: skip
    pinpoints = [[round(side * scale) for side in point] for point in raw["image_grid_pinpoints"]]
    raw["image_grid_pinpoints"] = pinpoints
    torch.manual_seed(0)
    LlavaNextForConditionalGeneration(LlavaNextConfig(**raw)).save_pretrained(out)
    processor = LlavaNextProcessor.from_pretrained(NEXT, tokenizer=family.tokenizer())
    processor.image_processor.crop_size = {"height": tile_px, "width": tile_px}
    processor.image_processor.size = {"shortest_edge": tile_px}
    processor.image_processor.image_grid_pinpoints = pinpoints
    processor.chat_template = family.template
    processor.save_pretrained(out)


def picture(width: int, height: int) -> Image.Image:
    """Shapes off-centre, so tiles and the unpadded grid's edges see different pixels."""
    image = Image.new("RGB", (width, height), (30, 90, 160))
    draw = ImageDraw.Draw(image)
    draw.rectangle((width // 8, height // 6, width // 2, height // 2), fill=(220, 40, 40))
    draw.ellipse((width // 2, height // 2, width - 3, height - 3), fill=(240, 220, 60))
    return image
