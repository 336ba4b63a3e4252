"""LLaVA-NeXT on Mistral at the checkpoint's own image geometry (336-px tiles): a square image
opens 2,928 image tokens, and the turns after it decode through the paged path (GQA: 4 query
heads on 2 KV heads) token for token as Hugging Face's generate, fp32. On the CPU (the paged flex
path CUDA serves, forced) and on CUDA (``auto``'s choice and the decode graphs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llava.config import EngineConfig
from llava.engine import Engine
from llava.exec.attention import PAGED
from llava.kv.budget import MemoryBudget
from llava.model.loading import load_model
from llava.model.vision import image_tokens
from tests.families import FAMILIES, build_family, picture
from tests.unit.test_checkpoint_fidelity import conversation, hf_generate, hf_inputs, last_prompt
from tests.unit.test_family_fidelity import QUESTIONS

MAX_NEW = 8
CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("next-336px")
    build_family(out, FAMILIES["v1.6-mistral"], tile_px=336)
    return out


# thorough on the CPU: flex compiles there (about 30 s); make test runs it, test-fast does not
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.thorough), CUDA])
def test_a_square_image_opens_2928_tokens_and_answers_as_hf_generate(checkpoint, device):
    loaded = load_model(str(checkpoint), device=device, dtype="float32")
    attention = "flex" if device == "cpu" else "auto"
    engine = Engine(loaded, EngineConfig("-", attention=attention), MemoryBudget(1 << 28))
    engine.warm_up()  # on CUDA: auto's timed choice and the decode graphs
    assert engine.runner.attention in PAGED
    image = picture(672, 672)
    opened = engine.open(image)
    assert opened.image_tokens == image_tokens(loaded.processor, *image.size) == 2928
    turns: list[tuple[str, str]] = []
    for question in QUESTIONS[:3]:
        answer = engine.ask(opened.session_id, question, {"max_new_tokens": MAX_NEW})
        inputs = hf_inputs(loaded, conversation(turns, question, image)).to(device)
        assert last_prompt(engine, opened.session_id, answer) == inputs["input_ids"][0].tolist()
        assert list(answer.token_ids) == hf_generate(engine, inputs, MAX_NEW), question
        turns.append((question, answer.text))
    engine.check_integrity()
