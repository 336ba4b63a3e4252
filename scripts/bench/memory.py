"""Session memory across tiers: what a turn costs where the session's memory was,
how many sessions each tier holds, and accounted bytes against real ones.

1. Turn latency when the session's KV is on the device, copied back from the host,
   recomputed from its image features, or the session was parked (its features read back
   from the persistent tier, under /dev/shm here, then the same recompute), at histories of
   about 600, 2,000 and 8,000 tokens
   (the untrained realistic-shape model of scripts/bench/turns.py, 576 image tokens, its
   position limit raised to 8,704 for the long history: rotary positions have no weights).
2. Sessions held per tier for a fixed device and host budget: LLaVA-1.5-7B by arithmetic
   from llava.kv.memory's accounting functions, the CPU model's the same way and measured.
3. Accounted bytes per tier against the pool's allocation (device) and the process's RSS
   growth (host).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

import torch

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.budget import MemoryBudget, session_feature_bytes, session_kv_bytes
from llava.kv.holding import Tier
from llava.kv.pool import BLOCK_TOKENS, kv_bytes_per_token
from llava.model.loading import load_model
from scripts.bench.persist import scratch_dir
from scripts.bench.turns import ensure_model

REPO = Path(__file__).resolve().parents[2]

MiB, GiB = 1 << 20, 1 << 30
FILLER = "What color is the shape? "  # 6 tokens of the realistic tokenizer
QUESTION = "And its shape?"


def unshared_config(**settings) -> EngineConfig:
    """Every engine here shares nothing (prefix_sharing off): a recompute computes the whole
    history and each session holds its own image and prefix, as sessions on different images
    do (what sharing saves: scripts/bench/prefix.py)."""
    return EngineConfig("-", max_question_chars=100_000, prefix_sharing="off", **settings)


DEADLINE_S = 59.0  # the longest turn_deadline_s allowed (SageMaker's 60 s limit)


def long_context_model(model_dir: Path, positions: int) -> Path:
    """The realistic model with a higher position limit (same weights, linked)."""
    target = model_dir.parent / f"{model_dir.name}-{positions}"
    target.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        link = target / item.name
        if item.name != "config.json" and not link.exists():
            link.symlink_to(item.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = positions
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def grown_session(engine: Engine, image, history: int) -> str:
    """A session whose history is about ``history`` tokens: the opening, then long questions
    (prefill only; at most ~1,500 tokens a turn, so none nears the turn deadline)."""
    session_id = engine.open(image).session_id
    while (have := len(engine.store.session(session_id).token_ids)) < history - 6:
        words = max(1, min(250, (history - have) // 6))
        answer = engine.ask(session_id, FILLER * words + QUESTION, {"max_new_tokens": 1})
        assert answer.stop_reason != "deadline", "growing the history hit the turn deadline"
    return session_id


def turn_latency(engine: Engine, session_id: str, tier: Tier, new_tokens: int):
    """One turn with the session's memory moved to ``tier`` first: (ttft, total, tier seen)."""
    holding = engine.store.session(session_id).holding
    while holding.tier is not tier:
        engine.memory.move_down(holding)
    answer = engine.ask(session_id, QUESTION, {"max_new_tokens": new_tokens})
    if answer.stop_reason == "deadline":  # cut: its time is a lower bound, not a latency
        return float("inf"), float("inf"), answer.tier
    return answer.ttft_s, answer.total_s, answer.tier


def latency_table(engine: Engine, image, histories, runs: int, new_tokens: int) -> None:
    print(
        f"\n1. turn latency by where the session's KV was (median of {runs}; "
        f"{new_tokens} new tokens; ms; inf: the turn passed the {DEADLINE_S:.0f} s turn deadline)"
    )
    print(
        f"{'history':>8} | {'device TTFT':>11} | {'host TTFT':>10} | {'features TTFT':>13} | "
        f"{'parked TTFT':>11} | {'host vs features':>16} | {'device total':>12} | "
        f"{'host total':>10} | {'features total':>14} | {'parked total':>12}"
    )
    for history in histories:
        session_id = grown_session(engine, image, history)
        held = len(engine.store.session(session_id).token_ids)
        seen = {tier: [] for tier in Tier}
        for _ in range(runs):
            for tier in (Tier.KV, Tier.HOST, Tier.FEATURES, Tier.PERSISTED):
                ttft, total, found = turn_latency(engine, session_id, tier, new_tokens)
                assert found is tier, (found, tier)
                seen[tier].append((ttft, total))
        ttft = {t: statistics.median(x[0] for x in v) * 1000 for t, v in seen.items() if v}
        total = {t: statistics.median(x[1] for x in v) * 1000 for t, v in seen.items() if v}
        ratio = ttft[Tier.FEATURES] / ttft[Tier.HOST]  # inf: recompute passed the deadline
        print(
            f"{held:>8,} | {ttft[Tier.KV]:>11.1f} | {ttft[Tier.HOST]:>10.1f} | "
            f"{ttft[Tier.FEATURES]:>13.1f} | {ttft[Tier.PERSISTED]:>11.1f} | {ratio:>15.1f}x | "
            f"{total[Tier.KV]:>12.1f} | {total[Tier.HOST]:>10.1f} | "
            f"{total[Tier.FEATURES]:>14.1f} | {total[Tier.PERSISTED]:>12.1f}"
        )
        engine.close(session_id)


def per_session(bytes_per_token: int, image_tokens: int, hidden: int, element: int, history):
    block = BLOCK_TOKENS * bytes_per_token
    kv = session_kv_bytes(history, bytes_per_token, BLOCK_TOKENS)
    features = session_feature_bytes(image_tokens, hidden, element, block)
    return kv, features


def capacity_row(name: str, kv: int, features: int, budget: MemoryBudget) -> None:
    on_device = budget.device_bytes // (kv + features)
    on_host = min(budget.host_bytes // kv, budget.device_bytes // features)  # + its features
    features_only = budget.device_bytes // features
    print(
        f"{name:>36} | {kv / MiB:>8.1f} | {features / MiB:>8.2f} | {on_device:>9,} | "
        f"{on_host:>9,} | {features_only:>13,}"
    )


def capacity_table(loaded, image, budgets: dict[int, MemoryBudget]) -> None:
    print(
        "\n2. sessions each tier can hold (every session in that tier; a host-tier session "
        "keeps its features on the device)"
    )
    print(
        f"{'model, history, device / host budget':>36} | {'KV MiB':>8} | {'feat MiB':>8} | "
        f"{'device KV':>9} | {'host KV':>9} | {'features only':>13}"
    )
    for history, budget in budgets.items():
        # LLaVA-1.5-7B: 32 layers x 32 KV heads x 128, fp16; 576 image tokens of 4096
        seven_b = per_session(32 * 2 * 32 * 128 * 2, 576, 4096, 2, history)
        name = f"7B, {history:,} t, {budget.device_bytes // GiB} / {budget.host_bytes // GiB} GiB"
        capacity_row(name, *seven_b, MemoryBudget(budget.device_bytes, budget.host_bytes))
    history, budget = 600, MemoryBudget(device_bytes=64 * MiB, host_bytes=128 * MiB)
    text = loaded.model.config.text_config
    element = torch.empty((), dtype=loaded.dtype).element_size()
    cpu = per_session(
        kv_bytes_per_token(text, loaded.dtype), 576, text.hidden_size, element, history
    )
    name = f"CPU model, {history} t, 64 / 128 MiB"
    capacity_row(name + ", arith.", *cpu, budget)
    held = measured_capacity(loaded, image, history, budget)
    print(
        f"{name + ', measured':>36} | {'':>8} | {'':>8} | {held[Tier.KV]:>9,} | "
        f"{held[Tier.HOST]:>9,} | {held[Tier.FEATURES]:>13,}"
    )


def measured_capacity(loaded, image, history: int, budget: MemoryBudget) -> dict:
    """Open sessions of ``history`` tokens until the first eviction: the most sessions seen
    at each tier at once; under features only, every session held just before the eviction
    (the newest then still holds its device KV, so it is (device - one KV) / features)."""
    engine = Engine(loaded, unshared_config(), budget)
    most = dict.fromkeys(Tier, 0)
    try:
        while True:
            grown_session(engine, image, history)
            stats = engine.stats()
            if stats.memory.evicted:
                return most
            for tier in (Tier.KV, Tier.HOST):
                most[tier] = max(most[tier], stats.sessions_by_tier[tier])
            most[Tier.FEATURES] = stats.sessions
    finally:
        engine.stop()


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def accounted_table(loaded, image, history: int, sessions: int) -> None:
    budget = MemoryBudget(device_bytes=2 * GiB, host_bytes=2 * GiB)
    engine = Engine(loaded, unshared_config(), budget)
    try:
        ids = [grown_session(engine, image, history) for _ in range(sessions)]
        pool = engine.memory.pool
        stats = engine.stats()
        device = stats.bytes_by_tier[Tier.KV] + stats.bytes_by_tier[Tier.FEATURES]
        handed_out = (pool.total_blocks - pool.free_blocks) * pool.bytes_per_block
        rss = rss_bytes()
        for session_id in ids:
            engine.memory.move_down(engine.store.session(session_id).holding)
        host = engine.stats().bytes_by_tier[Tier.HOST]
        grown = rss_bytes() - rss
    finally:
        engine.stop()
    print(f"\n3. accounted vs actual bytes ({sessions} sessions of {history:,} tokens)")
    print(f"{'tier':>8} | {'accounted':>14} | {'actual':>14} | {'actual / accounted':>18}")
    print(
        f"{'device':>8} | {device:>14,} | {handed_out:>14,} | {handed_out / device:>18.4f}"
        "   (actual: pool blocks handed out)"
    )
    print(
        f"{'':>8} | {budget.device_bytes:>14,} | {pool.allocated_bytes:>14,} | "
        f"{pool.allocated_bytes / budget.device_bytes:>18.4f}   (budget vs the pool's storage)"
    )
    print(
        f"{'host':>8} | {host:>14,} | {grown:>14,} | {grown / host:>18.4f}"
        "   (actual: the process's RSS growth)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=REPO / "build" / "realistic-llava")
    parser.add_argument("--histories", type=int, nargs="+", default=[600, 2000, 8000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ensure_model(args.model_dir)
    model_dir = long_context_model(args.model_dir, max(*args.histories, 2000) + 704)
    loaded = load_model(str(model_dir))
    budget = MemoryBudget(device_bytes=4 * GiB, host_bytes=4 * GiB)
    persist_dir = scratch_dir()  # the parked rung reads features back from here
    config = unshared_config(turn_deadline_s=DEADLINE_S, persist_dir=persist_dir)
    engine = Engine(loaded, config, budget)
    image = held_out_samples(1)[0].image
    engine.ask(grown_session(engine, image, 700), QUESTION)  # warm-up
    params = sum(p.numel() for p in loaded.model.parameters())
    print(
        f"model {args.model_dir.name} ({params / 1e6:.1f} M parameters, {loaded.dtype}), "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {loaded.device}"
    )
    latency_table(engine, image, args.histories, args.runs, args.new_tokens)
    engine.stop()
    shutil.rmtree(persist_dir, ignore_errors=True)
    capacity_table(
        loaded,
        image,
        {
            2000: MemoryBudget(device_bytes=40 * GiB, host_bytes=200 * GiB),
            8000: MemoryBudget(device_bytes=40 * GiB, host_bytes=200 * GiB),
        },
    )
    accounted_table(loaded, image, 2000, 8)


if __name__ == "__main__":
    main()
