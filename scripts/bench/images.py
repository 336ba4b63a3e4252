"""A second image in a session: the time to first token of its turn, three ways, side by side.

    python -m scripts.bench.images [--shapes llava-1.5,next] [--rounds 3] [--turns 10]
                                   [--image-turn 6] [--new-tokens 8]

A conversation of ``--turns`` turns opens on one image; at turn ``--image-turn`` the caller
has a second image to ask about. That turn's time to first token, as the caller's clock sees
it (from the call to the first streamed token), served three ways:

  in session   the ask carries the image (``Engine.ask(..., image=...)``): its processor and
               vision tower run, then only the new user message (the image's tokens and the
               question) is prefilled on top of the session's KV
  new session  what a caller had to do before: open a new session on the second image (its
               vision tower and opening prefilled), then ask there; that session has neither
               the first image nor the conversation so far
  stateless    a server that keeps nothing: both images through the processor and the vision
               tower again, then the in-session turn's whole prompt (both images' tokens, the
               earlier questions and answers, the question) prefilled on an empty KV, token
               for token what the session holds (scripts/bench/turns.py's stateless mode)

Shapes (untrained models of the real image geometry, built into build/ if missing):
  llava-1.5  build/realistic-llava: 336 px, 576 image tokens an image
  next       build/realistic-llava-next: llava-v1.6-mistral-7b-hf's anyres geometry, a square
             672 px image: 2,928 image tokens; two of them do not fit in that model's 4,096
             positions, so it runs with its position limit raised to 8,192 (the weights
             linked, rotary positions have none; the real checkpoint has 32,768)
  demo       models/demo-llava (64 px, 64 image tokens): the tests' smallest run

Every round uses images no session saw before (random noise: nothing is shared between the
three ways or with earlier rounds); medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llava.config import EngineConfig
from llava.engine import Engine
from llava.model.vision import vision_inputs
from scripts.bench.memory import long_context_model
from scripts.bench.prefix import noise_images
from scripts.bench.turns import QUESTIONS, answer_from_scratch, ensure_model

REPO = Path(__file__).resolve().parents[2]
WAYS = ("in session", "new session", "stateless")
SECOND_QUESTION = "What color is the shape?"  # in every shape's vocabulary


@dataclass(frozen=True)
class BenchShape:
    """A model this bench runs on and the side of the square images it sends."""

    model_dir: Path
    build: str | None  # demo_model.build --config that makes model_dir (None: committed)
    side: int  # px
    positions: int | None = None  # run with the position limit raised to this


SHAPES = {
    "llava-1.5": BenchShape(REPO / "build" / "realistic-llava", "realistic", 336),
    "next": BenchShape(REPO / "build" / "realistic-llava-next", "realistic-next", 672, 8192),
    "demo": BenchShape(REPO / "models" / "demo-llava", None, 64),
}
LIMITS = {"rounds": (1, 10), "turns": (2, 20), "new_tokens": (1, 32)}


@dataclass
class Seen:
    """One way's turn in one round."""

    ttft_s: float  # the caller's clock: from the call (the open, for a new session) to token 1
    engine_ttft_s: float | None  # Answer.ttft_s (plus the open for a new session); None: none
    prefilled: int  # tokens computed for this turn (the open's included)
    image_tokens: int  # of them, image tokens
    vision_runs: int  # images through the vision tower
    images: int | None  # the session's images after the turn (Answer.images); None: no session


@dataclass
class Row:
    """One way's medians over the rounds."""

    shape: str
    way: str
    ttft_s: float
    low_s: float
    high_s: float
    engine_ttft_s: float | None
    prefilled: int
    image_tokens: int
    vision_runs: int
    images: int | None


def model_dir(shape: BenchShape) -> Path:
    """The shape's model directory, built first if missing (positions raised if asked)."""
    if shape.build is not None:
        ensure_model(shape.model_dir, shape.build)
    if shape.positions is None:
        return shape.model_dir
    return long_context_model(shape.model_dir, shape.positions)


def timed_ask(engine: Engine, session_id: str, question: str, params: dict, image=None):
    """(seconds from the call to the first streamed token, the Answer)."""
    first: list[float] = []

    def on_token(_text: str, _token_id: int | None) -> None:
        if not first:
            first.append(time.perf_counter())

    extra = {} if image is None else {"image": image}
    start = time.perf_counter()
    answer = engine.ask(session_id, question, params, on_token, **extra)
    return (first[0] if first else time.perf_counter()) - start, answer


def in_session(engine: Engine, images, turns: int, image_turn: int, params: dict):
    """The conversation on ``images[0]``, ``images[1]`` sent with turn ``image_turn``: that
    turn as Seen, and its whole prompt as the session holds it (for the stateless way)."""
    session_id = engine.open(images[0]).session_id
    seen = prompt = None
    for turn in range(1, turns + 1):
        if turn != image_turn:
            engine.ask(session_id, QUESTIONS[(turn - 1) % len(QUESTIONS)], params)
            continue
        wall, answer = timed_ask(engine, session_id, SECOND_QUESTION, params, images[1])
        history = engine.store.session(session_id).token_ids
        prompt = list(history[: answer.cached_tokens + answer.new_tokens])
        seen = Seen(wall, answer.ttft_s, answer.new_tokens, answer.image_tokens, 1, answer.images)
    engine.close(session_id)
    return seen, prompt


def new_session(engine: Engine, image, params: dict) -> Seen:
    """Open on ``image``, ask the second image's question there."""
    start = time.perf_counter()
    opened = engine.open(image)
    open_s = time.perf_counter() - start
    wall, answer = timed_ask(engine, opened.session_id, SECOND_QUESTION, params)
    engine.close(opened.session_id)
    prefilled = opened.prefill_tokens + answer.new_tokens
    return Seen(
        open_s + wall, open_s + answer.ttft_s, prefilled, opened.image_tokens, 1, answer.images
    )


def stateless(engine: Engine, images, prompt: list[int]) -> Seen:
    """Both images' processor and vision tower, then ``prompt`` prefilled on an empty KV."""
    loaded = engine.loaded
    start = time.perf_counter()
    features = torch.cat(
        [
            engine.encode_image(
                vision_inputs(image, loaded.processor.image_processor, loaded.image_aspect_ratio)
            )
            for image in images
        ]
    )
    setup = time.perf_counter() - start
    first, _ = answer_from_scratch(engine, prompt, features, 1)
    image_tokens = prompt.count(loaded.model.config.image_token_id)
    if image_tokens != features.shape[0]:
        raise RuntimeError(f"{image_tokens} image tokens in the prompt, {features.shape[0]} rows")
    return Seen(setup + first, None, len(prompt), image_tokens, len(images), None)


def warm_up(engine: Engine, side: int) -> None:
    """Lazy initialization and first-call allocations outside the timed rounds: the engine's
    own warm-up, then a session given a second image on its first turn."""
    engine.warm_up()
    first, second = noise_images(2, seed=999, side=side)
    session_id = engine.open(first).session_id
    engine.ask(session_id, SECOND_QUESTION, {"max_new_tokens": 1}, image=second)
    engine.close(session_id)


def run_shape(name: str, args) -> tuple[list[Row], str]:
    """The three ways' rows for one shape, and a line describing its model."""
    shape = SHAPES[name]
    directory = model_dir(shape)
    engine = Engine.from_config(EngineConfig(model_dir=str(directory)))
    try:
        warm_up(engine, shape.side)
        params = {"max_new_tokens": args.new_tokens}
        seen: dict[str, list[Seen]] = {way: [] for way in WAYS}
        history = 0
        for index in range(args.rounds):
            # fresh images every round: the first, the second, the new session's second
            first, second, other = noise_images(3, seed=1000 + index, side=shape.side)
            turn, prompt = in_session(engine, (first, second), args.turns, args.image_turn, params)
            seen["in session"].append(turn)
            seen["new session"].append(new_session(engine, other, params))
            seen["stateless"].append(stateless(engine, (first, second), prompt))
            history = len(prompt) - turn.prefilled
        parameters = sum(p.numel() for p in engine.loaded.model.parameters())
        described = (
            f"{name}: {directory.name}, {parameters / 1e6:.1f} M parameters, "
            f"{shape.side}x{shape.side} px images; turn {args.image_turn} of {args.turns} "
            f"on a session history of {history:,} tokens"
        )
    finally:
        engine.stop()
    return [summarize(name, way, seen[way]) for way in WAYS], described


def summarize(shape: str, way: str, seen: list[Seen]) -> Row:
    engine_ttft = [s.engine_ttft_s for s in seen if s.engine_ttft_s is not None]
    last = seen[-1]  # token counts are the same every round (same sizes, same prompts)
    return Row(
        shape,
        way,
        statistics.median(s.ttft_s for s in seen),
        min(s.ttft_s for s in seen),
        max(s.ttft_s for s in seen),
        statistics.median(engine_ttft) if engine_ttft else None,
        last.prefilled,
        last.image_tokens,
        last.vision_runs,
        last.images,
    )


HEADER = (
    "| shape | way | TTFT ms | min..max ms | engine ttft_s ms | tokens prefilled "
    "| image tokens prefilled | vision tower runs | session's images | vs in session |"
)


def table(rows: list[Row]) -> list[str]:
    """The markdown table: a row per shape and way."""
    lines = [HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {row.shape: row.ttft_s for row in rows if row.way == "in session"}
    for row in rows:
        engine = "-" if row.engine_ttft_s is None else f"{row.engine_ttft_s * 1000:,.0f}"
        images = "-" if row.images is None else str(row.images)
        lines.append(
            f"| {row.shape} | {row.way} | {row.ttft_s * 1000:,.0f} | "
            f"{row.low_s * 1000:,.0f}..{row.high_s * 1000:,.0f} | {engine} | "
            f"{row.prefilled:,} | {row.image_tokens:,} | {row.vision_runs} | {images} | "
            f"{row.ttft_s / base[row.shape]:.1f}x |"
        )
    return lines


def bounded(name: str, limits: dict[str, tuple[int, int]] = LIMITS):
    """An argparse type: a whole number within ``limits[name]`` (low, high)."""
    low, high = limits[name]

    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"from {low} to {high}")
        return value

    return parse


def shape_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SHAPES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"comma-separated, of {', '.join(SHAPES)}")
    return list(dict.fromkeys(names))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=shape_list, default=["llava-1.5", "next"])
    parser.add_argument("--rounds", type=bounded("rounds"), default=3)
    parser.add_argument("--turns", type=bounded("turns"), default=10)
    parser.add_argument("--image-turn", type=int, default=6, help="from 2 to --turns")
    parser.add_argument("--new-tokens", type=bounded("new_tokens"), default=8)
    args = parser.parse_args(argv)
    if not 2 <= args.image_turn <= args.turns:
        parser.error(f"--image-turn: from 2 to --turns ({args.turns})")
    return args


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows, described = [], []
    for name in args.shapes:
        shape_rows, line = run_shape(name, args)
        rows += shape_rows
        described.append(line)
    print(
        f"a second image at turn {args.image_turn} of {args.turns}: time to first token, "
        f"median of {args.rounds} rounds; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.new_tokens} new tokens an answer"
    )
    for line in described:
        print(f"  {line}")
    print()
    print("\n".join(table(rows)))
    return rows


if __name__ == "__main__":
    main()
