"""A conversation given whole, as chat-completions clients send it every call, and how it
lines up with a session's (docs/engine/sessions.md §Conversations given whole).

A client of that API resends every message each turn; the engine answers its last question
on whatever the session (or, without one, the pool) already holds of the rest. Images are
named by ``ref``, a digest of their source that the transport computes: a session keeps each
image's ref in its messages, so an image it holds is never fetched or encoded again, and the
first image whose ref differs (with everything after it) is the turn's to bring.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import count
from typing import Any

from llava.errors import InvalidRequest
from llava.model.prompt import assistant_message, questions_asked, system_message


@dataclass(frozen=True)
class ChatImage:
    """An image a user message shows: ``ref`` names its source within a session; ``image``
    is the loaded image (a PIL image or ``llava.engine.KeyedImage``), None when not loaded
    because the session holds it (``Engine.images_to_fetch``)."""

    ref: str
    image: Any = None


@dataclass(frozen=True)
class ChatTurn:
    """A user message (its images shown before its text, as the checkpoint's template places
    them) and the assistant's answer to it (None on the last turn: the one to answer)."""

    question: str
    images: tuple[ChatImage, ...] = ()
    answer: str | None = None


@dataclass(frozen=True)
class Conversation:
    turns: tuple[ChatTurn, ...]
    system: str | None = None  # None: the operator's system_prompt; "": none

    def __post_init__(self):
        if not self.turns:
            raise InvalidRequest("a conversation needs at least one user message")
        if self.turns[-1].answer is not None:
            raise InvalidRequest("a conversation must end with the user message to answer")
        if any(turn.answer is None for turn in self.turns[:-1]):
            raise InvalidRequest("every user message but the last needs the answer after it")

    @property
    def images(self) -> list[ChatImage]:
        """Every image, in the order the conversation shows them."""
        return [image for turn in self.turns for image in turn.images]

    def messages(self, system: str) -> list[dict]:
        """The chat template's messages, the last user message unanswered; each image part
        keeps its ref (the template reads only its type)."""
        messages = [system_message(system)] if system else []
        for turn in self.turns:
            content = [{"type": "image", "ref": image.ref} for image in turn.images]
            content.append({"type": "text", "text": turn.question})
            messages.append({"role": "user", "content": content})
            if turn.answer is not None:
                messages.append(assistant_message(turn.answer))
        return messages

    def with_images(self, images: Mapping[int, Any]) -> Conversation:
        """The conversation with the images at these indexes (in the order it shows them)
        replaced by the given ones (loaded, or keyed); the others as they are."""
        shown = count()  # zip draws from it only while a turn has images left
        turns = tuple(
            ChatTurn(
                turn.question,
                tuple(
                    ChatImage(image.ref, images.get(index, image.image))
                    for image, index in zip(turn.images, shown, strict=False)
                ),
                turn.answer,
            )
            for turn in self.turns
        )
        return Conversation(turns, self.system)


def held_refs(messages: list[dict], opening_images: int) -> list[str | None]:
    """The refs of a session's images, in the order it holds them (None: an image it got
    without one, which no conversation's image matches)."""
    if not questions_asked(messages):
        return [None] * opening_images  # the open's image, before its first question
    return [
        part.get("ref")
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image"
    ]


def images_kept(held: list[str | None], conversation: Conversation) -> int:
    """How many of the session's first images the conversation shows first, in order."""
    kept = 0
    for ref, image in zip(held, conversation.images, strict=False):
        if ref is None or ref != image.ref:
            break
        kept += 1
    return kept


def system_of(messages: list[dict]) -> str:
    """A session's system prompt, from its messages ("": none)."""
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"][0]["text"]
    return ""
