"""The checkpoint's own prompt, as token ids: the whole conversation rendered and tokenized at once.

A turn's prompt is exactly what Hugging Face's pipeline feeds the checkpoint:
``processor.apply_chat_template(conversation so far, add_generation_prompt=True)`` tokenized in
one call, with ``<image>`` expanded to one id per image feature. The engine does not assemble
prompts from separately tokenized segments (that gave ``▁What`` where the checkpoint sees
``What``); it diffs these ids against what its KV cache holds (docs/engine/prompt-fidelity.md
§Canonical prompt).

Message text is text: special-token strings inside a question or an answer (``<image>``,
``</s>``) are encoded as ordinary characters (transformers' ``sanitize_control_tokens``), so only
the template itself writes control tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llava.kv.prefix import common_prefix_length

# Probe questions with different first characters, so their common prefix is the opening only.
_PROBE_QUESTIONS = ("What is this?", "12 猫", '"Describe" it')
_PROBE_ANSWER = "It is a probe."


def system_message(text: str) -> dict:
    return {"role": "system", "content": [{"type": "text", "text": text}]}


def opening_messages(system: str | None) -> list[dict]:
    """What a conversation starts with before its first question: the system prompt, if any."""
    return [system_message(system)] if system else []


def questions_asked(messages: list[dict]) -> int:
    """How many turns the conversation holds (each a question and, once answered, its answer)."""
    return sum(message["role"] == "user" for message in messages)


def without_last_turns(messages: list[dict], turns: int) -> list[dict]:
    """The conversation as it was before its last ``turns`` questions were asked."""
    if turns == 0:
        return messages
    starts = [i for i, message in enumerate(messages) if message["role"] == "user"]
    return messages[: starts[-turns]]


def user_message(text: str, images: int = 0) -> dict:
    """A question, after its ``images`` (as the checkpoint's template places an image in a
    user message: before the text)."""
    content = [{"type": "image"} for _ in range(images)]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


def images_shown(messages: list[dict]) -> int:
    """How many images the messages show."""
    return sum(
        part.get("type") == "image"
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
    )


def assistant_message(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


@dataclass(frozen=True)
class ChatPrompt:
    processor: object  # a transformers ProcessorMixin with a chat template

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.processor.image_token)

    def render(self, messages: list[dict]) -> str:
        return self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def ids(self, messages: list[dict], image_tokens: int | Sequence[int] = 0) -> list[int]:
        """The canonical prompt ids of ``messages``, ready for the assistant's answer;
        ``image_tokens``: each image's token count, in the order the messages show them (one
        count: every image's)."""
        tokenizer = self.tokenizer
        ids = tokenizer.apply_chat_template(
            messages,
            chat_template=self.processor.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            sanitize_control_tokens=True,
            return_dict=False,
        )
        # The processor adds the tokenizer's special tokens (BOS) unless the template wrote them.
        if not (tokenizer.bos_token and self.render(messages).startswith(tokenizer.bos_token)):
            ids = tokenizer("").input_ids + ids
        return self._expand_images(ids, image_tokens)

    def _expand_images(self, ids: list[int], image_tokens: int | Sequence[int]) -> list[int]:
        """One ``<image>`` id per image feature, as the processor expands it."""
        image_id = self.image_token_id
        shown = ids.count(image_id)
        if not shown:
            return ids
        counts = [image_tokens] * shown if isinstance(image_tokens, int) else list(image_tokens)
        if len(counts) != shown:
            raise ValueError(f"the prompt shows {shown} images, {len(counts)} were counted")
        out: list[int] = []
        images = iter(counts)
        for token in ids:
            out.extend([token] * next(images) if token == image_id else [token])
        return out

    def opening_ids(
        self, with_image: bool, image_tokens: int = 0, system: str | None = None
    ) -> list[int]:
        """The ids every first question starts with (BOS, system prompt, role, image):
        prefilled at open."""
        start = opening_messages(system)
        probes = [
            self.ids([*start, user_message(q, with_image)], image_tokens) for q in _PROBE_QUESTIONS
        ]
        shared = min(common_prefix_length(probes[0], other) for other in probes[1:])
        return probes[0][:shared]

    def renders_system(self) -> bool:
        """Whether the template renders a system message (some refuse the role)."""
        try:
            text = self.render([system_message(_PROBE_ANSWER), user_message(_PROBE_QUESTIONS[0])])
        except Exception:  # a template's own refusal (jinja's TemplateError, or any raise)
            return False
        return _PROBE_ANSWER in text

    def check_stateful(self) -> None:
        """Raise ValueError unless a follow-up's prompt ids extend the previous turn's prompt ids.

        Otherwise every turn would re-prefill from where the template rewrote the past: such a
        template gains nothing from a session's KV cache, so it is refused at load time.
        """
        # (images in the first question, in the follow-up): a later image must append too
        for first_images, next_images in ((1, 0), (0, 0), (1, 1)):
            first = [user_message(_PROBE_QUESTIONS[0], first_images)]
            before = self.ids(first, image_tokens=2)
            follow_up = user_message(_PROBE_QUESTIONS[1], next_images)
            after = self.ids([*first, assistant_message(_PROBE_ANSWER), follow_up], image_tokens=2)
            if after[: len(before)] != before:
                raise ValueError(
                    "chat template is not append-only in tokens: a new turn rewrites the "
                    f"earlier prompt ({'with' if first_images else 'without'} an image"
                    f"{', and one in the new turn' if next_images else ''})"
                )
            if not self.opening_ids(bool(first_images), image_tokens=2):
                raise ValueError("chat template renders no common opening before the question")
