"""llava-v1.6-mistral-7b-hf's tokenizer as tests/mistral_tokenizer.py builds it from Mistral's
SentencePiece model: its ids against SentencePiece's own, its special and added tokens, and the
checkpoint's chat template rendered and tokenized through it (``[INST]``, BOS, answers, images).
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from PIL import Image
from transformers import AutoTokenizer, LlavaNextProcessor

from llava.model.prompt import ChatPrompt
from tests.mistral_tokenizer import (
    MISTRAL_FIXTURE,
    TOKENIZER_MODEL,
    mistral_tokenizer,
    save_mistral_tokenizer,
    sentencepiece_model,
)

# the file of mistral-common 1.13.1 (mistral_common/data/tokenizer.model.v1), see the README
MODEL_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"
BOS, EOS, IMAGE, PAD = 1, 2, 32000, 32001
SPACE_ID = 28705  # "▁" alone
INST = [733, 16289, 28793]  # "[INST]": "▁[", "INST", "]"
END_INST = [733, 28748, 16289, 28793]  # "[/INST]": "▁[", "/", "INST", "]"
SPECIAL = re.compile(r"(<s>|</s>|<unk>|<image>|<pad>)")
SPECIAL_IDS = {"<s>": BOS, "</s>": EOS, "<unk>": 0, "<image>": IMAGE, "<pad>": PAD}
# Texts where a tokenizer built otherwise parts from SentencePiece: whitespace runs (merges
# ordered by id instead of score), leading spaces (the legacy prefix), bytes (fallback), scripts.
TEXTS = [
    "Hello",
    "Hello world",
    " Hello",
    "a  b",
    "a   b    c",
    "trailing  ",
    "    code = 1\n        return x",
    "\n\nline\tbreak",
    "Café au lait, naïve?",
    "这是什么？",
    'He said "hi" and left.',
    "🦙 on a 🙂",
    "Ελληνικά русский עברית العربية",
    "12345 67.89 1e-6",
    "[INST] What is this? [/INST]",
    "<s> </s> <image> as plain text",
]


@pytest.fixture(scope="module")
def tokenizer():
    return mistral_tokenizer()


@pytest.fixture(scope="module")
def sp():
    return sentencepiece_model()


@pytest.fixture(scope="module")
def processor(tokenizer):
    return LlavaNextProcessor.from_pretrained(MISTRAL_FIXTURE, tokenizer=tokenizer)


def legacy_ids(sp, text: str) -> list[int]:
    """What the checkpoint's tokenizer gives ``text`` (with BOS): special tokens by their ids,
    each stretch of text between them as SentencePiece alone encodes it (legacy handling)."""
    ids = [BOS]
    for part in SPECIAL.split(text):
        if part in SPECIAL_IDS:
            ids.append(SPECIAL_IDS[part])
        elif part:
            ids.extend(sp.encode(part))
    return ids


def message(role: str, text: str | None = None, images: int = 0) -> dict:
    """A chat message as HF's processors take it: its images first, then its text."""
    content = [{"type": "image"} for _ in range(images)]
    if text is not None:
        content.append({"type": "text", "text": text})
    return {"role": role, "content": content}


def picture(width: int, height: int) -> Image.Image:
    return Image.new("RGB", (width, height), (30, 90, 160))


def test_the_model_file_is_mistral_commons_v1_unchanged():
    assert hashlib.sha256(TOKENIZER_MODEL.read_bytes()).hexdigest() == MODEL_SHA256


def test_special_and_added_tokens_have_the_checkpoints_ids(tokenizer):
    names = (tokenizer.unk_token, tokenizer.bos_token, tokenizer.eos_token)
    assert names == ("<unk>", "<s>", "</s>")
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<pad>", PAD)
    assert tokenizer.image_token == "<image>"
    added = json.loads((MISTRAL_FIXTURE / "added_tokens.json").read_text())
    assert added == {"<image>": IMAGE, "<pad>": PAD}
    assert tokenizer.convert_tokens_to_ids(list(added)) == list(added.values())
    assert tokenizer.vocab_size == 32000 and len(tokenizer) == 32000 + 2
    config = json.loads((MISTRAL_FIXTURE / "config.json").read_text())
    assert config["image_token_index"] == IMAGE
    assert len(tokenizer) <= config["text_config"]["vocab_size"]  # 32064: every id has a row


def test_image_is_one_token_wherever_it_stands(tokenizer):
    assert tokenizer.tokenize("<image>") == ["<image>"]
    assert tokenizer.encode("<image>", add_special_tokens=False) == [IMAGE]
    ids = tokenizer.encode("x<image>y<image>\n", add_special_tokens=False)
    assert ids.count(IMAGE) == 2
    assert tokenizer.encode("<pad>", add_special_tokens=False) == [PAD]


def test_known_sentencepiece_facts(tokenizer, sp):
    assert sp.get_piece_size() == 32000
    assert tokenizer.tokenize("Hello") == ["▁Hello"]  # the dummy prefix: a word starts with ▁
    assert tokenizer("Hello").input_ids == [BOS, sp.piece_to_id("▁Hello")]
    assert all(piece.startswith("▁") for piece in tokenizer.tokenize("Hello big world"))
    assert tokenizer.convert_ids_to_tokens([3, 13, 258, SPACE_ID]) == [
        "<0x00>",
        "<0x0A>",
        "<0xFF>",
        "▁",
    ]
    assert tokenizer.encode("[INST]", add_special_tokens=False) == INST
    assert tokenizer.encode("[/INST]", add_special_tokens=False) == END_INST
    # a character outside the pieces falls back to its UTF-8 bytes, <0xNN> = id 3 + byte
    llama = "🦙"
    assert tokenizer.encode(llama, add_special_tokens=False) == [
        SPACE_ID,
        *(3 + byte for byte in llama.encode()),
    ]
    assert tokenizer.decode(tokenizer.encode(llama), skip_special_tokens=True) == llama


@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_sentencepieces_own(tokenizer, sp, text):
    """Plain text (special-token strings split as characters) is what SentencePiece encodes."""
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
    assert ids == sp.encode(text)
    assert tokenizer.decode(ids) == sp.decode(ids)


def test_whitespace_runs_follow_the_scores_not_the_ids(tokenizer, sp):
    """▁▁ has id 259 but the lowest score: SentencePiece merges it last, so "a  b" is ▁a ▁ ▁b."""
    assert sp.piece_to_id("▁▁") == 259 and sp.get_score(259) < sp.get_score(sp.piece_to_id("▁b"))
    assert tokenizer.tokenize("a  b") == ["▁a", "▁", "▁b"]


def test_decoding_drops_the_prefix_space_only(tokenizer):
    for text in ["Hello world", "  two spaces", "Café\n\tnaïve 🦙"]:
        ids = tokenizer(text).input_ids
        assert ids[0] == BOS
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_one_turn_renders_and_tokenizes_as_the_template_writes_it(processor, sp):
    messages = [message("user", "What is this?", images=1)]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "[INST] <image>\nWhat is this? [/INST]"
    ids = processor(text=text, images=[picture(64, 48)])["input_ids"][0]
    ids = [token for n, token in enumerate(ids) if token != IMAGE or ids[n - 1] != IMAGE]
    assert ids == legacy_ids(sp, text)
    # BOS, "[INST]", the space before <image> and (legacy) a ▁ before the text after it
    assert ids[:6] == [BOS, *INST, SPACE_ID, IMAGE]
    assert ids[6:8] == [SPACE_ID, 13]  # "▁", "<0x0A>"
    assert ids[-4:] == END_INST


def test_answers_get_a_space_before_and_eos_after(processor, tokenizer, sp):
    messages = [
        message("system", "Be brief."),
        message("user", "What is this?"),
        message("assistant", "A cat."),
        message("user", "And its colour?"),
        message("assistant", "Grey, I think."),
        message("user", "Sure?"),
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        "<<SYS>>\nBe brief.\n<</SYS>>\n\n[INST] What is this? [/INST] A cat.</s> "
        "[INST] And its colour? [/INST] Grey, I think.</s> [INST] Sure? [/INST]"
    )
    ids = processor(text=text)["input_ids"][0]
    assert ids == legacy_ids(sp, text)
    assert ids.count(BOS) == 1 and ids[0] == BOS  # the template writes none: the tokenizer's one
    assert ids.count(EOS) == 2  # one after each answer
    answer = sp.encode("A cat.")  # its first piece carries the template's space: "▁A"
    assert tokenizer.convert_ids_to_tokens(answer[0]) == "▁A"
    first_end = ids.index(EOS)
    assert ids[first_end - len(answer) - len(END_INST) : first_end] == END_INST + answer
    # after "</s>", the " [INST] " that follows starts a new stretch: ▁ (prefix) then ▁[ ...
    assert ids[first_end + 1 : first_end + 5] == [SPACE_ID, *INST]
    # ChatPrompt (the engine's canonical ids) agrees with the processor
    assert ChatPrompt(processor).ids(messages) == ids


def test_images_in_two_user_messages_give_two_image_tokens_before_expansion(processor, sp):
    sizes = [(64, 48), (30, 90)]
    messages = [
        {"role": "user", "content": [{"type": "image", "image": picture(*sizes[0])}]},
        message("assistant", "A blue square."),
        {
            "role": "user",
            "content": [
                {"type": "image", "image": picture(*sizes[1])},
                {"type": "text", "text": "And this one?"},
            ],
        },
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        "[INST] <image>\n [/INST] A blue square.</s> [INST] <image>\nAnd this one? [/INST]"
    )
    before = processor.tokenizer(text).input_ids
    assert before == legacy_ids(sp, text) and before.count(IMAGE) == 2
    expanded = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][0]
    each = [
        processor(text="<image>", images=[picture(*size)])["input_ids"][0].count(IMAGE)
        for size in sizes
    ]
    assert each[0] != each[1] and min(each) > 1  # anyres: each image its own count
    assert expanded.count(IMAGE) == sum(each)
    assert expanded.count(BOS) == 1
    # the expansion changes nothing else
    assert [token for token in expanded if token != IMAGE] == [t for t in before if t != IMAGE]


def test_the_engine_takes_the_template_as_append_only(processor):
    prompt = ChatPrompt(processor)
    prompt.check_stateful()  # raises if a new turn rewrote the earlier prompt's ids
    opening = prompt.opening_ids(with_image=True, image_tokens=3)
    assert opening == [BOS, *INST, SPACE_ID, IMAGE, IMAGE, IMAGE, SPACE_ID, 13]


def test_saved_and_loaded_back_it_is_the_same_tokenizer(tmp_path, tokenizer):
    save_mistral_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "[INST] <image>\n  Hi, 🦙! [/INST] Hello.</s> [INST] x"
    assert again(text).input_ids == tokenizer(text).input_ids
    assert again.pad_token_id == PAD and again.convert_tokens_to_ids("<image>") == IMAGE
    assert again.decode(again(text).input_ids) == tokenizer.decode(tokenizer(text).input_ids)
