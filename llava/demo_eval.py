"""The demo model's dialogues as token ids, and its held-out evaluation.

Evaluation (here, and ``tests/test_demo_model.py``) runs through :class:`llava.engine.Engine`,
one session per dialogue, greedy: what is scored is exactly what a served session answers.
Training (``scripts/build_demo_model.py``) builds conversations with :class:`DialogueTokens`
from the canonical prompt ids (:class:`llava.prompt.ChatPrompt`): the whole conversation
rendered by the chat template and tokenized at once, answers without an end token inside the
history, EOS as the target after an answer's last id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from llava.prompt import ChatPrompt, assistant_message, user_message
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
    """Canonical token ids of a conversation's pieces, as the engine's prompts hold them."""

    processor: object

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def first_turn(self, question: str, image: Image.Image) -> tuple[list[int], torch.Tensor]:
        """Ids of the image + first question (BOS and expanded image tokens), and pixels."""
        text = ChatPrompt(self.processor).render([user_message(question, with_image=True)])
        inputs = self.processor(text=text, images=image, return_tensors="pt")
        return inputs.input_ids[0].tolist(), inputs.pixel_values

    def follow_up(self, question: str) -> list[int]:
        """The ids a follow-up appends after an answer (diffed from canonical prompts)."""
        prompt = ChatPrompt(self.processor)
        first = [user_message(QUESTIONS[0])]
        answer = assistant_message("red")
        before = prompt.ids(first) + self.answer("red")[:-1]
        after = prompt.ids([*first, answer, user_message(question)])
        if after[: len(before)] != before:
            raise ValueError("the template does not append a follow-up to the answer's ids")
        return after[len(before) :]

    def answer(self, text: str) -> list[int]:
        """An answer as generated: its words' ids, ending with EOS (not kept in the history)."""
        return self.tokenizer(text, add_special_tokens=False).input_ids + [self.eos_id]


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


def evaluate(loaded, samples: Sequence[ShapeSample]) -> dict[str, float]:
    """Exact-match accuracy per question kind: one engine session per dialogue, greedy."""
    from llava.config import EngineConfig
    from llava.engine import Engine
    from llava.store import SessionStore

    engine = Engine(loaded, SessionStore(budget_bytes=1 << 34), EngineConfig(model_dir="-"))
    right = dict.fromkeys(KINDS, 0)
    total = dict.fromkeys(KINDS, 0)
    loaded.model.eval()
    for sample in samples:
        for dialogue in EVAL_DIALOGUES:
            session_id = engine.open(sample.image).session_id
            truth = None
            for question, kind in dialogue:
                truth = answer_for(question, sample, truth)
                answer = engine.ask(session_id, question, {"max_new_tokens": 4})
                total[kind] += 1
                right[kind] += answer.finished and answer.text == truth
            engine.close(session_id)
    return {kind: right[kind] / total[kind] for kind in KINDS}


def evaluate_dir(model_dir: str, n: int = 100, seed: int = HELD_OUT_SEED_START) -> dict[str, float]:
    """Load a saved model directory the way the engine does and evaluate it on held-out images."""
    from llava.model import load_model

    loaded = load_model(model_dir, device="cpu", dtype="float32")
    return evaluate(loaded, held_out_samples(n, seed))
