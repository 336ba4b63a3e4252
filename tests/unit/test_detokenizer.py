"""The streaming detokenizer against the real LLaMA tokenizer of llava-1.5-7b-hf."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from llava.sampling.detokenizer import Detokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "llava-1.5-7b-hf"
TEXTS = [
    "Hello world, plain ASCII.",
    "Emoji 😀🎉 and a flag 🇫🇷 need byte fallback",
    "中文回答：这是一只猫。",
    "Café naïve façade — “quotes” and it 's fine , isn 't it ?",
    "  leading spaces and\nnew\tlines",
]


@pytest.fixture(scope="module", params=[False, True], ids=["cleanup-off", "cleanup-on"])
def tokenizer(request):
    # transformers 5 skips cleanup for BPE vocabularies unless forced; Llama-3-era checkpoints
    # ship with it on, so it is forced here to test a tokenizer whose decode rewrites text.
    cleanup = request.param
    return AutoTokenizer.from_pretrained(
        FIXTURE,
        clean_up_tokenization_spaces=cleanup,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=cleanup,
    )


def stream(tokenizer, ids: list[int]) -> tuple[list[str], Detokenizer]:
    detokenizer = Detokenizer(tokenizer)
    chunks = [detokenizer.push(i) for i in ids]
    chunks.append(detokenizer.flush())
    return chunks, detokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_chunks_concatenate_to_the_raw_decode(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    chunks, detokenizer = stream(tokenizer, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(chunks) == detokenizer.text == expected
    assert chunks[-1] == ""  # nothing was held back once the text was complete


def test_the_stream_never_goes_silent_when_cleanup_would_rewrite_sent_text(tokenizer):
    """`` 's`` is what cleanup rewrites: text decoded so far stops extending what was sent."""
    ids = tokenizer("it 's fine and more words follow", add_special_tokens=False).input_ids
    chunks, _ = stream(tokenizer, ids)
    assert "".join(chunks[:-1]).endswith(" follow")  # every word arrived before the flush


def test_a_multibyte_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer("😀", add_special_tokens=False).input_ids
    byte_ids = [i for i in ids if tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    assert len(byte_ids) == 4  # byte fallback: four ids for one character
    chunks, _ = stream(tokenizer, ids)
    assert "".join(chunks[:-2]) == "" and chunks[-2] == "😀"


def test_an_unfinished_character_is_flushed_as_the_decoder_renders_it(tokenizer):
    ids = tokenizer("a😀", add_special_tokens=False).input_ids[:-1]  # cut mid-character
    chunks, detokenizer = stream(tokenizer, ids)
    assert chunks[-1] and set(chunks[-1]) == {"\ufffd"}  # one per orphan byte
    assert detokenizer.text == tokenizer.decode(ids)


class GivesUp:
    """A DecodeStream that raises as tokenizers' does on some id sequences ("Invalid prefix
    encountered while decoding stream", seen from random 7B weights on a GPU)."""

    def __init__(self, after: int):
        self.after = after

    def step(self, _backend, _token_id):
        self.after -= 1
        if self.after < 0:
            raise Exception("Invalid prefix encountered while decoding stream")
        return None  # held back, as the real stream does mid-character


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_that_gives_up_mid_answer_still_yields_the_whole_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detokenizer = Detokenizer(tokenizer)
    detokenizer._stream = GivesUp(after=2)
    chunks = [detokenizer.push(i) for i in ids]
    assert all("\ufffd" not in chunk for chunk in chunks)  # incomplete characters wait
    chunks.append(detokenizer.flush())
    expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(chunks) == detokenizer.text == expected
