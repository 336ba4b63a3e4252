"""OpenAI's chat-completions body in, a typed request out (docs/wire.md §Chat completions).

A body with ``messages`` is a chat request (AWS LMI's convention on ``/invocations``). Every
field is read or refused, naming it: what the engine does not do (``n`` > 1, tools, log
probabilities, response formats, audio) is a 400 ``UNSUPPORTED_FIELD`` rather than a silently
different answer. Knows nothing of TorchServe.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from llava.errors import InvalidRequest, echo
from llava.intake import parse_image_source
from llava_wire import UNKNOWN_KEY, UNSUPPORTED_FIELD


class UnsupportedField(InvalidRequest):
    """A field the engine does not do, or a value of it it does not; ``param`` names it."""

    def __init__(self, param: str, message: str, *, code: str = UNSUPPORTED_FIELD):
        super().__init__(message, code=code)
        self.param = param


@dataclass(frozen=True)
class ImageSource:
    ref: str  # what names the image within a session: a digest of its source
    source: dict  # for llava.intake.load_image


@dataclass(frozen=True)
class UserTurn:
    question: str
    images: tuple[ImageSource, ...]
    answer: str | None  # the assistant message after it; None on the last


@dataclass(frozen=True)
class ChatBody:
    turns: tuple[UserTurn, ...]
    system: str | None  # None: no system message (the operator's system_prompt applies)
    parameters: dict  # for llava.sampling.params.GenerationParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    model: str  # echoed in the reply


# Fields the engine does not do, and the value that asks for nothing (sent by some clients
# by default): any other value is refused.
_NEUTRAL = {
    "n": (1,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
_READ = {
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",  # OpenAI's end-user label: accepted, not used
}
DEFAULT_MODEL = "llava"
MAX_STOP = 4  # OpenAI's limit on stop sequences
_SYSTEM_ROLES = ("system", "developer")  # "developer" is the newer name of the system role


def is_chat(payload: dict) -> bool:
    return "messages" in payload


def parse_chat(payload: dict) -> ChatBody:
    for key, value in payload.items():
        if key in _NEUTRAL:
            if value not in _NEUTRAL[key]:
                raise UnsupportedField(key, _unsupported(key))
        elif key not in _READ:
            message = f"chat completions do not take {echo(key)}"
            raise UnsupportedField(key, message, code=UNKNOWN_KEY)
    system, turns = _conversation(payload["messages"])
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise UnsupportedField("stream", "'stream' must be true or false")
    model = payload.get("model", DEFAULT_MODEL)
    if not isinstance(model, str):
        raise UnsupportedField("model", "'model' must be a string")
    return ChatBody(
        turns, system, _parameters(payload), stream, _include_usage(payload, stream), model
    )


def _unsupported(key: str) -> str:
    why = {
        "n": "one answer per request: send the request again for another",
        "tools": "no tool calls",
        "logprobs": "no log probabilities",
        "response_format": "free text only, no JSON mode or schema",
        "audio": "text out only",
    }.get(key, "this engine does not do it")
    return f"'{key}' is not supported ({why}); leave it out"


def _parameters(payload: dict) -> dict:
    """The engine's generation parameters (GenerationParams checks their ranges)."""
    parameters = {}
    limits = [
        key for key in ("max_tokens", "max_completion_tokens") if payload.get(key) is not None
    ]
    if len(limits) == 2 and payload["max_tokens"] != payload["max_completion_tokens"]:
        raise UnsupportedField(
            "max_tokens", "send 'max_completion_tokens' or 'max_tokens', not both"
        )
    if limits:
        parameters["max_new_tokens"] = payload[limits[0]]
    for key in ("temperature", "top_p", "seed"):
        if payload.get(key) is not None:
            parameters[key] = payload[key]
    stop = payload.get("stop")
    if stop is not None:
        parameters["stop"] = _stop(stop)
    return parameters


def _stop(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or not 0 < len(stops) <= MAX_STOP
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise UnsupportedField(
            "stop", f"'stop' must be a string or up to {MAX_STOP} non-empty strings"
        )
    return stops


def _include_usage(payload: dict, stream: bool) -> bool:
    options = payload.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise UnsupportedField("stream_options", "'stream_options' goes with \"stream\": true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise UnsupportedField("stream_options", "'stream_options' takes only 'include_usage'")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise UnsupportedField("stream_options", "'include_usage' must be true or false")
    return include


def _conversation(messages: Any) -> tuple[str | None, tuple[UserTurn, ...]]:
    """The system prompt and the turns: user and assistant messages alternating, the last
    a user message."""
    if not isinstance(messages, list) or not messages:
        raise UnsupportedField("messages", "'messages' must be a non-empty list of messages")
    system = None
    pending: list[tuple[str, tuple[ImageSource, ...]]] = []
    answers: list[str] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = _role(message, where)
        if role in _SYSTEM_ROLES:
            if index != 0:
                raise UnsupportedField(where, f"{where}: a system message comes first, and once")
            system = _text(message.get("content"), f"{where}.content")
        elif role == "user":
            if len(pending) > len(answers):
                raise UnsupportedField(where, f"{where}: two user messages in a row; send one")
            pending.append(_user(message.get("content"), f"{where}.content"))
        else:
            if len(pending) == len(answers):
                raise UnsupportedField(where, f"{where}: an assistant message answers a user one")
            answers.append(_text(message.get("content"), f"{where}.content"))
    if len(pending) == len(answers):
        raise UnsupportedField("messages", "'messages' must end with the user message to answer")
    turns = tuple(
        UserTurn(question, images, answers[i] if i < len(answers) else None)
        for i, (question, images) in enumerate(pending)
    )
    return system, turns


_MESSAGE_KEYS = {"role", "content", "name"}


def _role(message: Any, where: str) -> str:
    if not isinstance(message, dict):
        raise UnsupportedField(where, f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in (*_SYSTEM_ROLES, "user", "assistant"):
        raise UnsupportedField(
            f"{where}.role",
            f"{where}.role is {echo(role)}: system, user or assistant (no tool messages)",
        )
    extra = sorted(set(message) - _MESSAGE_KEYS - ({"refusal"} if role == "assistant" else set()))
    if extra:
        raise UnsupportedField(f"{where}.{extra[0]}", f"{where} does not take {echo(extra[0])}")
    return role


def _text(content: Any, where: str) -> str:
    """A system or assistant message's text: a string, or text parts."""
    if isinstance(content, str):
        return content
    return _parts(content, where, images_allowed=False)[0]


def _user(content: Any, where: str) -> tuple[str, tuple[ImageSource, ...]]:
    if isinstance(content, str):
        return content, ()
    return _parts(content, where, images_allowed=True)


def _parts(content: Any, where: str, images_allowed: bool) -> tuple[str, tuple[ImageSource, ...]]:
    """The text parts joined by newlines, and the images (shown before the text, as the
    checkpoint's template places them, wherever the parts put them)."""
    if not isinstance(content, list) or not content:
        raise UnsupportedField(where, f"{where} must be a string or a non-empty list of parts")
    texts, images = [], []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str) and set(part) == {"type", "text"}:
            texts.append(part["text"])
        elif kind == "image_url" and images_allowed:
            images.append(_image(part, at))
        else:
            what = "text or image_url" if images_allowed else "text"
            raise UnsupportedField(at, f"{at} must be a {what} part, got {echo(kind)}")
    return "\n".join(texts), tuple(images)


def _image(part: dict, where: str) -> ImageSource:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else None
    if not isinstance(url, str) or set(part) != {"type", "image_url"}:
        raise UnsupportedField(
            where, f"{where} must be {{'type': 'image_url', 'image_url': {{'url': ...}}}}"
        )
    if set(image_url) - {"url", "detail"}:  # detail: OpenAI's resolution hint, not used
        raise UnsupportedField(where, f"{where}.image_url takes 'url' (and 'detail')")
    ref = hashlib.sha256(url.encode()).hexdigest()
    if url.startswith("data:"):
        header, comma, data = url.partition(",")
        if not comma or not header.startswith("data:image/") or not header.endswith(";base64"):
            raise UnsupportedField(
                where, f"{where}: a data URL must be data:image/<type>;base64,<data>"
            )
        return ImageSource(ref, parse_image_source({"b64": data}))
    if url.startswith("s3://"):
        return ImageSource(ref, parse_image_source({"s3": url}))
    return ImageSource(ref, parse_image_source({"url": url}))
