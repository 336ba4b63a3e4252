"""Decode-step throughput of the packed step runner against Hugging Face's forward.

    python scripts/bench_runner.py [--model-dir build/realistic-llava] [--context 600]
                                   [--batches 1,4,8,32] [--steps 8] [--rounds 5] [--threads N]

Every sequence holds ``--context`` tokens (an image opening of 576 image tokens plus text) in
the KV pool; one decode step then appends one token to each. Rows: the runner at each batch
size, and ``model(ids, past_key_values=DynamicCache)`` at batch 1 (the engine's path before
the runner). ``gather ms`` is the part of a step spent copying each sequence's K/V out of its
blocks (index_select per layer), measured alone on the same slots. Medians of ``--rounds``
rounds that interleave all paths (other processes' load hits every path alike).
Runs on the untrained realistic-shape model, built into build/ if missing.
"""

from __future__ import annotations

import argparse
import statistics
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


def gather(runner: Runner, sessions: list[SessionKV]):
    """What one step spends gathering every session's K/V from its blocks, all layers."""
    slots = [kv.slots(0, kv.length) for kv in sessions]

    def run():
        for layer in runner.pool.kv:
            for kv_slots in slots:
                layer[0].index_select(1, kv_slots)
                layer[1].index_select(1, kv_slots)

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
    pool_tokens = sum(batches) * (args.context + args.steps + 16)
    budget = pool_tokens * kv_bytes_per_token(text, loaded.dtype)
    runner = Runner(loaded.model, KVPool(text, budget, loaded.device, loaded.dtype))
    groups = {batch: filled_sessions(runner, ids, features, batch) for batch in batches}
    # Rounds interleave every path, so load from other processes hits them alike.
    paths = {("HF DynamicCache", 1): hf_decode(loaded, ids, features, args.steps)}
    paths.update({("runner", b): runner_decode(runner, groups[b], args.steps) for b in batches})
    step_s = {key: [] for key in paths}
    gather_s = {batch: [] for batch in batches}
    for _ in range(args.rounds):
        for key, run in paths.items():
            step_s[key].append(seconds(run) / args.steps)
        for batch in batches:
            gather_s[batch].append(seconds(gather(runner, groups[batch])))
    print(
        f"model {args.model_dir}: context {len(ids)} tokens, {args.steps} decode steps, median "
        f"of {args.rounds} interleaved rounds; torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'path':<16}{'batch':>6}{'ms/step':>10}{'min..max':>16}{'tokens/s':>10}"
        f"{'gather ms':>11}{'vs HF':>8}"
    )
    hf_tokens_s = 1 / statistics.median(step_s[("HF DynamicCache", 1)])
    for (name, batch), times in step_s.items():
        step = statistics.median(times)
        spread = f"{min(times) * 1e3:.0f}..{max(times) * 1e3:.0f}"
        gathered = f"{statistics.median(gather_s[batch]) * 1e3:.1f}" if name == "runner" else ""
        tokens_s = batch / step
        print(
            f"{name:<16}{batch:>6}{step * 1e3:>10.1f}{spread:>16}{tokens_s:>10.1f}"
            f"{gathered:>11}{tokens_s / hf_tokens_s:>8.2f}"
        )


if __name__ == "__main__":
    with torch.inference_mode():
        main()
