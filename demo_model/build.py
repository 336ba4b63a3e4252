"""Build the offline demo LLaVA (trained) or a realistic-shape LLaVA (untrained) directory.

    python -m demo_model.build [--out models/demo-llava]
                               [--config demo|realistic|realistic-next] [--seed 0]

Everything is made here, nothing is downloaded: a word-level tokenizer (``tokenizers``), a CLIP
image processor, a ``LlavaProcessor`` with the llava-1.5 chat template, and a
``LlavaForConditionalGeneration`` (CLIP vision tower + Llama LM) saved with ``save_pretrained``.
The directory loads with ``AutoProcessor.from_pretrained`` and
``LlavaForConditionalGeneration.from_pretrained``, the calls that load ``llava-hf/llava-1.5-7b-hf``.

``demo`` trains a 0.5 M-parameter model on synthetic shapes (``demo_model.synthetic``,
training seeds 0..19_999, every family) to answer "What color is the shape?", "What shape is it?",
"And its color?", "And its shape?" and "Say that again." in multi-turn chats, and "I don't
know" to anything else, on token sequences built exactly as the engine builds them
(``demo_model.evaluation.DialogueTokens``), then reports held-out accuracy per image family. Its
``config.json`` asks for pad-to-square (``"image_aspect_ratio": "pad"``, ``llava.model.imageprep``).
``realistic`` writes an untrained model with LLaVA-1.5's image geometry (336 px, patch 14,
576 image tokens) and an LM big enough that prefill dominates on CPU, for benchmarks.
``realistic-next`` is its LLaVA-NeXT counterpart, untrained too: a
``LlavaNextForConditionalGeneration`` with the real checkpoint's image geometry (336 px tiles,
patch 14, llava-v1.6-mistral-7b-hf's ``image_grid_pinpoints``, image_newline: a square image
gives 2,928 image tokens) and a Mistral LM with GQA (12 query heads, 4 KV heads) as wide as
``realistic``'s, with that checkpoint's ``LlavaNextProcessor`` as the fixture
``tests/fixtures/llava-v1.6-mistral-7b-hf`` holds it (image processor, ``[INST]`` template and
stand-in LLaMA tokenizer: read its README, copied into the model directory).

Image processor: transformers' ``CLIPImageProcessor``. Without torchvision (our CPU setup)
transformers loads it as the PIL backend ``CLIPImageProcessorPil``; training, tests and serving
all run that same backend. The saved config names ``CLIPImageProcessor``, like llava-hf's.

Determinism: fixed seeds, ``torch.use_deterministic_algorithms(True)``, a fixed thread count and
a fixed number of steps (never "train for N seconds"), so the same machine builds the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import multiprocessing
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors as tk_processors
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    LlavaProcessor,
    MistralConfig,
    PreTrainedTokenizerFast,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from demo_model.evaluation import (
    COLOR_FOLLOW_UP,
    COLOR_QUESTION,
    DONT_KNOW,
    OFF_TOPIC_QUESTIONS,
    QUESTIONS,
    REPEAT,
    SHAPE_FOLLOW_UP,
    SHAPE_QUESTION,
    DialogueTokens,
    answer_for,
    evaluate_families,
    print_table,
)
from demo_model.synthetic import (
    COLORS,
    FAMILIES,
    HELD_OUT_SEED_START,
    SHAPES,
    TRAIN_SEEDS,
    ShapeSample,
    held_out_samples,
    sample_and_mask_from_seed,
)
from llava.model.imageprep import PAD, pad_to_square, prepare_image
from llava.model.loading import load_model
from llava.model.vision import most_image_tokens

SPECIAL_TOKENS = ("<unk>", "<pad>", "<s>", "</s>", "<image>")
UNK_ID, PAD_ID, BOS_ID, EOS_ID, IMAGE_ID = range(len(SPECIAL_TOKENS))
THREADS = 2  # fixed: CPU reductions may split differently with another thread count
# llava-v1.6-mistral-7b-hf's small files (config, processor, template, stand-in tokenizer).
NEXT_FIXTURE = Path(__file__).resolve().parent.parent / "tests/fixtures/llava-v1.6-mistral-7b-hf"

# The llava-hf llava-1.5 template, written out: roles upper-cased with ': ', images as
# '<image>\n' before the text, user and assistant text followed by ' ', 'ASSISTANT:' to answer.
# It is append-only, which the engine checks at load time.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}"
    "{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' ' }}"
    "{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """Model and training sizes of one --config."""

    image_size: int
    patch_size: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_intermediate: int
    max_positions: int
    filler_words: int = 0  # extra vocabulary, so a realistic LM head has a realistic width
    pad_to_square: bool = False  # saved as config.json "image_aspect_ratio": "pad"
    vision_steps: int = 0  # stage 1: the vision tower alone, on the auxiliary targets
    chat_steps: int = 0  # stage 2: projector and LM on dialogues (the tower frozen)
    batch_size: int = 32  # images per vision step
    chat_batch: int = 16  # dialogues per chat step (each up to 6 turns)
    vision_lr: float = 3e-3
    chat_lr: float = 2e-3
    text_kv_heads: int = 0  # GQA: fewer KV heads than query heads (0: as many)
    model_type: str = "llava"  # "llava_next": NEXT_FIXTURE's processor and geometry, Mistral LM


CONFIGS = {
    # 64 px and 8 px patches: 64 image tokens. A shape of 0.15 of the side is ~19 px wide,
    # enough to tell a star from a circle; an 8x8 patch holds a whole corner of it.
    "demo": Shape(
        image_size=64,
        patch_size=8,
        vision_hidden=64,
        vision_layers=3,
        vision_heads=4,
        text_hidden=96,
        text_layers=3,
        text_heads=4,
        text_intermediate=256,
        max_positions=512,
        pad_to_square=True,
        vision_steps=2000,
        chat_steps=1000,
        batch_size=64,
        vision_lr=5e-3,
    ),
    "realistic": Shape(
        image_size=336,
        patch_size=14,
        vision_hidden=64,
        vision_layers=1,
        vision_heads=2,
        text_hidden=768,
        text_layers=6,
        text_heads=12,
        text_intermediate=2048,
        max_positions=2048,
        filler_words=4000,
    ),
    # realistic's widths; a square image's 2,928 image tokens + 10 turns fit in 4,096 positions.
    "realistic-next": Shape(
        image_size=336,
        patch_size=14,
        vision_hidden=64,
        vision_layers=1,
        vision_heads=2,
        text_hidden=768,
        text_layers=6,
        text_heads=12,
        text_kv_heads=4,
        text_intermediate=2048,
        max_positions=4096,
        model_type="llava_next",
    ),
}


# -- tokenizer and processor -------------------------------------------------------------------
WORD_SPLIT = pre_tokenizers.Sequence(
    [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
)
# "I don't know" is one added token, matched before the lower-casing normaliser and the
# punctuation split (so it keeps its capital and apostrophe): one id like every other answer,
# so it is never cut short after "I".
DONT_KNOW_TOKEN = AddedToken(DONT_KNOW, single_word=True, normalized=False)


def words_of(text: str) -> list[str]:
    """``text`` split as the tokenizer splits it (lower-cased words, single punctuation marks)."""
    return [word for word, _ in WORD_SPLIT.pre_tokenize_str(text.lower())]


def dialogue_words() -> list[str]:
    """Every word of the chat template, the questions and the answers (lower-cased)."""
    words = ["user", "assistant", "system", ":", "?", ".", ",", "!"]
    for text in (*QUESTIONS, *OFF_TOPIC_QUESTIONS, *COLORS, *SHAPES):
        words += words_of(text)
    return list(dict.fromkeys(words))  # once each: a repeat would shift every later id


def build_tokenizer(filler_words: int, max_positions: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: lower-cased words and single punctuation marks, one id each.

    ``<s>`` is prepended by the post-processor (like Llama's), ``</s>`` ends every answer, and
    ``<image>`` is a special added token, matched before normalisation, so it is never split.
    """
    words = dialogue_words() + [f"w{i:04d}" for i in range(filler_words)]
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *words))}
    # Ids must be 0..len-1: the added "I don't know" takes id len(vocab), and a gap or a
    # duplicate would make it share its id with a word (it once swallowed "cross").
    assert sorted(vocab.values()) == list(range(len(vocab))), "duplicate tokenizer words"
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = WORD_SPLIT
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([DONT_KNOW_TOKEN])
    tokenizer.post_processor = tk_processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", BOS_ID)]
    )
    # Joins words with spaces and drops the space before punctuation ("shape ?" -> "shape?").
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},  # LlavaProcessor reads .image_token
        model_max_length=max_positions,
    )
    assert fast.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    return fast


def build_processor(shape: Shape) -> LlavaProcessor | LlavaNextProcessor:
    if shape.model_type == "llava_next":
        return LlavaNextProcessor.from_pretrained(NEXT_FIXTURE)
    tokenizer = build_tokenizer(shape.filler_words, shape.max_positions)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": shape.image_size},
        crop_size={"height": shape.image_size, "width": shape.image_size},
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=shape.patch_size,
        vision_feature_select_strategy="default",  # drop CLS: (size/patch)^2 image tokens
        chat_template=CHAT_TEMPLATE,
        num_additional_image_tokens=1,  # CLIP's CLS token
    )


# -- model -------------------------------------------------------------------------------------
def vision_config(shape: Shape) -> CLIPVisionConfig:
    return CLIPVisionConfig(
        hidden_size=shape.vision_hidden,
        intermediate_size=4 * shape.vision_hidden,
        num_hidden_layers=shape.vision_layers,
        num_attention_heads=shape.vision_heads,
        image_size=shape.image_size,
        patch_size=shape.patch_size,
        projection_dim=shape.vision_hidden,
    )


def text_sizes(shape: Shape) -> dict:
    """The text model's sizes, whichever its class."""
    return {
        "hidden_size": shape.text_hidden,
        "intermediate_size": shape.text_intermediate,
        "num_hidden_layers": shape.text_layers,
        "num_attention_heads": shape.text_heads,
        "num_key_value_heads": shape.text_kv_heads or shape.text_heads,
        "max_position_embeddings": shape.max_positions,
        "tie_word_embeddings": False,
    }


def build_config(shape: Shape, vocab_size: int) -> LlavaConfig:
    text = LlamaConfig(
        vocab_size=vocab_size,
        **text_sizes(shape),
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return LlavaConfig(
        vision_config=vision_config(shape),
        text_config=text,
        image_token_index=IMAGE_ID,
        image_seq_length=(shape.image_size // shape.patch_size) ** 2,
        vision_feature_select_strategy="default",
        # The last layer (llava-1.5 takes the second to last of 24; with a few layers, the
        # last one is the only one that has seen the whole image for long enough).
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        # Read by llava.model.loading.load_model: every way of serving this model keeps the
        # whole image.
        **({"image_aspect_ratio": PAD} if shape.pad_to_square else {}),
    )


def build_next_config(shape: Shape) -> LlavaNextConfig:
    """NEXT_FIXTURE's config.json at ``shape``'s sizes: its pinpoints, ids, vocabulary, rope."""
    real = LlavaNextConfig.from_pretrained(NEXT_FIXTURE)
    assert (real.vision_config.image_size, real.vision_config.patch_size) == (
        shape.image_size,
        shape.patch_size,
    )
    tokens = real.text_config
    text = MistralConfig(
        vocab_size=tokens.vocab_size,
        **text_sizes(shape),
        rms_norm_eps=tokens.rms_norm_eps,
        rope_parameters=tokens.rope_parameters,
        sliding_window=None,
        bos_token_id=tokens.bos_token_id,
        eos_token_id=tokens.eos_token_id,
    )
    return LlavaNextConfig(
        vision_config=vision_config(shape),
        text_config=text,
        image_token_index=real.image_token_index,
        image_grid_pinpoints=real.image_grid_pinpoints,
        vision_feature_select_strategy=real.vision_feature_select_strategy,  # "default"
        vision_feature_layer=-1,  # as realistic: a one-layer tower's last layer
        projector_hidden_act=real.projector_hidden_act,
        use_image_newline_parameter=True,
        tie_word_embeddings=False,
    )


def build_model(
    shape: Shape, processor: LlavaProcessor | LlavaNextProcessor, seed: int
) -> LlavaForConditionalGeneration | LlavaNextForConditionalGeneration:
    if shape.model_type == "llava_next":
        config, model_class = build_next_config(shape), LlavaNextForConditionalGeneration
        tokenizer = processor.tokenizer
        ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    else:
        config, model_class = (
            build_config(shape, len(processor.tokenizer)),
            LlavaForConditionalGeneration,
        )
        ids = (BOS_ID, EOS_ID, PAD_ID)
    torch.manual_seed(seed)
    model = model_class(config).float()  # sdpa attention, transformers' default
    generation = model.generation_config
    generation.bos_token_id, generation.eos_token_id, generation.pad_token_id = ids
    generation.do_sample = False
    return model


# -- training ----------------------------------------------------------------------------------
# Why two stages and dense auxiliary targets: trained on answers alone, a small ViT learns
# colours at once but shapes only after thousands of steps: the outline has to be found
# whatever its colour and size. So stage 1 trains the tower alone, on the last layer (the one
# LLaVA projects): per patch, which of its pixels are the shape (a mask) and whether it holds
# a convex or concave vertex of the outline (corners: 0 circle, 3 triangle, 4 square, 5+5
# star, 8+4 cross); for the image, the shape and colour read from the patch tokens' mean.
# Position embeddings are fixed 2D sines (a grid is known from the first step, not learned),
# and shapes stand upright, mirrored at random. Stage 2 trains the projector and the LM on
# dialogues. The heads are thrown away: the saved model is a plain LLaVA. What each choice
# bought: docs/demo-model.md §Demo model: what made shapes learnable.

CORNER_WEIGHT = 8.0  # a shape has 0-12 vertices among 64 patches: weigh the rare positives


class AuxHeads(torch.nn.Module):
    """Linear heads on the vision tower's last-layer patch tokens (read through a hook)."""

    def __init__(self, shape: Shape, tower):
        super().__init__()
        hidden = shape.vision_hidden
        self.patch = shape.patch_size
        self.shape = torch.nn.Linear(hidden, len(SHAPES))
        self.color = torch.nn.Linear(hidden, len(COLORS))
        self.mask = torch.nn.Linear(hidden, shape.patch_size**2)
        self.corner = torch.nn.Linear(hidden, 2)  # a convex / concave vertex in this patch
        self.tokens = torch.empty(0)
        self.hook = tower.encoder.layers[-1].register_forward_hook(self._keep)

    def _keep(self, _module, _inputs, output) -> None:
        output = output[0] if isinstance(output, tuple) else output
        self.tokens = output[:, 1:]  # patch tokens only: LLaVA drops CLS

    def loss(self, targets: dict) -> torch.Tensor:
        """Of the tower's last forward pass."""
        functional = torch.nn.functional
        mask = targets["mask"]  # (batch, side, side) pixel coverage, side = grid * patch
        batch, side = mask.shape[0], mask.shape[1]
        grid = side // self.patch
        cells = mask.view(batch, grid, self.patch, grid, self.patch).permute(0, 1, 3, 2, 4)
        cells = cells.reshape(batch, grid * grid, self.patch**2)
        pooled = self.tokens.mean(1)
        corners = targets["corners"].flatten(2).transpose(1, 2)  # (batch, patches, 2)
        return (
            functional.cross_entropy(self.shape(pooled), targets["shape"])
            + functional.cross_entropy(self.color(pooled), targets["color"])
            + functional.binary_cross_entropy_with_logits(self.mask(self.tokens), cells)
            + functional.binary_cross_entropy_with_logits(
                self.corner(self.tokens), corners, pos_weight=torch.tensor(CORNER_WEIGHT)
            )
        )

    @torch.no_grad()
    def shape_accuracy(self, tower, pixels: torch.Tensor, shapes: torch.Tensor) -> float:
        """Share of images whose shape the head reads right from the tower's tokens."""
        tower(pixel_values=pixels)
        return (self.shape(self.tokens.mean(1)).argmax(-1) == shapes).float().mean().item()

    def remove(self) -> None:
        self.hook.remove()


def fix_sine_positions(tower) -> None:
    """Patch positions as fixed 2D sines (x in one half of the width, y in the other); CLS 0.

    A learned table starts as noise, and the tower spends its first thousand steps learning
    which patches are neighbours; sines give it that from step one (measured: +5 points).
    """
    table = tower.embeddings.position_embedding.weight
    grid = math.isqrt(table.shape[0] - 1)
    quarter = table.shape[1] // 4
    frequencies = 1.0 / 100 ** (torch.arange(quarter) / quarter)
    rows, columns = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")

    def encode(coordinate: torch.Tensor) -> torch.Tensor:
        angles = coordinate.flatten().float()[:, None] * frequencies[None]
        return torch.cat([angles.sin(), angles.cos()], 1)

    with torch.no_grad():
        table[0] = 0.0
        table[1:] = 0.5 * torch.cat([encode(columns), encode(rows)], 1)
    table.requires_grad_(False)


def mirror(tensor: torch.Tensor, flip: bool) -> torch.Tensor:
    """Left-right mirror of the last (spatial) dim: it changes no label."""
    return tensor.flip(-1) if flip else tensor


def corner_map(sample: ShapeSample, grid: int) -> torch.Tensor:
    """(2, grid, grid): 1 where a patch holds a convex (0) or concave (1) vertex of the outline.

    Positions are on the image padded to a square, as training feeds it.
    """
    width, height = sample.image.size
    side = max(width, height)
    left, top = (side - width) / 2, (side - height) / 2
    found = torch.zeros(2, grid, grid)
    for x, y, convex in sample.corners:
        column, row = int((x * width + left) / side * grid), int((y * height + top) / side * grid)
        if 0 <= column < grid and 0 <= row < grid:
            found[0 if convex else 1, row, column] = 1.0
    return found


class TrainingImages:
    """The training seeds' pixels (padded, through the processor) and targets, made once."""

    def __init__(self, processor: LlavaProcessor, shape: Shape):
        side = shape.image_size
        image_processor = processor.image_processor
        grid = side // shape.patch_size
        start = time.perf_counter()
        # Drawing is PIL work, seed by seed: spread it over one process per thread.
        with multiprocessing.get_context("fork").Pool(THREADS) as pool:
            drawn = pool.map(sample_and_mask_from_seed, TRAIN_SEEDS, chunksize=250)
        self.draw_s = time.perf_counter() - start
        start = time.perf_counter()
        self.samples: list[ShapeSample] = [sample for sample, _ in drawn]
        images, masks, corners = [], [], []
        for sample, mask in drawn:
            images.append(prepare_image(sample.image, PAD, image_processor))
            # Coverage of each model pixel, through the same padding as the image.
            square = pad_to_square(mask, 0).resize((side, side), Image.Resampling.BOX)
            masks.append(torch.frombuffer(bytearray(square.tobytes()), dtype=torch.uint8))
            corners.append(corner_map(sample, grid))
        pixels = [
            image_processor(images[i : i + 500], return_tensors="pt").pixel_values
            for i in range(0, len(images), 500)
        ]
        self.process_s = time.perf_counter() - start
        self.pixels = torch.cat(pixels)
        self.masks = torch.stack(masks).view(-1, side, side)
        self.corners = torch.stack(corners)
        self.shapes = torch.tensor([SHAPES.index(s.shape) for s in self.samples])
        self.colors = torch.tensor([COLORS.index(s.color) for s in self.samples])

    def batch(self, index: list[int], flip: bool) -> tuple[torch.Tensor, dict]:
        targets = {
            "shape": self.shapes[index],
            "color": self.colors[index],
            "mask": mirror(self.masks[index], flip).float() / 255,
            "corners": mirror(self.corners[index], flip),
        }
        return mirror(self.pixels[index], flip), targets


def off_topic_question(rng: random.Random) -> str:
    """A question the model should decline: listed, a known one altered, or words at random."""
    kind = rng.choices(("listed", "altered", "salad"), weights=(6, 2, 2))[0]
    known = {tuple(words_of(q)) for q in QUESTIONS}
    vocabulary = [w for w in dialogue_words() if w.isalpha()]
    while True:
        if kind == "salad":
            words = rng.choices(vocabulary, k=rng.randint(1, 7)) + ["?"]
        else:
            source = rng.choice(OFF_TOPIC_QUESTIONS if kind == "listed" else QUESTIONS)
            words = source.split()
            if kind == "altered" or rng.random() < 0.3:
                at = rng.randrange(len(words))
                other = rng.choice([*vocabulary, "zzz"])  # zzz: a word with no token (<unk>)
                edit = rng.choice(("swap", "drop", "add"))
                if edit == "swap":
                    words[at] = other
                elif edit == "drop" and len(words) > 1:
                    del words[at]
                else:
                    words.insert(at, other)
        text = " ".join(words)
        if tuple(words_of(text)) not in known:
            return text


def sample_dialogue(rng: random.Random, sample: ShapeSample) -> list[tuple[str, str]]:
    """1-6 (question, answer) turns; follow-ups mostly where the previous answer makes sense."""
    # Many turns per image: the 64 image tokens cost the same for one answer or six.
    turns = rng.choices((1, 2, 3, 4, 5, 6), weights=(1, 2, 3, 4, 4, 4))[0]
    dialogue: list[tuple[str, str]] = []
    answer = None
    for _ in range(turns):
        if answer is None:
            options, weights = (COLOR_QUESTION, SHAPE_QUESTION, REPEAT, None), (8, 8, 1, 2)
        elif answer == DONT_KNOW:
            options = (COLOR_QUESTION, SHAPE_QUESTION, COLOR_FOLLOW_UP, SHAPE_FOLLOW_UP, REPEAT)
            options, weights = (*options, None), (2, 2, 1, 1, 2, 2)
        else:
            other = COLOR_FOLLOW_UP if answer in SHAPES else SHAPE_FOLLOW_UP
            options = (other, REPEAT, COLOR_QUESTION, SHAPE_QUESTION, None)
            weights = (4, 4, 1, 1, 1)
        question = rng.choices(options, weights=weights)[0] or off_topic_question(rng)
        answer = answer_for(question, sample, answer)
        dialogue.append((question, answer))
    return dialogue


class Dialogues:
    """Token ids and labels (answers and their EOS only) of dialogues, as the engine builds them."""

    def __init__(self, processor: LlavaProcessor, probe: Image.Image):
        self.pieces = DialogueTokens(processor)
        self.probe = probe  # the first turn's ids depend on the image only through its size
        self.first: dict[str, list[int]] = {}
        self.follow: dict[str, list[int]] = {}
        self.answers = {w: self.pieces.answer(w) for w in (*COLORS, *SHAPES, DONT_KNOW)}

    def prompt(self, question: str, first_turn: bool) -> list[int]:
        if first_turn:
            if question not in self.first:
                self.first[question] = self.pieces.first_turn(question, self.probe)[0]
            return self.first[question]
        if question not in self.follow:
            self.follow[question] = self.pieces.follow_up(question)
        return self.follow[question]

    def batch(
        self, rng: random.Random, samples: list[ShapeSample]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = []
        for sample in samples:
            ids, labels = [], []
            for turn, (question, answer) in enumerate(sample_dialogue(rng, sample)):
                prompt, words = self.prompt(question, turn == 0), self.answers[answer][:-1]
                # The engine keeps no EOS in the history: the next prompt follows the answer's
                # words, and EOS is only the target at the position after them.
                ids += prompt + words
                labels += [EOS_ID if labels else -100] + [-100] * (len(prompt) - 1) + words
            rows.append((ids + [EOS_ID], labels + [EOS_ID]))
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), PAD_ID)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row_ids, row_labels) in enumerate(rows):
            input_ids[i, : len(row_ids)] = torch.tensor(row_ids)
            labels[i, : len(row_labels)] = torch.tensor(row_labels)
            mask[i, : len(row_ids)] = 1
        return input_ids, labels, mask


class Seeds:
    """Training images in a seeded random order, epoch after epoch."""

    def __init__(self, rng: random.Random, count: int):
        self.rng, self.count, self.order = rng, count, []

    def take(self, n: int) -> list[int]:
        while len(self.order) < n:
            epoch = list(range(self.count))
            self.rng.shuffle(epoch)
            self.order += epoch
        taken, self.order = self.order[:n], self.order[n:]
        return taken


def warmup_cosine(optimizer, steps: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimize(parameters, lr: float, steps: int, step_loss, label: str) -> None:
    parameters = list(parameters)
    optimizer = torch.optim.AdamW(parameters, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = warmup_cosine(optimizer, steps, warmup=max(1, steps // 12))
    start, cpu, running = time.perf_counter(), time.process_time(), None
    for step in range(steps):
        loss = step_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        scheduler.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            used = time.process_time() - cpu
            print(
                f"{label} step {step:4d}  loss {running:.4f}  {elapsed:6.1f}s  cpu {used:6.1f}s",
                flush=True,
            )


def train(model, processor: LlavaProcessor, shape: Shape, seed: int) -> None:
    # Every training image is padded to a square (its targets too): the saved model must ask
    # for the same, or serving would centre-crop what training saw whole.
    assert shape.pad_to_square, "a trained config needs pad_to_square=True"
    started, cpu = time.perf_counter(), time.process_time()
    images = TrainingImages(processor, shape)
    print(
        f"{len(images.samples)} training images in {time.perf_counter() - started:.1f}s "
        f"(drawing {images.draw_s:.1f}s, processor {images.process_s:.1f}s, "
        f"cpu {time.process_time() - cpu:.1f}s)"
    )
    rng = random.Random(seed)
    seeds = Seeds(rng, len(images.samples))
    tower = model.model.vision_tower
    fix_sine_positions(tower)
    heads = AuxHeads(shape, tower)
    model.train()

    def vision_loss() -> torch.Tensor:
        pixels, targets = images.batch(seeds.take(shape.batch_size), rng.random() < 0.5)
        tower(pixel_values=pixels)
        return heads.loss(targets)

    vision = [*tower.parameters(), *heads.parameters()]
    optimize(vision, shape.vision_lr, shape.vision_steps, vision_loss, "vision")
    probe = [
        sample
        for family in FAMILIES
        for sample in held_out_samples(40, HELD_OUT_SEED_START + 500_000, (family,))
    ]
    held_out = [prepare_image(s.image, PAD, processor.image_processor) for s in probe]
    pixels = processor.image_processor(held_out, return_tensors="pt").pixel_values
    truth = torch.tensor([SHAPES.index(s.shape) for s in probe])
    print(f"vision probe: shape {heads.shape_accuracy(tower, pixels, truth):.1%} held-out")

    heads.remove()
    # Stage 2 trains the projector and the LM; the tower stays as stage 1 left it, as LLaVA-1.5
    # keeps CLIP frozen (measured: no worse than training it too, and a quarter cheaper).
    tower.requires_grad_(False)
    dialogues = Dialogues(processor, images.samples[0].image)

    def chat_loss() -> torch.Tensor:
        index = seeds.take(shape.chat_batch)
        pixels = mirror(images.pixels[index], rng.random() < 0.5)
        input_ids, labels, mask = dialogues.batch(rng, [images.samples[i] for i in index])
        logits = model(input_ids=input_ids, attention_mask=mask, pixel_values=pixels).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )

    trained = [p for p in model.parameters() if p.requires_grad]
    optimize(trained, shape.chat_lr, shape.chat_steps, chat_loss, "chat")
    model.eval()


# -- main --------------------------------------------------------------------------------------
def make_deterministic(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(THREADS)


def replace_dir(built: Path, out: Path) -> None:
    """Move ``built`` to ``out``, replacing an earlier model directory (and nothing else)."""
    if out.exists():
        if any(out.iterdir()) and not (out / "config.json").exists():
            raise SystemExit(f"{out} exists and is not a model directory; not replacing it")
        shutil.rmtree(out)
    built.rename(out)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/demo-llava", type=Path)
    parser.add_argument("--config", default="demo", choices=sorted(CONFIGS))
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--eval-images", default=100, type=int, help="held-out images (demo)")
    args = parser.parse_args(argv)
    shape = CONFIGS[args.config]
    start = time.perf_counter()
    make_deterministic(args.seed)

    processor = build_processor(shape)
    model = build_model(shape, processor, args.seed)
    if shape.chat_steps:
        train(model, processor, shape, args.seed)

    built = args.out.with_name(args.out.name + ".building")
    shutil.rmtree(built, ignore_errors=True)
    built.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(built)
    processor.save_pretrained(built)
    if shape.model_type == "llava_next":  # the stand-in tokenizer's licence note goes with it
        shutil.copy(NEXT_FIXTURE / "README.md", built / "TOKENIZER-README.md")
    for path in built.iterdir():
        path.chmod(0o644)  # safetensors are written 0600; the model is read by other users
    replace_dir(built, args.out)
    build_s = time.perf_counter() - start

    digest = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()
    inner = model.model
    print(f"\n{args.config} model in {args.out}")
    print(f"  parameters      {count(model):,}")
    print(f"    vision tower  {count(inner.vision_tower):,}")
    print(f"    projector     {count(inner.multi_modal_projector):,}")
    print(f"    language      {count(inner.language_model) + count(model.lm_head):,}")
    print(f"  image tokens    {most_image_tokens(processor):,} at most")
    print(f"  on disk         {dir_bytes(args.out) / 2**20:.2f} MiB")
    print(f"  build time      {build_s:.1f} s")
    print(f"  sha256          {digest}")
    if shape.chat_steps:
        eval_start = time.perf_counter()
        loaded = load_model(str(args.out), device="cpu", dtype="float32")  # as saved
        per_family = max(1, args.eval_images // len(FAMILIES))
        accuracy = evaluate_families(loaded, per_family)
        print(f"  held-out accuracy, {per_family} images per family, greedy:")
        print_table(accuracy)
        print(f"  ({time.perf_counter() - eval_start:.1f} s)")
    print(f"  wall time       {time.perf_counter() - start:.1f} s, cpu {time.process_time():.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
