"""Generated ids → text, incrementally, for streaming an answer as it is generated.

Built on ``tokenizers.decoders.DecodeStream``: it keeps prefix/read offsets, decodes only a
short window per id (O(1) amortised) and holds text back only while a multi-byte character or
a merge is incomplete, so the stream never stalls. The answer text *is* the concatenation of
the chunks, so a client that streams gets exactly ``Answer.text``. Decoding is raw: a
tokenizer's ``clean_up_tokenization_spaces`` (which rewrites earlier text, e.g. `` 's`` → ``'s``)
is not applied, since a chunk already sent cannot be rewritten.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer):
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def push(self, token_id: int) -> str:
        """The text ``token_id`` completes (empty while a character or merge is incomplete)."""
        self._ids.append(token_id)
        chunk = None
        if self._stream is not None:
            try:
                chunk = self._stream.step(self._backend, token_id) or ""
            except Exception:  # tokenizers' own error type is a bare Exception
                # DecodeStream gives up on some id sequences ("Invalid prefix encountered",
                # seen from random 7B weights on a GPU): decode the whole answer from here on.
                self._stream = None
        if chunk is None:
            chunk = self._rest(final=False)
        self._chunks.append(chunk)
        return chunk

    def flush(self) -> str:
        """After the last id: whatever was held back (an incomplete character decodes as U+FFFD)."""
        rest = self._rest(final=True)
        self._chunks.append(rest)
        return rest

    def _rest(self, final: bool) -> str:
        """What a whole decode of the ids adds to the text sent so far; before the end, an
        incomplete character (U+FFFD) is held back, since its bytes may still complete."""
        full = self._backend.decode(self._ids, skip_special_tokens=True)
        if not final:
            full = full.rstrip("\ufffd")
        emitted = self.text
        return full[len(emitted) :] if full.startswith(emitted) else ""
