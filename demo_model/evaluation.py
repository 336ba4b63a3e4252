"""The demo model's dialogues as token ids, and its held-out evaluation.

Evaluation (here, and ``tests/unit/test_demo_model.py``) runs through :class:`llava.engine.Engine`,
one session per dialogue, greedy: what is scored is exactly what a served session answers.
Training (``demo_model/build.py``) builds conversations with :class:`DialogueTokens`
from the canonical prompt ids (:class:`llava.model.prompt.ChatPrompt`): the whole conversation
rendered by the chat template and tokenized at once, answers without an end token inside the
history, EOS as the target after an answer's last id.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from PIL import Image

from demo_model.synthetic import FAMILIES, HELD_OUT_SEED_START, ShapeSample, held_out_samples
from llava.model.prompt import ChatPrompt, assistant_message, user_message

COLOR_QUESTION = "What color is the shape?"
SHAPE_QUESTION = "What shape is it?"
COLOR_FOLLOW_UP = "And its color?"  # asked after an answer that names a shape
SHAPE_FOLLOW_UP = "And its shape?"  # asked after an answer that names a colour
REPEAT = "Say that again."  # repeats the previous answer
QUESTIONS = (COLOR_QUESTION, SHAPE_QUESTION, COLOR_FOLLOW_UP, SHAPE_FOLLOW_UP, REPEAT)
DONT_KNOW = "I don't know"  # the honest answer to every other question (one token)

# Questions it is trained to decline. Training also declines the known questions with a word
# swapped, dropped or added, and words it has no token for (<unk>), so phrasings it never saw
# get the same answer (tests/unit/test_demo_model.py asks held-out ones).
OFF_TOPIC_QUESTIONS = (
    "What color is the background?",
    "What shape is the background?",
    "What size is the shape?",
    "How big is the shape?",
    "How many shapes are there?",
    "Where is the shape?",
    "Is the shape red?",
    "Is it a circle?",
    "What is the background?",
    "What is in the picture?",
    "Describe the image.",
    "What color is the sky?",
    "What is your name?",
    "Who are you?",
    "What time is it?",
    "What day is it today?",
    "What is the weather like?",
    "Tell me a story.",
    "Tell me a joke.",
    "What is two plus two?",
    "Can you count to ten?",
    "Why is the sky blue?",
    "Who drew this?",
    "Is this a photo?",
    "Where are you from?",
    "What do you like?",
    "Do you know me?",
    "Hello!",
    "Thank you.",
    "What is the meaning of life?",
    "Which animal is this?",
    "What is written here?",
    "How old is it?",
    "Is it big or small?",
    "What is the capital of Spain?",
    "Say something else.",
    "And its size?",
    "And the background?",
    "What shape is the sky?",
    "What color is it not?",
)

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
        text = ChatPrompt(self.processor).render([user_message(question, images=1)])
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
    """The answer to ``question`` about ``sample`` after the answer ``previous``."""
    if question in (COLOR_QUESTION, COLOR_FOLLOW_UP):
        return sample.color
    if question in (SHAPE_QUESTION, SHAPE_FOLLOW_UP):
        return sample.shape
    if question == REPEAT and previous is not None:
        return previous
    return DONT_KNOW


@contextmanager
def _engine(loaded):
    """An engine over ``loaded`` with room for every session, stopped afterwards."""
    from llava.config import EngineConfig
    from llava.engine import Engine
    from llava.kv.budget import MemoryBudget

    engine = Engine(loaded, EngineConfig(model_dir="-"), MemoryBudget(1 << 30))
    try:
        yield engine
    finally:
        engine.stop()


def evaluate(loaded, samples: Sequence[ShapeSample]) -> dict[str, float]:
    """Exact-match accuracy per question kind: one engine session per dialogue, greedy."""
    right = dict.fromkeys(KINDS, 0)
    total = dict.fromkeys(KINDS, 0)
    loaded.model.eval()
    with _engine(loaded) as engine:
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


def declined(loaded, samples: Sequence[ShapeSample], questions: Sequence[str]) -> float:
    """Share of ``questions`` (one per image, as a session's first turn) answered DONT_KNOW."""
    right = 0
    with _engine(loaded) as engine:
        for i, sample in enumerate(samples):
            session_id = engine.open(sample.image).session_id
            answer = engine.ask(session_id, questions[i % len(questions)], {"max_new_tokens": 6})
            right += answer.text == DONT_KNOW
            engine.close(session_id)
    return right / len(samples)


def evaluate_families(
    loaded, per_family: int, seed: int = HELD_OUT_SEED_START, families=FAMILIES
) -> dict[str, dict[str, float]]:
    """:func:`evaluate` on ``per_family`` held-out images of each family."""
    return {f: evaluate(loaded, held_out_samples(per_family, seed, (f,))) for f in families}


def print_table(accuracy: dict[str, dict[str, float]]) -> None:
    print(f"    {'family':<10}" + "".join(f"{kind:>17}" for kind in KINDS))
    for family, kinds in accuracy.items():
        print(f"    {family:<10}" + "".join(f"{kinds[kind]:17.1%}" for kind in KINDS))


def main(argv: list[str] | None = None) -> int:
    """Per-family held-out accuracy of a model directory (any demo model, old or new)."""
    import argparse

    from llava.model.loading import load_model

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--per-family", type=int, default=100)
    args = parser.parse_args(argv)
    loaded = load_model(args.model_dir, device="cpu", dtype="float32")
    print(f"{args.model_dir}: {args.per_family} held-out images per family, greedy")
    print_table(evaluate_families(loaded, args.per_family))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
