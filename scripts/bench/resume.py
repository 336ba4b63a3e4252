"""A session whose instance went: the time until its next answer on another instance, three ways.

    python -m scripts.bench.resume [--shape llava-1.5] [--rounds 3] [--turns 10]
                                   [--new-tokens 16]

Instance A (an engine with its own persistent-tier directory) holds a conversation of
``--turns`` turns on one image, writes it to the durable store (a directory both instances
share, as EFS would be; ``flush_durable``), and goes (stopped, its directory deleted). The
next question is then answered on instance B, a fresh engine on another directory that holds
nothing, three ways, each timed on the caller's clock from the start of the recovery:

  resume      ``B.resume(old_id)`` reads the record and the image's features from the store,
              then ``B.ask(new_id, question)`` prefills the whole history from those features
              (no vision tower) and answers
  replay      what ``LlavaClient(recover="replay")`` does: a new session on the same image
              (the vision tower again), every earlier question asked again (every earlier
              answer decoded again), then the question
  fresh open  a new session on the image and the question alone: a lower bound that loses
              the conversation

Every way decodes ``--new-tokens`` tokens an answer, greedy. Each way's answer is compared,
token for token, with the same question's answer in an uninterrupted session (a twin on A).
Also printed: the resume's two parts (the resume call; the next turn's time to first token)
and the bytes the durable store holds for the session (its record; its image's features,
written once for every session on that image).

Shapes (untrained models of the real image geometry):
  llava-1.5  build/realistic-llava (built if missing): 336 px, 576 image tokens an image
  demo       models/demo-llava (64 px, 64 image tokens): the tests' smallest run

Every round uses a new random-noise image and new instances; medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.budget import MemoryBudget
from llava.model.loading import LoadedModel, load_model
from llava.sessions.durable import record_name
from scripts.bench.images import bounded
from scripts.bench.prefix import noise_images
from scripts.bench.turns import QUESTIONS, ensure_model

REPO = Path(__file__).resolve().parents[2]
WAYS = ("resume", "replay", "fresh open")
TARGET = 5.0  # resume at least this many times faster than replay
BUDGET = MemoryBudget(2 << 30)  # an engine's device (here host) bytes: room for a session


@dataclass(frozen=True)
class BenchShape:
    model_dir: Path
    build: str | None  # demo_model.build --config that makes model_dir (None: committed)
    side: int  # px


SHAPES = {
    "llava-1.5": BenchShape(REPO / "build" / "realistic-llava", "realistic", 336),
    "demo": BenchShape(REPO / "models" / "demo-llava", None, 64),
}
LIMITS = {"rounds": (1, 10), "turns": (1, 20), "new_tokens": (1, 128)}


def question(turn: int) -> str:
    """Turn ``turn``'s question (from 1)."""
    return QUESTIONS[(turn - 1) % len(QUESTIONS)]


@dataclass
class Seen:
    """One way's recovery in one round."""

    first_s: float  # from the start of the recovery to the next answer's first token
    answer_s: float  # ... to the whole next answer
    prefilled: int  # tokens computed on B (the opening's included)
    decoded: int  # tokens generated on B
    token_equal: bool  # the next answer is the uninterrupted session's, token for token
    resume_s: float | None = None  # the resume call alone (resume only)
    turn_ttft_s: float | None = None  # the next turn's ask to its first token (resume only)
    vision_runs: int = 0  # images through B's vision tower, counted (count_vision)


@dataclass
class Row:
    """One way's medians over the rounds."""

    way: str
    answer_s: float
    low_s: float
    high_s: float
    first_s: float
    prefilled: int
    decoded: int
    vision_runs: int
    token_equal: bool


class Instances:
    """Engines that stand for an endpoint's instances: one model in memory (its weights
    shared, read only), each engine its own persistent-tier directory, one durable directory."""

    def __init__(self, loaded, model_dir: Path, root: Path):
        self.loaded, self.model_dir, self.root = loaded, model_dir, root
        self.durable = root / "durable"
        self.count = 0

    def start(self) -> Engine:
        """A new instance, its disk empty, warmed up (outside any timing)."""
        self.count += 1
        disk = self.root / f"instance-{self.count}"
        config = EngineConfig(
            model_dir=str(self.model_dir), persist_dir=str(disk), durable_store=str(self.durable)
        )
        engine = Engine(self.loaded, config, BUDGET)
        engine.warm_up()
        return engine

    def retire(self, engine: Engine) -> None:
        """The instance goes, and its disk with it."""
        engine.stop()
        shutil.rmtree(engine.config.persist_dir, ignore_errors=True)

    def stored_bytes(self, session_id: str) -> tuple[int, int]:
        """(the session's record, every features object) in the durable directory, bytes."""
        record = (self.durable / record_name(session_id)).stat().st_size
        features = sum(p.stat().st_size for p in (self.durable / "features").iterdir())
        return record, features


def count_vision(engine: Engine) -> list[int]:
    """A counter of the engine's vision tower runs from now on (every path calls
    ``Engine.encode_image``): ``[runs]``."""
    runs, encode = [0], engine.encode_image

    def counted(inputs):
        runs[0] += 1
        return encode(inputs)

    engine.encode_image = counted
    return runs


def timed_ask(engine: Engine, session_id: str, text: str, params: dict):
    """(the time of the first streamed token, the Answer), perf_counter seconds."""
    first: list[float] = []

    def on_token(_text: str, _token_id: int | None) -> None:
        if not first:
            first.append(time.perf_counter())

    answer = engine.ask(session_id, text, params, on_token)
    return (first[0] if first else time.perf_counter()), answer


def on_a(instances: Instances, image, turns: int, params: dict):
    """The conversation on A, written to the store, then A gone: (its id, the uninterrupted
    twin's answer to the next question, the store's bytes for the session)."""
    a = instances.start()
    try:
        twin = a.open(image).session_id  # the same conversation, never interrupted
        for turn in range(1, turns + 2):
            expected = a.ask(twin, question(turn), params).token_ids
        a.close(twin)
        session_id = a.open(image).session_id
        for turn in range(1, turns + 1):
            a.ask(session_id, question(turn), params)
        unflushed = a.flush_durable(60)
        if unflushed:
            raise RuntimeError(f"A could not write {unflushed} to the durable store")
        stored = instances.stored_bytes(session_id)
    finally:
        instances.retire(a)
    return session_id, expected, stored


def resume(b: Engine, old_id: str, turns: int, params: dict, expected) -> Seen:
    start = time.perf_counter()
    opened = b.resume(old_id)
    resumed = time.perf_counter()
    if opened.resumed is None or opened.resumed.turns != turns:
        raise RuntimeError(f"resumed {opened.resumed}, not {turns} turns")
    first, answer = timed_ask(b, opened.session_id, question(turns + 1), params)
    end = time.perf_counter()
    return Seen(
        first - start,
        end - start,
        answer.new_tokens,
        len(answer.token_ids),
        answer.token_ids == expected,
        resumed - start,
        first - resumed,
    )


def replay(b: Engine, image, turns: int, params: dict, expected) -> Seen:
    start = time.perf_counter()
    opened = b.open(image)
    prefilled, decoded = opened.prefill_tokens, 0
    for turn in range(1, turns + 1):
        answer = b.ask(opened.session_id, question(turn), params)
        prefilled, decoded = prefilled + answer.new_tokens, decoded + len(answer.token_ids)
    first, answer = timed_ask(b, opened.session_id, question(turns + 1), params)
    end = time.perf_counter()
    prefilled, decoded = prefilled + answer.new_tokens, decoded + len(answer.token_ids)
    return Seen(first - start, end - start, prefilled, decoded, answer.token_ids == expected)


def fresh_open(b: Engine, image, turns: int, params: dict, expected) -> Seen:
    start = time.perf_counter()
    opened = b.open(image)
    first, answer = timed_ask(b, opened.session_id, question(turns + 1), params)
    end = time.perf_counter()
    prefilled = opened.prefill_tokens + answer.new_tokens
    return Seen(
        first - start,
        end - start,
        prefilled,
        len(answer.token_ids),
        answer.token_ids == expected,
    )


def one_round(instances: Instances, image, turns: int, params: dict):
    """Every way once, each on its own new B: {way: Seen}, and the store's bytes."""
    old_id, expected, stored = on_a(instances, image, turns, params)
    seen = {}
    for way, recover in zip(WAYS, (resume, replay, fresh_open), strict=True):
        b = instances.start()
        try:
            runs = count_vision(b)
            target = old_id if recover is resume else image
            seen[way] = recover(b, target, turns, params, expected)
            seen[way].vision_runs = runs[0]
        finally:
            instances.retire(b)
    return seen, stored


def summarize(way: str, seen: list[Seen]) -> Row:
    last = seen[-1]  # token counts are the same every round (same sizes, same questions)
    return Row(
        way,
        statistics.median(s.answer_s for s in seen),
        min(s.answer_s for s in seen),
        max(s.answer_s for s in seen),
        statistics.median(s.first_s for s in seen),
        last.prefilled,
        last.decoded,
        last.vision_runs,
        all(s.token_equal for s in seen),
    )


HEADER = (
    "| way | to the next answer ms | min..max ms | to its first token ms | tokens prefilled "
    "| tokens decoded | vision tower runs | token-equal | keeps the conversation "
    "| vs resume |"
)


def table(rows: list[Row]) -> list[str]:
    """The markdown table: a row per way."""
    lines = [HEADER, "|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    base = next(row.answer_s for row in rows if row.way == "resume")
    for row in rows:
        lines.append(
            f"| {row.way} | {row.answer_s * 1000:,.0f} | "
            f"{row.low_s * 1000:,.0f}..{row.high_s * 1000:,.0f} | {row.first_s * 1000:,.0f} | "
            f"{row.prefilled:,} | {row.decoded:,} | {row.vision_runs} | "
            f"{'yes' if row.token_equal else 'no'} | "
            f"{'no' if row.way == 'fresh open' else 'yes'} | {row.answer_s / base:.1f}x |"
        )
    return lines


def verdict(rows: dict[str, Row]) -> str:
    """The target's line: replay's time over resume's."""
    ratio = rows["replay"].answer_s / rows["resume"].answer_s
    first = rows["replay"].first_s / rows["resume"].first_s
    holds = "holds" if ratio >= TARGET else "does not hold"
    return (
        f"resume against replay: {ratio:.1f}x faster to the next answer ({first:.1f}x to its "
        f"first token); the target, at least {TARGET:.0f}x, {holds}"
    )


def conversation_args(
    argv: list[str] | None, description: str, limits: dict, new_tokens: int
) -> argparse.Namespace:
    """The options of a bench over conversations of ``--turns`` on one image: the shape, the
    rounds, the turns and each answer's new tokens, within ``limits``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llava-1.5")
    parser.add_argument("--rounds", type=bounded("rounds", limits), default=3)
    parser.add_argument("--turns", type=bounded("turns", limits), default=10)
    parser.add_argument("--new-tokens", type=bounded("new_tokens", limits), default=new_tokens)
    return parser.parse_args(argv)


def shape_loaded(name: str) -> tuple[BenchShape, LoadedModel]:
    """The shape's model, built first if missing, loaded once (seeded: the same every run)."""
    torch.manual_seed(0)
    shape = SHAPES[name]
    if shape.build is not None:
        ensure_model(shape.model_dir, shape.build)
    return shape, load_model(str(shape.model_dir))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return conversation_args(argv, __doc__.splitlines()[0], LIMITS, new_tokens=64)


def main(argv: list[str] | None = None) -> dict[str, Row]:
    args = parse_args(argv)
    shape, loaded = shape_loaded(args.shape)
    params = {"max_new_tokens": args.new_tokens}  # greedy: no sampling parameter sent
    root = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    seen: dict[str, list[Seen]] = {way: [] for way in WAYS}
    try:
        for index in range(args.rounds):
            # a new image and a new store every round: nothing carried over
            instances = Instances(loaded, shape.model_dir, root / f"round-{index}")
            image = noise_images(1, seed=2000 + index, side=shape.side)[0]
            found, stored = one_round(instances, image, args.turns, params)
            for way in WAYS:
                seen[way].append(found[way])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = {way: summarize(way, seen[way]) for way in WAYS}
    resumes = seen["resume"]
    parameters = sum(p.numel() for p in loaded.model.parameters())
    print(
        f"the next answer after {args.turns} turns, on another instance: median of "
        f"{args.rounds} rounds; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.new_tokens} new tokens an answer, greedy"
    )
    print(
        f"  {args.shape}: {shape.model_dir.name}, {parameters / 1e6:.1f} M parameters, "
        f"{shape.side}x{shape.side} px images"
    )
    print(
        f"  the resume's parts: the resume call "
        f"{statistics.median(s.resume_s for s in resumes) * 1000:,.0f} ms, the next turn's "
        f"time to first token {statistics.median(s.turn_ttft_s for s in resumes) * 1000:,.0f} ms"
    )
    print(
        f"  durable store for the session: its record {stored[0]:,} bytes, its image's "
        f"features {stored[1]:,} bytes (once for every session on the image)"
    )
    print(f"  {verdict(rows)}")
    print()
    print("\n".join(table(list(rows.values()))))
    return rows


if __name__ == "__main__":
    main()
