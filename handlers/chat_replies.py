"""The chat-completions API's replies: a ``chat.completion`` object, or its stream of
``chat.completion.chunk`` server-sent events ending with ``data: [DONE]``, and errors in
OpenAI's shape (docs/wire.md §Chat completions)."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from llava.engine import Answer

# Why a turn ended, as OpenAI names it: "stop" for an end token or a stop sequence, "length"
# for a cut (max_tokens, or the server's turn deadline); a cancelled turn's caller is gone.
FINISH_REASONS = {
    "eos": "stop",
    "stop_sequence": "stop",
    "cancelled": "stop",
    "max_new_tokens": "length",
    "deadline": "length",
}


@dataclass(frozen=True)
class Completion:
    """What every reply of one request shares: its id, time and the model name echoed."""

    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{secrets.token_hex(12)}")
    created: int = field(default_factory=lambda: int(time.time()))

    def object(self, kind: str, **fields) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            **fields,
        }


def usage(answer: Answer) -> dict:
    prompt = answer.new_tokens + answer.cached_tokens
    completion = len(answer.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": answer.cached_tokens},
    }


def completion(reply: Completion, answer: Answer, session: dict) -> dict:
    """The whole answer; ``session``: its id and expiry, when the call has a session."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": answer.text},
        "finish_reason": FINISH_REASONS[answer.stop_reason],
        "logprobs": None,
    }
    return reply.object("chat.completion", choices=[choice], usage=usage(answer), **session)


class ChatChunks:
    """A streamed answer as server-sent events (handlers.token_stream's line format): the
    role first, then each token's text; the last event from the final reply: its finish
    reason, the usage when asked for, then ``[DONE]``; or the error, then ``[DONE]``."""

    def __init__(self, reply: Completion, include_usage: bool):
        self.reply = reply
        self.include_usage = include_usage
        self._started = False

    def token(self, text: str, token_id: int | None) -> str:
        events = ""
        if not self._started:
            self._started = True
            events = self._delta({"role": "assistant", "content": ""})
        if text:
            events += self._delta({"content": text})
        return events

    def last(self, payload: dict) -> str:
        if "error" in payload:
            return _event(payload) + _event("[DONE]")
        events = self.token("", None)  # the role, if no token came
        finish = payload["choices"][0]["finish_reason"]
        events += self._delta({}, finish)
        if self.include_usage:
            events += _event(
                self.reply.object("chat.completion.chunk", choices=[], usage=payload["usage"])
            )
        return events + _event("[DONE]")

    def _delta(self, delta: dict, finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return _event(self.reply.object("chat.completion.chunk", choices=[choice]))


def _event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
