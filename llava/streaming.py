"""Token ids → text deltas, for streaming answers as they are generated."""

from __future__ import annotations


class TextDeltas:
    """Detokenizes incrementally; the deltas concatenate to the decoded answer.

    A delta is held back while the text ends in U+FFFD: the token completed only part of a
    multi-byte character, and the next token may complete it.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = ""

    @property
    def text(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self.text
        if text.endswith("\ufffd") or not text.startswith(self._emitted):
            return ""
        delta, self._emitted = text[len(self._emitted) :], text
        return delta

    def flush(self) -> str:
        """Whatever is left after the last token (held-back partial characters)."""
        text = self.text
        delta = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
        self._emitted = text
        return delta
