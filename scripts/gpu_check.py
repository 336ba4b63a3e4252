"""make gpu-check: the CUDA tests, then the engine's numbers on the true llava-1.5-7b shape.

    python -m scripts.gpu_check [--skip-tests] [--sessions 8 32 64] [--new-tokens 64]

Without CUDA it says so in one line and exits 0. With CUDA:

1. the CUDA tests (``pytest -m gpu``: fp32 token-exact answers, bf16 batched against alone
   within the stated tolerance, captured decode graphs against the eager step, the pool's
   allocator accounting);
2. the alternatives for one layer's decode attention in the 7B shape (scripts/bench_attention.py,
   bf16: flex paged, the old per-sequence loop, padded gather, varlen_attn over the block table);
3. two engine shards on the one GPU ("cuda:0,cuda:0", the serving path: ShardedEngine.from_config
   on the demo model): where N sessions were placed and each shard's tokens/s, both at once;
4. a table on a random-weight model built from tests/fixtures/llava-1.5-7b-hf's config (bf16,
   the real tokenizer, processor and chat template): decode graph capture (buckets, seconds,
   bytes), turn-10 time to first token with the session's KV against re-prefilling the whole
   conversation (the session demoted to its features: no vision tower, every token again),
   decode ms/token at 1 session, tokens/s at 8, 32, 64 sessions, and accounted bytes (weights +
   KV pool + graphs) against what the allocator reserved.

Targets (docs/design.md §GPU check): decode <= 9 ms/token at 1 session, >= 1,500 tokens/s at
32 sessions, turn-10 TTFT with KV >= 4x faster, reserved <= 1.05x accounted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

FIXTURE = REPO / "tests" / "fixtures" / "llava-1.5-7b-hf"
DEMO_MODEL = REPO / "models" / "demo-llava"
QUESTIONS = ["What is in the picture?", "Describe it in more detail.", "And the colours?"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--sessions", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--shard-sessions", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}); nothing to check")
        return 0
    print(f"gpu-check on {torch.cuda.get_device_name()} , torch {torch.__version__}", flush=True)
    failed = 0
    if not args.skip_tests:
        failed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu"]).returncode
    attention = [sys.executable, "-m", "scripts.bench_attention", "--dtype",
                 "bfloat16", "--heads", "32", "--kv-heads", "32", "--head-dim", "128"]  # fmt: skip
    subprocess.run(attention, check=True, cwd=REPO)
    index = torch.cuda.current_device()
    shard_table(f"cuda:{index},cuda:{index}", args.shard_sessions, args.new_tokens)
    with torch.inference_mode():
        engine_table(args.sessions, args.new_tokens)
    return failed


def shard_table(
    devices: str, sessions: int, new_tokens: int, session_budget_bytes: int | None = None
) -> None:
    """Engine shards on ``devices`` as a worker builds them (llava.shards): each session's
    placement, and each shard's tokens over the one wall clock of the run (they run at once).
    Runs on any device list; tests smoke it with "cpu,cpu"."""
    import gc

    from demo_model.synthetic import held_out_samples
    from llava.config import EngineConfig
    from llava.shards import ShardedEngine
    from scripts.bench_concurrency import sessions_at_once

    config = EngineConfig(
        model_dir=str(DEMO_MODEL), device=devices, session_budget_bytes=session_budget_bytes
    )
    sharded = ShardedEngine.from_config(config)
    try:
        sharded.warm_up()
        images = [s.image for s in held_out_samples(sessions, seed=81_000)]
        run = sessions_at_once(sharded, images, 2, new_tokens)
    finally:
        sharded.stop()
    print(f"\nengine shards on {devices} (demo model): {sessions} sessions at once, 2 turns of "
          f"{new_tokens} tokens; {run.tokens_per_s:.1f} tokens/s in all")  # fmt: skip
    print(f"{'shard':>5} {'device':>8} {'sessions':>8} {'tokens':>7} {'tokens/s':>9}")
    for index, engine in enumerate(sharded.shards):
        mine = [s for s in run.tokens_by_session if sharded.shard_of(s) == index]
        tokens = sum(run.tokens_by_session[s] for s in mine)
        print(f"{index:>5} {str(engine.loaded.device):>8} {len(mine):>8} {tokens:>7} "
              f"{tokens / run.wall_s:>9.1f}")  # fmt: skip
    del sharded
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the shards' pools go back before the 7B table sizes its own


def random_7b():
    """llava-1.5-7b's exact shape with random bf16 weights, on the GPU, as the engine loads."""
    from transformers import AutoProcessor, LlavaConfig, LlavaForConditionalGeneration

    from llava.imageprep import image_aspect_ratio
    from llava.model import LoadedModel, _eos_ids
    from llava.prompt import ChatPrompt

    config = LlavaConfig.from_pretrained(FIXTURE)
    device = torch.device("cuda")
    torch.set_default_dtype(torch.bfloat16)
    with device:
        model = LlavaForConditionalGeneration(config).eval()
    torch.set_default_dtype(torch.float32)
    processor = AutoProcessor.from_pretrained(FIXTURE)
    prompt = ChatPrompt(processor)
    return LoadedModel(
        model=model,
        processor=processor,
        prompt=prompt,
        device=device,
        dtype=torch.bfloat16,
        eos_token_ids=_eos_ids(model, processor.tokenizer),
        max_positions=config.text_config.max_position_embeddings,
        image_aspect_ratio=image_aspect_ratio(config),
    )


def engine_table(sessions: list[int], new_tokens: int) -> None:
    from demo_model.synthetic import held_out_samples
    from llava.config import EngineConfig
    from llava.engine import Engine, memory_budget
    from llava.memory import Tier
    from scripts.bench_concurrency import sessions_at_once

    start = time.perf_counter()
    loaded = random_7b()
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    print(f"\nrandom-weight llava-1.5-7b shape: {weights / 2**30:.2f} GiB of bf16 weights, "
          f"built in {time.perf_counter() - start:.0f} s")  # fmt: skip
    config = EngineConfig(model_dir=str(FIXTURE))  # the engine's own budget rule, as served
    engine = Engine(loaded, config, memory_budget(config, loaded.device), max_batch=max(sessions))
    engine.warm_up()
    graphs = engine.runner.graphs
    print(f"decode graphs: buckets {sorted(graphs.steps)} captured in {graphs.capture_s:.1f} s, "
          f"{graphs.reserved_bytes / 2**20:.0f} MiB reserved")  # fmt: skip
    images = [s.image for s in held_out_samples(max(sessions), seed=80_000)]
    forced = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}

    # turn 10 with the session's KV, then the same turn after demoting it (re-prefill)
    session = engine.open(images[0]).session_id
    for turn in range(9):
        engine.ask(session, QUESTIONS[turn % 3], {"max_new_tokens": 32, "min_new_tokens": 32})
    with_kv = engine.ask(session, QUESTIONS[0], forced)
    engine.memory.drop_kv(engine.store.session(session).holding)  # features and history stay
    again = engine.ask(session, QUESTIONS[0], forced)
    assert again.tier is Tier.FEATURES
    print(f"turn 10: TTFT {with_kv.ttft_s * 1e3:.1f} ms with KV ({with_kv.new_tokens} new, "
          f"{with_kv.cached_tokens} cached) vs {again.ttft_s * 1e3:.1f} ms re-prefilling "
          f"{again.new_tokens}: {again.ttft_s / with_kv.ttft_s:.1f}x")  # fmt: skip
    engine.close(session)

    one = engine.open(images[0]).session_id
    steps = []
    for _ in range(3):
        answer = engine.ask(one, QUESTIONS[1], {"max_new_tokens": 128, "min_new_tokens": 128})
        steps.append((answer.total_s - answer.ttft_s) / (len(answer.token_ids) - 1))
    engine.close(one)
    print(f"decode at 1 session: {statistics.median(steps) * 1e3:.2f} ms/token (median of 3)")

    print(f"{'sessions':>9} {'tokens/s':>9} {'TTFT p50 s':>11} {'turn p50 s':>11}")
    for n in sessions:
        run = sessions_at_once(engine, images[:n], 2, new_tokens)
        print(f"{n:>9} {run.tokens_per_s:>9.1f} {statistics.median(run.ttft_s):>11.3f} "
              f"{statistics.median(run.turn_s):>11.3f}")  # fmt: skip

    pool = engine.memory.pool
    accounted = weights + pool.allocated_bytes + graphs.reserved_bytes
    reserved = torch.cuda.memory_reserved()
    print(f"memory: accounted {accounted / 2**30:.2f} GiB (weights + KV pool "
          f"{pool.allocated_bytes / 2**30:.2f} + graphs), allocator reserved "
          f"{reserved / 2**30:.2f} GiB: {reserved / accounted:.3f}x")  # fmt: skip
    engine.stop()


if __name__ == "__main__":
    sys.exit(main())
