"""Build the offline demo LLaVA (trained) or a realistic-shape LLaVA (untrained) directory.

    python scripts/build_demo_model.py [--out models/demo-llava] [--config demo|realistic]
                                       [--seed 0]

Everything is made here, nothing is downloaded: a word-level tokenizer (``tokenizers``), a CLIP
image processor, a ``LlavaProcessor`` with the llava-1.5 chat template, and a
``LlavaForConditionalGeneration`` (CLIP vision tower + Llama LM) saved with ``save_pretrained``.
The directory loads with ``AutoProcessor.from_pretrained`` and
``LlavaForConditionalGeneration.from_pretrained``, the calls that load ``llava-hf/llava-1.5-7b-hf``.

``demo`` trains a 0.8 M-parameter model on synthetic shapes (``llava.synthetic``, training seeds
0..9_999) to answer "What color is the shape?", "What shape is it?", "And its color?",
"And its shape?" and "Say that again." in multi-turn chats, on token sequences built exactly as
the engine builds them (``llava.demo_eval.DialogueTokens``), then reports held-out accuracy.
``realistic`` writes an untrained model with LLaVA-1.5's image geometry (336 px, patch 14,
576 image tokens) and an LM big enough that prefill dominates on CPU, for benchmarks.

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
import random
import shutil
import sys
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
    LlavaProcessor,
    PreTrainedTokenizerFast,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llava.demo_eval import (  # noqa: E402
    COLOR_FOLLOW_UP,
    COLOR_QUESTION,
    KINDS,
    QUESTIONS,
    REPEAT,
    SHAPE_FOLLOW_UP,
    SHAPE_QUESTION,
    DialogueTokens,
    answer_for,
    evaluate_dir,
)
from llava.synthetic import (  # noqa: E402
    COLORS,
    SHAPES,
    TRAIN_SEEDS,
    ShapeSample,
    sample_and_mask_from_seed,
)

SPECIAL_TOKENS = ("<unk>", "<pad>", "<s>", "</s>", "<image>")
UNK_ID, PAD_ID, BOS_ID, EOS_ID, IMAGE_ID = range(len(SPECIAL_TOKENS))
THREADS = 2  # fixed: CPU reductions may split differently with another thread count

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
    vision_steps: int = 0  # stage 1: the vision tower alone, on the auxiliary targets
    chat_steps: int = 0  # stage 2: the whole model on dialogues (+ auxiliary targets)
    batch_size: int = 32
    vision_lr: float = 3e-3
    chat_lr: float = 2e-3
    mask_layer: int = 2  # vision layer whose patch tokens predict the shape's mask
    mask_cells: int = 4  # mask cells per patch side (4: one cell per pixel at 32 px / patch 4)
    aux_weight: float = 0.5  # of the auxiliary losses in stage 2


CONFIGS = {
    # 32 px and 4 px patches: 64 image tokens. 64 px with 8 px patches (also 64 tokens) learned
    # shapes more slowly: a patch of a uniform colour says less about the outline it belongs to.
    "demo": Shape(
        image_size=32,
        patch_size=4,
        vision_hidden=64,
        vision_layers=3,
        vision_heads=4,
        text_hidden=128,
        text_layers=3,
        text_heads=4,
        text_intermediate=384,
        max_positions=512,
        vision_steps=2000,
        chat_steps=450,
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
}


# -- tokenizer and processor -------------------------------------------------------------------
def dialogue_words() -> list[str]:
    """Every word of the chat template, the questions and the answers (lower-cased)."""
    words = ["user", "assistant", "system", ":", "?", ".", ","]
    for text in QUESTIONS:
        for word in text.lower().replace("?", " ").replace(".", " ").split():
            if word not in words:
                words.append(word)
    return words + [w for w in (*COLORS, *SHAPES) if w not in words]


def build_tokenizer(filler_words: int, max_positions: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: lower-cased words and single punctuation marks, one id each.

    ``<s>`` is prepended by the post-processor (like Llama's), ``</s>`` ends every answer, and
    ``<image>`` is a special added token, matched before normalisation, so it is never split.
    """
    words = dialogue_words() + [f"w{i:04d}" for i in range(filler_words)]
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *words))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
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


def build_processor(shape: Shape) -> LlavaProcessor:
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
def build_config(shape: Shape, vocab_size: int) -> LlavaConfig:
    vision = CLIPVisionConfig(
        hidden_size=shape.vision_hidden,
        intermediate_size=4 * shape.vision_hidden,
        num_hidden_layers=shape.vision_layers,
        num_attention_heads=shape.vision_heads,
        image_size=shape.image_size,
        patch_size=shape.patch_size,
        projection_dim=shape.vision_hidden,
    )
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.text_hidden,
        intermediate_size=shape.text_intermediate,
        num_hidden_layers=shape.text_layers,
        num_attention_heads=shape.text_heads,
        num_key_value_heads=shape.text_heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_ID,
        image_seq_length=(shape.image_size // shape.patch_size) ** 2,
        vision_feature_select_strategy="default",
        # The last layer (llava-1.5 takes the second to last of 24; with a few layers, the
        # last one is the only one that has seen the whole image for long enough).
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
    )


def build_model(
    shape: Shape, processor: LlavaProcessor, seed: int
) -> LlavaForConditionalGeneration:
    config = build_config(shape, len(processor.tokenizer))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).float()  # sdpa attention, transformers' default
    generation = model.generation_config
    generation.bos_token_id, generation.eos_token_id, generation.pad_token_id = (
        BOS_ID,
        EOS_ID,
        PAD_ID,
    )
    generation.do_sample = False
    return model


# -- training ----------------------------------------------------------------------------------
# Why two stages and auxiliary targets: trained on answers alone, a small ViT learns colours at
# once but shapes only after thousands of steps (measured: ~35 % on shapes after 400 joint
# steps; vision alone ~80 % after 1500): the outline has to be found whatever its colour.
# Telling every patch token which of its pixels belong to the shape (a mask), and the pooled
# tokens which shape and colour the image holds, gets the vision tower to ~98 % in 2000 cheap
# steps (~1 min); the language model then only has to learn to read its tokens and the dialogue.
# The heads of these targets are thrown away: the saved model is a plain LLaVA.


class AuxHeads(torch.nn.Module):
    """Linear heads on the vision tower's patch tokens, fed by hooks on its layers."""

    def __init__(self, shape: Shape, tower):
        super().__init__()
        hidden = shape.vision_hidden
        self.shape = torch.nn.Linear(hidden, len(SHAPES))
        self.color = torch.nn.Linear(hidden, len(COLORS))
        self.mask = torch.nn.Linear(hidden, shape.mask_cells**2)
        self.outputs: dict[str, torch.Tensor] = {}
        layers = tower.encoder.layers
        self.hooks = [
            layers[shape.mask_layer - 1].register_forward_hook(self._keep("mask")),
            layers[-1].register_forward_hook(self._keep("last")),  # what LLaVA projects
        ]

    def _keep(self, name: str):
        def hook(_module, _inputs, output):
            self.outputs[name] = output[0] if isinstance(output, tuple) else output

        return hook

    def loss(self, targets: dict) -> torch.Tensor:
        """Of the tower's last forward pass; patch tokens only (LLaVA drops CLS)."""
        pooled = self.outputs["last"][:, 1:].mean(1)
        mask_logits = self.mask(self.outputs["mask"][:, 1:])
        functional = torch.nn.functional
        return (
            functional.cross_entropy(self.shape(pooled), targets["shape"])
            + functional.cross_entropy(self.color(pooled), targets["color"])
            + functional.binary_cross_entropy_with_logits(mask_logits, targets["mask"])
        )

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


class TrainingImages:
    """The training seeds' pixels (through the processor) and targets, made once."""

    def __init__(self, processor: LlavaProcessor, shape: Shape):
        grid = shape.image_size // shape.patch_size
        cells = grid * shape.mask_cells
        self.samples: list[ShapeSample] = []
        pixels, masks = [], []
        chunk: list[ShapeSample] = []
        for seed in TRAIN_SEEDS:
            sample, mask = sample_and_mask_from_seed(seed)
            self.samples.append(sample)
            chunk.append(sample)
            # Fraction of each mask cell inside the shape, grouped per patch: (patches, cells).
            cover = mask.resize((cells, cells), Image.Resampling.BOX).tobytes()
            cover = torch.tensor(list(cover), dtype=torch.float32) / 255
            cover = cover.view(grid, shape.mask_cells, grid, shape.mask_cells)
            masks.append(cover.permute(0, 2, 1, 3).reshape(grid * grid, -1))
            if len(chunk) == 500 or seed == TRAIN_SEEDS[-1]:
                images = [s.image for s in chunk]
                pixels.append(processor.image_processor(images, return_tensors="pt").pixel_values)
                chunk = []
        self.pixels = torch.cat(pixels)
        self.masks = torch.stack(masks)
        self.shapes = torch.tensor([SHAPES.index(s.shape) for s in self.samples])
        self.colors = torch.tensor([COLORS.index(s.color) for s in self.samples])

    def batch(self, index: list[int]) -> tuple[torch.Tensor, dict]:
        targets = {
            "shape": self.shapes[index],
            "color": self.colors[index],
            "mask": self.masks[index],
        }
        return self.pixels[index], targets


def sample_dialogue(rng: random.Random, sample: ShapeSample) -> list[tuple[str, str]]:
    """1-4 (question, answer) turns; follow-ups only where the previous answer gives them sense."""
    turns = rng.choices((1, 2, 3, 4), weights=(1, 2, 3, 4))[0]
    question = rng.choice((COLOR_QUESTION, SHAPE_QUESTION))
    answer = answer_for(question, sample, None)
    dialogue = [(question, answer)]
    for _ in range(turns - 1):
        other = COLOR_FOLLOW_UP if answer in SHAPES else SHAPE_FOLLOW_UP
        question = rng.choices(
            (other, REPEAT, COLOR_QUESTION, SHAPE_QUESTION), weights=(4, 4, 1, 1)
        )[0]
        answer = answer_for(question, sample, answer)
        dialogue.append((question, answer))
    return dialogue


class Dialogues:
    """Token ids and labels (answers and their EOS only) of dialogues, as the engine builds them."""

    def __init__(self, processor: LlavaProcessor, probe: Image.Image):
        pieces = DialogueTokens(processor)
        # The first turn's ids depend on the image only through its (fixed) size: make them once.
        self.first = {q: pieces.first_turn(q, probe)[0] for q in (COLOR_QUESTION, SHAPE_QUESTION)}
        self.follow = {q: pieces.follow_up(q) for q in QUESTIONS}
        self.answers = {w: pieces.answer(w) for w in (*COLORS, *SHAPES)}

    def batch(
        self, rng: random.Random, samples: list[ShapeSample]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = []
        for sample in samples:
            ids, labels = [], []
            for turn, (question, answer) in enumerate(sample_dialogue(rng, sample)):
                prompt = self.first[question] if turn == 0 else self.follow[question]
                ids += prompt + self.answers[answer]
                labels += [-100] * len(prompt) + self.answers[answer]
            rows.append((ids, labels))
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
    start, running = time.perf_counter(), None
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
            print(f"{label} step {step:4d}  loss {running:.4f}  {elapsed:6.1f}s", flush=True)


def train(model, processor: LlavaProcessor, shape: Shape, seed: int) -> None:
    started = time.perf_counter()
    images = TrainingImages(processor, shape)
    print(f"{len(images.samples)} training images in {time.perf_counter() - started:.1f}s")
    rng = random.Random(seed)
    seeds = Seeds(rng, len(images.samples))
    tower = model.model.vision_tower
    heads = AuxHeads(shape, tower)
    model.train()

    def vision_loss() -> torch.Tensor:
        pixels, targets = images.batch(seeds.take(shape.batch_size))
        tower(pixel_values=pixels)
        return heads.loss(targets)

    vision = [*tower.parameters(), *heads.parameters()]
    optimize(vision, shape.vision_lr, shape.vision_steps, vision_loss, "vision")

    dialogues = Dialogues(processor, images.samples[0].image)

    def chat_loss() -> torch.Tensor:
        index = seeds.take(shape.batch_size)
        pixels, targets = images.batch(index)
        input_ids, labels, mask = dialogues.batch(rng, [images.samples[i] for i in index])
        logits = model(input_ids=input_ids, attention_mask=mask, pixel_values=pixels).logits
        answers = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        return answers + shape.aux_weight * heads.loss(targets)

    everything = [*model.parameters(), *heads.parameters()]
    optimize(everything, shape.chat_lr, shape.chat_steps, chat_loss, "chat")
    heads.remove()
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
    parser.add_argument("--eval-images", default=200, type=int, help="held-out images (demo)")
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
    print(f"  image tokens    {(shape.image_size // shape.patch_size) ** 2}")
    print(f"  on disk         {dir_bytes(args.out) / 2**20:.2f} MiB")
    print(f"  build time      {build_s:.1f} s")
    print(f"  sha256          {digest}")
    if shape.chat_steps:
        eval_start = time.perf_counter()
        accuracy = evaluate_dir(str(args.out), n=args.eval_images)  # as saved, loaded back
        eval_s = time.perf_counter() - eval_start
        print(f"  held-out accuracy, {args.eval_images} images, greedy ({eval_s:.1f} s):")
        for kind in KINDS:
            print(f"    {kind:<16} {accuracy[kind]:7.1%}")
    print(f"  wall time       {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
