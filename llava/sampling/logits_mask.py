"""Ids an answer must never contain: the sampler sees -inf for them.

A sampled ``<image>`` would make every later turn of the session fail (image features and
image tokens no longer match); ``<pad>``, ``<unk>``, BOS and other added special tokens are not
answer text either. The end token stays allowed: it is how an answer ends. Rows of the
embedding past the tokenizer's vocabulary (llava-1.5-7b-hf pads 32002 tokens to 32064) decode
to nothing and are banned too.
"""

from __future__ import annotations


def banned_token_ids(tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> list[int]:
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    special.update(tokenizer.all_special_ids)
    padding_rows = range(len(tokenizer), vocab_size)
    return sorted((special | set(padding_rows)) - set(eos_token_ids))
