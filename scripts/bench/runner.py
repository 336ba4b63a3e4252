"""Decode-step throughput of the packed step runner against Hugging Face's forward.

    python -m scripts.bench.runner [--model-dir build/realistic-llava] [--context 600]
                                   [--batches 1,4,8,32] [--steps 8] [--rounds 5] [--threads N]

Every sequence holds ``--context`` tokens (an image opening of 576 image tokens plus text) in
the KV pool; one decode step then appends one token to each. Rows: the runner at each batch
size, and ``model(ids, past_key_values=DynamicCache)`` at batch 1 (the engine's path before
the runner). ``adjacent``: each session's blocks are adjacent (what the pool hands out when it
can), so the runner reads KV in place; ``scattered``: no two blocks of a session are adjacent,
so every step gathers each session's KV (the runner's worst case). Medians of ``--rounds``
rounds that interleave all paths (other processes' load hits every path alike).
Runs on the untrained realistic-shape model, built into build/ if missing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from llava.exec.runner import Runner, StepInput
from llava.kv.pool import KVPool, SessionKV, kv_bytes_per_token
from llava.model.loading import load_model
from llava.model.reference import prefill
from scripts.bench.turns import ensure_model

REPO = Path(__file__).resolve().parents[2]


def context_ids(loaded, context: int) -> tuple[list[int], torch.Tensor]:
    """An image opening (random features) padded with ordinary words to ``context`` tokens."""
    config = loaded.model.config
    image_tokens = config.image_seq_length
    opening = loaded.prompt.opening_ids(True, image_tokens)
    words = list(range(10, 10 + context - len(opening)))
    features = torch.randn(image_tokens, config.text_config.hidden_size, dtype=loaded.dtype)
    return opening + words, features


def scatter_free_blocks(pool: KVPool) -> None:
    """Hold every free block, then give back every other one: sessions made next get no two
    adjacent blocks, so the runner gathers their KV at every step (its worst case)."""
    holders = [pool.new_kv() for _ in range(pool.free_blocks)]
    for holder in holders:
        holder.reserve(pool.block_tokens)
    for holder in holders[1::2]:
        holder.free()


def filled_sessions(runner: Runner, ids, features, count: int) -> list[SessionKV]:
    """``count`` sessions holding the same context: prefilled once, then blocks copied."""
    pool = runner.pool
    sessions = [pool.new_kv() for _ in range(count)]
    for kv in sessions:
        kv.reserve(len(ids))
    first = sessions[0]
    runner.step([StepInput(first, ids, features)])
    for kv in sessions[1:]:
        pool.kv[:, :, :, kv.slots(0, len(ids))] = pool.kv[:, :, :, first.slots(0, len(ids))]
        kv.length = len(ids)
    return sessions


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def runner_decode(runner: Runner, sessions: list[SessionKV], steps: int):
    """``steps`` decode steps of all ``sessions`` together, from the same context each time."""
    length = sessions[0].length

    def run():
        for kv in sessions:
            kv.crop(length)
            kv.reserve(steps)
        for step in range(steps):
            runner.step([StepInput(kv, [20 + step], None) for kv in sessions])

    return run


def hf_decode(loaded, ids, features, steps: int):
    cache = DynamicCache()
    prefill(loaded.model, ids, cache, features)

    def run():
        cache.crop(len(ids) - cache.get_seq_length())  # transformers 5: minus the count to drop
        for step in range(steps):
            prefill(loaded.model, [20 + step], cache)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(REPO / "build" / "realistic-llava"))
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--batches", default="1,4,8,32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ensure_model(Path(args.model_dir))
    loaded = load_model(args.model_dir, device="cpu", dtype="float32")
    batches = [int(b) for b in args.batches.split(",")]
    ids, features = context_ids(loaded, args.context)
    text = loaded.model.config.text_config
    # adjacent sessions, then scattered ones in every other block of what is left: 3x
    pool_tokens = 3 * sum(batches) * (args.context + args.steps + 16)
    budget = pool_tokens * kv_bytes_per_token(text, loaded.dtype)
    runner = Runner(loaded.model, KVPool(text, budget, loaded.device, loaded.dtype))
    # Rounds interleave every path, so load from other processes hits them alike.
    paths = {("HF DynamicCache", 1): hf_decode(loaded, ids, features, args.steps)}
    for layout in ("adjacent", "scattered"):
        if layout == "scattered":
            scatter_free_blocks(runner.pool)
        for batch in batches:
            sessions = filled_sessions(runner, ids, features, batch)
            paths[(f"runner {layout}", batch)] = runner_decode(runner, sessions, args.steps)
    step_s = {key: [] for key in paths}
    for _ in range(args.rounds):
        for key, run in paths.items():
            step_s[key].append(seconds(run) / args.steps)
    print(
        f"model {args.model_dir}: context {len(ids)} tokens, {args.steps} decode steps, median "
        f"of {args.rounds} interleaved rounds; torch threads {torch.get_num_threads()}"
    )
    print(f"{'path':<20}{'batch':>6}{'ms/step':>10}{'min..max':>14}{'tokens/s':>10}{'vs HF':>8}")
    hf_tokens_s = 1 / statistics.median(step_s[("HF DynamicCache", 1)])
    for (name, batch), times in step_s.items():
        step = statistics.median(times)
        spread = f"{min(times) * 1e3:.0f}..{max(times) * 1e3:.0f}"
        tokens_s = batch / step
        print(
            f"{name:<20}{batch:>6}{step * 1e3:>10.1f}{spread:>14}{tokens_s:>10.1f}"
            f"{tokens_s / hf_tokens_s:>8.2f}"
        )


if __name__ == "__main__":
    with torch.inference_mode():
        main()
