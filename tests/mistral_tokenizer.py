"""llava-v1.6-mistral-7b-hf's Hugging Face tokenizer, built from Mistral's own SentencePiece model.

The fixture ``tests/fixtures/llava-v1.6-mistral-7b-hf`` holds ``tokenizer.model``, Mistral-7B's
v1 vocabulary (32,000 pieces; see the fixture's README for where it comes from). The checkpoint
publishes that vocabulary converted to a ``tokenizers`` BPE with LLaMA's legacy SentencePiece
handling, plus two added tokens; this module builds the same thing with transformers:

- the pieces, ids and scores as SentencePiece reads them (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, the
  256 byte pieces ``<0x00>``..``<0xFF>`` for byte fallback);
- the BPE merges ordered by the merged piece's **score**, as SentencePiece applies them
  (transformers' ``generate_merges`` with the scores; ordered by id instead, whitespace runs such
  as ``"a  b"`` come out other than SentencePiece's, since ``▁▁`` has id 259 but the lowest score);
- legacy normalization: ``▁`` prepended to every stretch of text between special tokens and each
  space written ``▁`` (so ``<image>\\n`` is followed by ``▁``, ``<0x0A>``, as in the checkpoint);
- the decoder's ``▁`` → space, byte fallback, and the first space stripped; BOS added in front;
- ``added_tokens.json``'s ``<image>`` 32000 and ``<pad>`` 32001 (the pad token), special.

``mistral_tokenizer()`` returns a fresh tokenizer; ``save_mistral_tokenizer(out_dir)`` writes its
``tokenizer.json`` and ``tokenizer_config.json`` into a model directory. Building needs the
``sentencepiece`` package (the dev extra), to read the model file.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast
from transformers.tokenization_utils_base import generate_merges

MISTRAL_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "llava-v1.6-mistral-7b-hf"
TOKENIZER_MODEL = MISTRAL_FIXTURE / "tokenizer.model"
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
IMAGE, PAD = "<image>", "<pad>"
SPACE = "\u2581"  # SentencePiece's ▁, which stands for a space inside pieces


def sentencepiece_model():
    """Mistral's model as SentencePiece itself reads it (the reference the tests compare to)."""
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(TOKENIZER_MODEL))


def added_tokens() -> dict[str, int]:
    """The checkpoint's added tokens (``<image>``, ``<pad>``) and their ids."""
    return json.loads((MISTRAL_FIXTURE / "added_tokens.json").read_text())


@functools.cache
def _backend_json() -> str:
    """The ``tokenizers`` backend, serialized (built once a process: about a second)."""
    sp = sentencepiece_model()
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    if [sp.unk_id(), sp.bos_id(), sp.eos_id()] != [0, 1, 2] or pieces[:3] != [UNK, BOS, EOS]:
        raise ValueError(f"{TOKENIZER_MODEL} is not LLaMA-style: {pieces[:3]}")
    vocab = {piece: i for i, piece in enumerate(pieces)}
    scores = {piece: sp.get_score(i) for i, piece in enumerate(pieces)}
    # No merge may build a control, unknown or byte piece out of text: SentencePiece never does
    reserved = [
        piece
        for i, piece in enumerate(pieces)
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)
    ]
    merges = generate_merges(vocab, scores, skip_tokens=reserved)

    backend = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
    )
    backend.pre_tokenizer = None
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 1)]
    )
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in pieces[:3]])
    extra = sorted(added_tokens().items(), key=lambda item: item[1])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, _ in extra])
    got = {token: backend.token_to_id(token) for token, _ in extra}
    if got != dict(extra):
        raise ValueError(f"added tokens got ids {got}, the checkpoint's are {dict(extra)}")
    return backend.to_str()


def mistral_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh copy of the checkpoint's tokenizer (callers may change it freely)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_backend_json()),
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE},  # LlavaNextProcessor reads .image_token
        add_bos_token=True,
        add_eos_token=False,
        legacy=True,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def save_mistral_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """Write the tokenizer into ``out_dir`` (a model directory) and return it."""
    tokenizer = mistral_tokenizer()
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
