"""Append-only prompt rendering.

The engine keeps a conversation as one growing list of token ids and only ever appends:
the first turn (optional image + first question), then per answer the generated ids, then
per follow-up question a *segment* of new ids. The segments come from the checkpoint's own
chat template, by diffing two renders, so the same code serves llava-hf checkpoints and the
demo model. A template whose render of turn k is not a prefix of turn k+1 cannot be served
statefully; we refuse it at load time rather than answer from a prompt that drifted.
"""

from __future__ import annotations

from dataclasses import dataclass

_PROBE_QUESTION = "What is this?"
_PROBE_ANSWER = "It is a probe."


def _user(text: str, with_image: bool = False) -> dict:
    content = [{"type": "image"}] if with_image else []
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


@dataclass(frozen=True)
class ChatPrompt:
    """Renders turns of a llava-style chat template as strings that only ever append."""

    processor: object  # a transformers ProcessorMixin with a chat template

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def first_turn(self, question: str, with_image: bool) -> str:
        """The whole prompt for the first question, up to where the answer starts."""
        return self._render([_user(question, with_image)], generation_prompt=True)

    def opening(self, with_image: bool) -> str:
        """The text before the first question (system text, image slot): prefilled at open."""
        text = self.first_turn(_PROBE_QUESTION, with_image)
        cut = text.rfind(_PROBE_QUESTION)
        if cut < 0:
            raise ValueError("chat template does not render the question verbatim")
        return text[:cut]

    def first_question(self, question: str, with_image: bool) -> str:
        """The text that follows :meth:`opening` to ask the first question."""
        opening = self.opening(with_image)
        text = self.first_turn(question, with_image)
        if not text.startswith(opening):
            raise ValueError("chat template is not append-only: the question rewrites the opening")
        return text[len(opening) :]

    def follow_up(self, question: str) -> str:
        """The text that follows a finished answer to ask ``question``."""
        history = [_user(_PROBE_QUESTION), _assistant(_PROBE_ANSWER)]
        before = self._render(history, generation_prompt=False)
        after = self._render(history + [_user(question)], generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("chat template is not append-only: a new turn rewrites earlier text")
        return after[len(before) :]

    def check_append_only(self) -> None:
        """Raise ValueError unless asking a follow-up only appends to the first turn's text."""
        first = self.first_turn(_PROBE_QUESTION, with_image=True)
        two_turns = self._render(
            [_user(_PROBE_QUESTION, True), _assistant(_PROBE_ANSWER)], generation_prompt=False
        )
        if not two_turns.startswith(first):
            raise ValueError("chat template is not append-only: the answer rewrites the prompt")
        self.first_question("Another question?", with_image=True)
        self.follow_up(_PROBE_QUESTION)
