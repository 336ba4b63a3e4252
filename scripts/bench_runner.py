"""Decode-step throughput of the packed step runner against Hugging Face's forward.

    python scripts/bench_runner.py [--model-dir build/realistic-llava] [--context 600]
                                   [--batches 1,4,8,32] [--steps 8] [--repeats 3]

Every sequence holds ``--context`` tokens (an image opening of 576 image tokens plus text) in
the KV pool; one decode step then appends one token to each. Rows: the runner at each batch
size, and ``model(ids, past_key_values=DynamicCache)`` at batch 1 (the engine's path before
the runner). ``gather ms`` is the part of a step spent copying each sequence's K/V out of its
blocks (index_select per layer), measured alone on the same slots. Best of ``--repeats``.
Runs on the untrained realistic-shape model, built into build/ if missing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llava.decoding import prefill  # noqa: E402
from llava.kv_pool import KVPool, SessionKV, kv_bytes_per_token  # noqa: E402
from llava.model import load_model  # noqa: E402
from llava.runner import Runner, StepInput  # noqa: E402
from scripts.bench_turns import ensure_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def context_ids(loaded, context: int) -> tuple[list[int], torch.Tensor]:
    """An image opening (random features) padded with ordinary words to ``context`` tokens."""
    config = loaded.model.config
    image_tokens = config.image_seq_length
    opening = loaded.prompt.opening_ids(True, image_tokens)
    words = list(range(10, 10 + context - len(opening)))
    features = torch.randn(image_tokens, config.text_config.hidden_size, dtype=loaded.dtype)
    return opening + words, features


def filled_sessions(runner: Runner, ids, features, count: int) -> list[SessionKV]:
    """``count`` sessions holding the same prefilled context: prefilled once, blocks copied."""
    pool = runner.pool
    first = pool.new_kv()
    first.reserve(len(ids))
    runner.step([StepInput(first, ids, features)])
    sessions = [first]
    for _ in range(count - 1):
        kv = pool.new_kv()
        kv.reserve(len(ids))
        pool.kv[:, :, :, kv.slots(0, len(ids))] = pool.kv[:, :, :, first.slots(0, len(ids))]
        kv.length = len(ids)
        sessions.append(kv)
    return sessions


def best_of(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def runner_decode_s(runner: Runner, sessions: list[SessionKV], steps: int, repeats: int) -> float:
    """Seconds per decode step of all ``sessions`` together (KV cropped back between repeats)."""
    length = sessions[0].length

    def run():
        for kv in sessions:
            kv.crop(length)
            kv.reserve(steps)
        for step in range(steps):
            runner.step([StepInput(kv, [20 + step], None) for kv in sessions])

    return best_of(repeats, run) / steps


def gather_s(runner: Runner, sessions: list[SessionKV]) -> float:
    """Seconds one step spends gathering every session's K/V from its blocks, all layers."""
    slots = [kv.slots(0, kv.length) for kv in sessions]

    def run():
        for layer in runner.pool.kv:
            for kv_slots in slots:
                layer[0].index_select(1, kv_slots)
                layer[1].index_select(1, kv_slots)

    return best_of(3, run)


def hf_decode_s(loaded, ids, features, steps: int, repeats: int) -> float:
    cache = DynamicCache()
    prefill(loaded.model, ids, cache, features)

    def run():
        cache.crop(len(ids) - cache.get_seq_length())  # transformers 5: minus the count to drop
        for step in range(steps):
            prefill(loaded.model, [20 + step], cache)

    return best_of(repeats, run) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(REPO / "build" / "realistic-llava"))
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--batches", default="1,4,8,32")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ensure_model(Path(args.model_dir))
    loaded = load_model(args.model_dir, device="cpu", dtype="float32")
    batches = [int(b) for b in args.batches.split(",")]
    ids, features = context_ids(loaded, args.context)
    text = loaded.model.config.text_config
    pool_tokens = max(batches) * (args.context + args.steps + 16)
    budget = pool_tokens * kv_bytes_per_token(text, loaded.dtype)
    pool = KVPool(text, budget, loaded.device, loaded.dtype)
    runner = Runner(loaded.model, pool)
    print(f"model {args.model_dir}: context {len(ids)} tokens, {args.steps} decode steps, "
          f"best of {args.repeats}; torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'path':<16}{'batch':>6}{'ms/step':>10}{'tokens/s':>10}{'gather ms':>11}{'vs HF':>8}")
    hf = hf_decode_s(loaded, ids, features, args.steps, args.repeats)
    print(f"{'HF DynamicCache':<16}{1:>6}{hf * 1e3:>10.1f}{1 / hf:>10.1f}{'':>11}{1.0:>8.2f}")
    for batch in batches:
        sessions = filled_sessions(runner, ids, features, batch)
        step = runner_decode_s(runner, sessions, args.steps, args.repeats)
        gather = gather_s(runner, sessions)
        speedup = batch / step * hf
        print(f"{'runner':<16}{batch:>6}{step * 1e3:>10.1f}{batch / step:>10.1f}"
              f"{gather * 1e3:>11.1f}{speedup:>8.2f}")  # fmt: skip
        for kv in sessions:
            kv.free()


if __name__ == "__main__":
    with torch.inference_mode():
        main()
