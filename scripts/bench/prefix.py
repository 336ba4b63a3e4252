"""Shared prompt prefixes: what a session gains when another one already computed its start.

1. Open latency under one system prompt: a cold open (an image no session has seen), the same
   with ``prefix_sharing`` off, and a held open (a second session on the image of a session
   still open: its features and the full KV blocks of its opening are reused, the vision
   tower skipped). Target: held at least 10x faster than cold.
2. Device bytes held by 32 sessions on one image against 32 sessions on 32 images, each
   having asked one short question, everything on the device. Target: ratio at most 0.4.
3. Guard: one 10-turn session alone, its mean turn time with sharing off, on ("opening", the
   default) with nothing to share (must be no slower than off), and on with the system
   prompt's blocks reused from a closed session (its block table then starts on blocks not
   adjacent to its own).

Runs on the untrained "realistic-shape" model (576 image tokens), built into build/ if missing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from PIL import Image

from llava.config import EngineConfig
from llava.engine import Engine, Opened
from llava.kv.budget import MemoryBudget
from llava.kv.holding import Tier
from llava.model.loading import load_model
from scripts.bench.turns import QUESTIONS, ensure_model

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
SYSTEM = (
    "You are the visual assistant of an online marketplace's support desk. Describe only what "
    "is visible in the customer's photo; never guess a brand, a price or a person's identity. "
    "Answer in at most three short sentences, in plain language, without markdown. If the "
    "photo is too dark, blurred or cropped to answer, say so and ask for another one. Decline "
    "politely anything unrelated to the item shown."
)


def noise_images(n: int, seed: int, side: int = 336) -> list[Image.Image]:
    """``n`` distinct random-noise images, ``side`` x ``side`` (no two share a content key)."""
    rng = random.Random(seed)
    return [Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3)) for _ in range(n)]


def new_engine(loaded, model_dir: Path, sharing: str, first_open: bool = True) -> Engine:
    """Warmed up; ``first_open``: one open and close too, uncounted (its blocks, the system
    prompt's among them, stay published for later sessions to reuse)."""
    config = EngineConfig(str(model_dir), system_prompt=SYSTEM, prefix_sharing=sharing)
    engine = Engine(loaded, config, MemoryBudget(2 << 30))
    engine.warm_up()
    if first_open:
        engine.close(engine.open(noise_images(1, seed=0)[0]).session_id)
    return engine


def timed_open(engine: Engine, image) -> tuple[float, Opened]:
    start = time.perf_counter()
    opened = engine.open(image)
    return time.perf_counter() - start, opened


def open_table(shared: Engine, unshared: Engine, runs: int) -> None:
    """Per run: a cold open on a new image, a held open on the same image while the first is
    open, and a cold open on another new image with sharing off; medians over ``runs``."""
    rows = {"cold": [], "held": [], "cold, sharing off": []}
    for image, other in zip(*(noise_images(runs, seed) for seed in (1, 2)), strict=True):
        opens = {
            "cold": (shared, image),
            "held": (shared, image),  # the cold one still open
            "cold, sharing off": (unshared, other),
        }
        for name, (engine, picture) in opens.items():
            rows[name].append(timed_open(engine, picture))
        for name, (engine, _) in opens.items():
            engine.close(rows[name][-1][1].session_id)
    cold_s = statistics.median(s for s, _ in rows["cold"])
    print(f"\n1. open latency, system prompt of {len(SYSTEM)} characters (median of {runs})\n")
    print("| open | seconds | prefill_tokens | cached_tokens | speed-up vs cold |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, seen in rows.items():
        seconds = statistics.median(s for s, _ in seen)
        opened = seen[-1][1]
        print(
            f"| {name} | {seconds:.3f} | {opened.prefill_tokens} | {opened.cached_tokens} | "
            f"{cold_s / seconds:.1f}x |"
        )


def held_bytes(engine: Engine, images) -> tuple[int, int, int]:
    """Open a session per image, ask each one short question: the device bytes they hold (the
    pool's blocks handed out), the bytes accounted (stats) and the sessions still on device."""
    ids = [engine.open(image).session_id for image in images]
    for session_id in ids:
        engine.ask(session_id, QUESTIONS[0], {"max_new_tokens": 8})
    stats, pool = engine.stats(), engine.memory.pool
    handed_out = (pool.total_blocks - pool.free_blocks) * pool.bytes_per_block
    for session_id in ids:
        engine.close(session_id)
    return handed_out, stats.total_bytes, stats.sessions_by_tier[Tier.KV]


def bytes_table(loaded, model_dir: Path, sessions: int) -> None:
    image = noise_images(1, seed=3)[0]
    held = {}
    for name, images in (
        ("one image", [image] * sessions),
        (f"{sessions} images", noise_images(sessions, seed=4)),
    ):
        engine = new_engine(loaded, model_dir, "opening")  # fresh: no blocks left from before
        held[name] = held_bytes(engine, images)
        engine.stop()
    many = held[f"{sessions} images"][0]
    print(f"\n2. device bytes of {sessions} sessions after one 8-token answer each\n")
    print(
        "| sessions on | on device | device MiB | accounted MiB | MiB per session "
        "| vs distinct images |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (size, accounted, on_device) in held.items():
        print(
            f"| {name} | {on_device} | {size / MiB:.1f} | {accounted / MiB:.1f} | "
            f"{size / sessions / MiB:.2f} | {size / many:.3f} |"
        )


def turn_table(loaded, model_dir: Path, turns: int) -> None:
    """One session per engine, their turns interleaved so drift on the machine hits all."""
    engines = {
        "opening, nothing to share": new_engine(loaded, model_dir, "opening", first_open=False),
        "opening, system prompt shared": new_engine(loaded, model_dir, "opening"),
        "off": new_engine(loaded, model_dir, "off"),
    }
    image = noise_images(1, seed=5)[0]
    opened = {name: engine.open(image) for name, engine in engines.items()}
    params = {"max_new_tokens": 8, "min_new_tokens": 8}
    seconds = {name: [] for name in engines}
    for turn in range(turns):
        for name, engine in engines.items():
            answer = engine.ask(opened[name].session_id, QUESTIONS[turn % len(QUESTIONS)], params)
            seconds[name].append(answer.total_s)
    for engine in engines.values():
        engine.stop()
    off = statistics.mean(seconds["off"])
    print(f"\n3. guard: one session alone, {turns} turns of 8 new tokens\n")
    print("| prefix_sharing | cached_tokens at open | mean turn s | vs off |")
    print("| --- | ---: | ---: | ---: |")
    for name, seen in seconds.items():
        mean = statistics.mean(seen)
        print(f"| {name} | {opened[name].cached_tokens} | {mean:.3f} | {mean / off:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=REPO / "build" / "realistic-llava")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    ensure_model(args.model_dir)
    loaded = load_model(str(args.model_dir))
    params = sum(p.numel() for p in loaded.model.parameters())
    print(
        f"model {args.model_dir.name}: {params / 1e6:.1f} M parameters, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {loaded.device}"
    )
    shared, unshared = (new_engine(loaded, args.model_dir, on) for on in ("opening", "off"))
    open_table(shared, unshared, args.runs)
    shared.stop()
    unshared.stop()
    bytes_table(loaded, args.model_dir, args.sessions)
    turn_table(loaded, args.model_dir, args.turns)


if __name__ == "__main__":
    main()
