"""Many sessions at once: total tokens/s, TTFT and turn latency, batched vs one at a time.

N sessions (default 1, 4, 8, 32), each opened on its own image, then 5 turns of 32 generated
tokens, every session in its own client thread, all starting together. The same run measures
the same engine with ``max_batch=1`` (one request at a time, FIFO) for contrast, and mixed
against alternating prefill/decode steps at N = 8. Then: a short turn arriving while another
session streams a 200-token answer — how many of that answer's decode steps pass before the
short turn's first token. Runs on the untrained "realistic-shape" model (576 image tokens,
768 hidden, 6 layers), built into build/ if missing; the answers are forced to their full
length (min_new_tokens), since an untrained model ends them at random.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.budget import MemoryBudget
from llava.kv.holding import Tier
from llava.model.loading import load_model
from scripts.bench.turns import ensure_model

REPO = Path(__file__).resolve().parents[2]

QUESTIONS = ["What color is the shape?", "And its shape?", "Say that again."]


@dataclass
class Run:
    tokens: int
    wall_s: float
    ttft_s: list[float]
    turn_s: list[float]
    cut_by_deadline: int
    cpu_s: float  # process CPU time (all threads): steadier than wall time on a shared machine
    tokens_by_session: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def sessions_at_once(engine: Engine, images, turns: int, new_tokens: int) -> Run:
    """Every session opens, then all ask their turns together; the clock covers the turns."""
    params = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    ids = [None] * len(images)
    ttft, turn_s, tokens, errors, by_session = [], [], [], [], {}
    opened = threading.Barrier(len(images) + 1)
    done = threading.Barrier(len(images) + 1)

    def client(i: int) -> None:
        try:
            ids[i] = engine.open(images[i]).session_id
            opened.wait()
            for turn in range(turns):
                answer = engine.ask(ids[i], QUESTIONS[turn % len(QUESTIONS)], params)
                ttft.append(answer.ttft_s)
                turn_s.append(answer.total_s)
                tokens.append((len(answer.token_ids), answer.stop_reason))
                by_session[ids[i]] = by_session.get(ids[i], 0) + len(answer.token_ids)
        except BaseException as error:  # reported below: a bench must not hang on a failure
            errors.append(error)
            opened.abort()
        finally:
            done.wait()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(images))]
    for thread in threads:
        thread.start()
    opened.wait()
    start, cpu_start = time.perf_counter(), time.process_time()
    done.wait()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if errors:
        raise errors[0]
    for session_id in ids:
        engine.close(session_id)
    cut = sum(reason == "deadline" for _, reason in tokens)
    return Run(sum(n for n, _ in tokens), wall, ttft, turn_s, cut, cpu, by_session)


def steps_until_first_token(engine: Engine, images, long_tokens: int, after: int) -> int:
    """A session streams ``long_tokens``; after its ``after``-th token another (hot) session
    asks a short turn. Returns the steps the loop ran from that ask to its first token (1: the
    very next step), each of which was also a decode step of the long answer."""
    streaming, arriving = (engine.open(image).session_id for image in images[:2])
    long_count = 0
    seen: dict[str, int] = {}
    started = threading.Event()

    def on_long(_text, _token_id):
        nonlocal long_count
        long_count += 1
        if long_count == after:
            started.set()

    def on_short(_text, _token_id):
        seen.setdefault("first", engine.loop.steps)

    params = {"max_new_tokens": long_tokens, "min_new_tokens": long_tokens}
    thread = threading.Thread(
        target=engine.ask, args=(streaming, QUESTIONS[0], params, on_long), daemon=True
    )
    thread.start()
    started.wait(timeout=300)
    at_arrival = engine.loop.steps
    engine.ask(arriving, QUESTIONS[1], {"max_new_tokens": 4, "min_new_tokens": 4}, on_short)
    thread.join(timeout=600)
    for session_id in (streaming, arriving):
        engine.close(session_id)
    return seen["first"] - at_arrival


def pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=REPO / "build" / "realistic-llava")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--turns-at-32", type=int, default=2, help="fewer turns at N >= 32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    torch.manual_seed(0)
    ensure_model(args.model_dir)
    loaded = load_model(str(args.model_dir), args.device)
    config = EngineConfig(model_dir=str(args.model_dir))

    def engine(**knobs) -> Engine:
        built = Engine(loaded, dataclasses.replace(config, **knobs), MemoryBudget(4 << 30))
        built.warm_up()
        return built

    engines = {
        "batched": engine(max_batch=64),
        "one-at-a-time": engine(max_batch=1),
        "alternating": engine(max_batch=64, mixed_steps=False),
    }
    images = [s.image for s in held_out_samples(max(args.sessions), seed=80_000)]
    params = sum(p.numel() for p in loaded.model.parameters())
    print(
        f"model {args.model_dir.name}: {params / 1e6:.1f} M parameters, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {loaded.device}; "
        f"{args.new_tokens} new tokens per turn\n"
    )
    print(
        f"{'N':>3} {'turns':>5} {'mode':>14} {'tokens/s':>9} {'speedup':>8} {'tok/cpu-s':>9} "
        f"{'TTFT p50':>9} {'TTFT p95':>9} {'turn p50':>9} {'turn p95':>9}  (seconds)"
    )
    for n in args.sessions:
        turns = args.turns if n < 32 else args.turns_at_32
        modes = ["batched", "one-at-a-time"] + (["alternating"] if n == 8 else [])
        runs = {m: sessions_at_once(engines[m], images[:n], turns, args.new_tokens) for m in modes}
        alone = runs["one-at-a-time"].tokens_per_s
        for mode, run in runs.items():
            print(
                f"{n:>3} {turns:>5} {mode:>14} {run.tokens_per_s:>9.1f} "
                f"{run.tokens_per_s / alone:>7.2f}x {run.tokens / run.cpu_s:>9.1f} "
                f"{pct(run.ttft_s, 50):>9.3f} "
                f"{pct(run.ttft_s, 95):>9.3f} {pct(run.turn_s, 50):>9.3f} "
                f"{pct(run.turn_s, 95):>9.3f}"
                + (f"  {run.cut_by_deadline} cut by the deadline" if run.cut_by_deadline else "")
            )
    print("\nshort turn arriving while another session streams 200 tokens:")
    for mode in ("batched", "alternating"):
        steps = steps_until_first_token(engines[mode], images, long_tokens=200, after=20)
        print(f"  {mode:>12}: its first token came out of step {steps} after its arrival")
    memory(engines["batched"], images)
    for built in engines.values():
        built.stop()


def memory(engine: Engine, images) -> None:
    """Accounted bytes (KV and features) against what the pool's allocation holds, with 8
    sessions open."""
    ids = [engine.open(image).session_id for image in images[:8]]
    for session_id in ids:
        engine.ask(session_id, QUESTIONS[0], {"max_new_tokens": 8})
    pool, budget = engine.memory.pool, engine.memory.budget.device_bytes
    by_tier = engine.stats().bytes_by_tier
    accounted = by_tier[Tier.KV] + by_tier[Tier.FEATURES]
    held = (pool.total_blocks - pool.free_blocks) * pool.bytes_per_block
    print(
        f"\nmemory: budget {budget:,} B, pool allocated "
        f"{pool.allocated_bytes:,} B ({pool.allocated_bytes / budget:.4f} of "
        f"the budget, allocated once); 8 sessions hold {accounted:,} B accounted = "
        f"{held:,} B of blocks handed out"
    )
    for session_id in ids:
        engine.close(session_id)


if __name__ == "__main__":
    main()
