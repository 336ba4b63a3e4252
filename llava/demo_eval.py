"""The demo model's dialogues as token ids, and its held-out evaluation.

Training (``scripts/build_demo_model.py``) and evaluation (here, and ``tests/test_demo_model.py``)
build a conversation's token ids exactly the way the engine does, through
:class:`llava.prompt.ChatPrompt`: the first turn is the processor's ids for
``first_turn(question, with_image=True)`` (BOS and the expanded image tokens included), every
answer is its words' ids plus EOS, and every later turn is the tokenizer's ids for
``follow_up(question)`` without special tokens. Evaluation then decodes greedily until EOS and
appends exactly the generated ids, as the engine does; a model that passes here answers the
same way when served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from llava.prompt import ChatPrompt
from llava.synthetic import HELD_OUT_SEED_START, ShapeSample, held_out_samples

COLOR_QUESTION = "What color is the shape?"
SHAPE_QUESTION = "What shape is it?"
COLOR_FOLLOW_UP = "And its color?"  # only after an answer that names a shape
SHAPE_FOLLOW_UP = "And its shape?"  # only after an answer that names a colour
REPEAT = "Say that again."  # repeats the previous answer
QUESTIONS = (COLOR_QUESTION, SHAPE_QUESTION, COLOR_FOLLOW_UP, SHAPE_FOLLOW_UP, REPEAT)

# The question types the demo model must get right, each scored on its own.
KINDS = ("first_color", "first_shape", "follow_up_color", "follow_up_shape", "repeat")

# Per image, two evaluated conversations cover every kind once (repeat twice).
EVAL_DIALOGUES = (
    ((SHAPE_QUESTION, "first_shape"), (COLOR_FOLLOW_UP, "follow_up_color"), (REPEAT, "repeat")),
    ((COLOR_QUESTION, "first_color"), (SHAPE_FOLLOW_UP, "follow_up_shape"), (REPEAT, "repeat")),
)


@dataclass(frozen=True)
class DialogueTokens:
    """Token ids of the pieces of a conversation, as the engine appends them."""

    processor: object

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def first_turn(self, question: str, image: Image.Image) -> tuple[list[int], torch.Tensor]:
        """Ids of the image + first question (BOS and expanded image tokens), and pixels."""
        text = ChatPrompt(self.processor).first_turn(question, with_image=True)
        inputs = self.processor(text=text, images=image, return_tensors="pt")
        return inputs.input_ids[0].tolist(), inputs.pixel_values

    def follow_up(self, question: str) -> list[int]:
        text = ChatPrompt(self.processor).follow_up(question)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def answer(self, text: str) -> list[int]:
        """An answer as the engine stores it: the generated ids, ending with EOS."""
        return self.tokenizer(text, add_special_tokens=False).input_ids + [self.eos_id]

    def engine_first_turn(self, question: str, image: Image.Image) -> list[int]:
        """The same first turn split as the engine prefills it: opening at open, then question."""
        prompt = ChatPrompt(self.processor)
        opening = self.processor(text=prompt.opening(with_image=True), images=image).input_ids
        question_text = prompt.first_question(question, with_image=True)
        return list(opening[0]) + self.tokenizer(question_text, add_special_tokens=False).input_ids


def answer_for(question: str, sample: ShapeSample, previous: str | None) -> str:
    """The correct answer to ``question`` about ``sample`` after the answer ``previous``."""
    if question in (COLOR_QUESTION, COLOR_FOLLOW_UP):
        return sample.color
    if question in (SHAPE_QUESTION, SHAPE_FOLLOW_UP):
        return sample.shape
    if question == REPEAT:
        if previous is None:
            raise ValueError("'Say that again.' needs a previous answer")
        return previous
    raise ValueError(f"the demo model knows no question {question!r}")


@torch.inference_mode()
def greedy_answer(
    model, ids: list[int], pixel_values: torch.Tensor, eos_id: int, max_new_tokens: int = 4
) -> list[int]:
    """Greedy ids after ``ids`` until EOS (included) or ``max_new_tokens``; full recompute."""
    pixel_values = pixel_values.to(model.device, model.dtype)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        input_ids = torch.tensor([ids + generated], device=model.device)
        logits = model(input_ids=input_ids, pixel_values=pixel_values, logits_to_keep=1).logits
        generated.append(int(logits[0, -1].argmax()))
        if generated[-1] == eos_id:
            break
    return generated


def evaluate(model, processor, samples: Sequence[ShapeSample]) -> dict[str, float]:
    """Exact-match accuracy per question kind, generating greedily turn after turn."""
    pieces = DialogueTokens(processor)
    follow_ups = {q: pieces.follow_up(q) for q in QUESTIONS}
    right = dict.fromkeys(KINDS, 0)
    total = dict.fromkeys(KINDS, 0)
    model.eval()
    for sample in samples:
        for dialogue in EVAL_DIALOGUES:
            ids: list[int] = []
            pixel_values = None
            truth = None
            for turn, (question, kind) in enumerate(dialogue):
                if turn == 0:
                    ids, pixel_values = pieces.first_turn(question, sample.image)
                else:
                    ids = ids + follow_ups[question]
                truth = answer_for(question, sample, truth)
                generated = greedy_answer(model, ids, pixel_values, pieces.eos_id)
                ids = ids + generated
                total[kind] += 1
                right[kind] += generated == pieces.answer(truth)
    return {kind: right[kind] / total[kind] for kind in KINDS}


def evaluate_dir(model_dir: str, n: int = 100, seed: int = HELD_OUT_SEED_START) -> dict[str, float]:
    """Load a saved model directory the way the engine does and evaluate it on held-out images."""
    from llava.model import load_model

    loaded = load_model(model_dir, device="cpu", dtype="float32")
    return evaluate(loaded.model, loaded.processor, held_out_samples(n, seed))
