"""Per-turn latency of four ways to serve a multi-turn image chat.

Modes, for the same conversation (the KV session's own prompts are replayed by the others,
so every mode prefills exactly the same tokens and generates the same number):
  stateless  image re-sent: processor + vision tower + whole conversation prefilled
  pixels     pixel values cached (the reference AWS sample): vision tower + whole prefill
  features   image features cached (our warm tier): whole conversation prefilled
  kv         KV cache reused (our hot tier): only the new turn prefilled

Prints a table of median time-to-first-token and turn latency per turn, bytes held per
session per mode, and writes a PNG plot. Runs on an untrained realistic-shape model, built
into build/ if missing (demo_model/build.py): ``--config realistic`` (the default: 576 image
tokens, as LLaVA-1.5) or ``--config realistic-next`` (LLaVA-NeXT anyres with a Mistral GQA LM:
the image resized to 672x672, so 2,928 image tokens, as llava-v1.6-mistral-7b-hf gives a
square image).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.exec.runner import StepInput
from llava.model.vision import vision_inputs

REPO = Path(__file__).resolve().parents[2]
MODES = ("stateless", "pixels", "features", "kv")
QUESTIONS = ["What color is the shape?", "And its shape?", "Say that again."]
TOKEN_ID_BYTES = 8  # a cached history as int64 ids


@dataclass(frozen=True)
class BenchShape:
    """One demo_model.build --config this bench runs on."""

    model_dir: str  # under build/
    target: float  # the last turn's kv TTFT speedup over stateless to reach on CPU
    side: int | None  # the image resized to side x side px (None: as drawn, 84 px)
    plot: str  # under build/


SHAPES = {
    "realistic": BenchShape("realistic-llava", 5.0, None, "bench_turns.png"),
    # A square image at a pinpoint: 4 tiles + the global view, 2,928 image tokens.
    "realistic-next": BenchShape("realistic-llava-next", 20.0, 672, "bench_turns_next.png"),
}


def ensure_model(model_dir: Path, config: str = "realistic") -> None:
    """Build the demo model's ``config`` shape into ``model_dir`` unless it is there."""
    if not (model_dir / "config.json").exists():
        cmd = [sys.executable, "-m", "demo_model.build", "--config", config]
        subprocess.run([*cmd, "--out", str(model_dir)], check=True, cwd=REPO)


def kv_conversation(engine: Engine, image, turns: int, params: dict):
    """Run the real session; return per-turn (ttft, total) and the prompt ids of each turn."""
    session_id = engine.open(image).session_id
    timings, prompts = [], []
    for turn in range(turns):
        answer = engine.ask(session_id, QUESTIONS[turn % len(QUESTIONS)], params)
        history = engine.store.session(session_id).token_ids
        prompts.append(history[: answer.cached_tokens + answer.new_tokens])
        timings.append((answer.ttft_s, answer.total_s))
    held = engine.session_bytes(session_id)
    engine.close(session_id)
    return timings, prompts, held


def answer_from_scratch(engine: Engine, prompt, features, new_tokens: int):
    """Greedy answer to ``prompt`` on an empty KV (in the engine's loop thread, which owns
    the model); returns (time to first token, total)."""

    def run():
        holding = engine.memory.hold()
        assert engine.memory.start(holding, len(prompt) + new_tokens) is None
        kv = holding.kv
        try:
            start = time.perf_counter()
            logits = engine.runner.step([StepInput(kv, prompt, features)])
            first = time.perf_counter() - start
            for _ in range(new_tokens - 1):
                logits = engine.runner.step([StepInput(kv, [int(logits[0].argmax())])])
            return first, time.perf_counter() - start
        finally:
            engine.memory.release(holding)

    return engine.loop.call(run)


def replay(engine: Engine, mode: str, image, prompts, new_tokens: int):
    """Answer each recorded prompt from scratch, redoing what ``mode`` does not cache."""
    loaded = engine.loaded

    def preprocess():  # as the engine's open does (llava.model.vision)
        return vision_inputs(image, loaded.processor.image_processor, loaded.image_aspect_ratio)

    pixels = preprocess()
    features = engine.encode_image(pixels)
    timings = []
    for prompt in prompts:
        start = time.perf_counter()
        if mode == "stateless":
            pixels = preprocess()
        if mode in ("stateless", "pixels"):
            features = engine.encode_image(pixels)
        setup = time.perf_counter() - start
        first, total = answer_from_scratch(engine, prompt, features, new_tokens)
        timings.append((setup + first, setup + total))
    if mode == "stateless":
        return timings, 0  # the client re-sends image and conversation every turn
    cached = sum(t.nbytes for t in pixels.values()) if mode == "pixels" else features.nbytes
    return timings, cached + TOKEN_ID_BYTES * len(prompts[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="realistic", choices=sorted(SHAPES))
    parser.add_argument("--model-dir", type=Path, help="default: build/<the config's dir>")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--target", type=float, help="kv speedup to reach (default: the config's)")
    parser.add_argument("--plot", type=Path, help="default: build/<the config's plot>")
    args = parser.parse_args()
    shape = SHAPES[args.config]
    args.model_dir = args.model_dir or REPO / "build" / shape.model_dir
    args.plot = args.plot or REPO / "build" / shape.plot
    args.target = args.target or shape.target
    torch.manual_seed(0)
    ensure_model(args.model_dir, args.config)
    engine = Engine.from_config(EngineConfig(model_dir=str(args.model_dir)))
    image = held_out_samples(1)[0].image
    if shape.side:
        image = image.resize((shape.side, shape.side), Image.Resampling.BICUBIC)
    wire = {"max_new_tokens": args.new_tokens}
    kv_conversation(engine, image, 2, wire)  # warm-up: first calls allocate and compile
    runs: dict[str, list] = {mode: [] for mode in MODES}
    held: dict[str, int] = {}
    for _ in range(args.runs):
        timings, prompts, held["kv"] = kv_conversation(engine, image, args.turns, wire)
        runs["kv"].append(timings)
        for mode in MODES[:-1]:
            timings, held[mode] = replay(engine, mode, image, prompts, args.new_tokens)
            runs[mode].append(timings)
    ttft = {
        m: [statistics.median(r[t][0] for r in runs[m]) for t in range(args.turns)] for m in MODES
    }
    total = {
        m: [statistics.median(r[t][1] for r in runs[m]) for t in range(args.turns)] for m in MODES
    }
    report(args, engine, image, prompts, ttft, total, held)
    plot(args.plot, ttft)


def report(args, engine, image, prompts, ttft, total, held) -> None:
    model = engine.loaded.model
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model {args.model_dir.name}: {params / 1e6:.1f} M parameters, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {engine.loaded.device}"
    )
    image_tokens = prompts[0].count(engine.loaded.prompt.image_token_id)
    print(f"image {image.width}x{image.height} px: {image_tokens:,} image tokens")
    print(
        f"median of {args.runs} runs, {args.new_tokens} new tokens per answer; "
        f"turn-{args.turns} prompt = {len(prompts[-1])} tokens\n"
    )
    print("time to first token (ms)")
    print("turn | " + " | ".join(f"{m:>9}" for m in MODES))
    for turn in range(args.turns):
        print(f"{turn + 1:>4} | " + " | ".join(f"{ttft[m][turn] * 1000:9.1f}" for m in MODES))
    print("\nturn latency (ms)")
    print("turn | " + " | ".join(f"{m:>9}" for m in MODES))
    for turn in range(args.turns):
        print(f"{turn + 1:>4} | " + " | ".join(f"{total[m][turn] * 1000:9.1f}" for m in MODES))
    print("\nbytes held per session after the last turn")
    for mode in MODES:
        print(f"  {mode:>9}: {held[mode]:>12,}")
    last = args.turns - 1
    speedup = ttft["stateless"][last] / ttft["kv"][last]
    line = (
        f"\nturn {args.turns}: kv TTFT is {speedup:.1f}x faster than stateless "
        f"(target >= {args.target:g}x)"
    )
    if args.turns > 1:
        drift = ttft["kv"][last] / ttft["kv"][1]
        line += f"; {drift:.2f}x its own turn 2 (target <= 1.3x)"
    print(line)


def plot(path: Path, ttft) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in MODES:
        ax.plot(range(1, len(ttft[mode]) + 1), [t * 1000 for t in ttft[mode]], "o-", label=mode)
    ax.set(xlabel="turn", ylabel="time to first token (ms)", title="Per-turn TTFT by cache mode")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
