"""An OpenAI client resending its conversation: the last turn's time to first token, five ways.

    python -m scripts.bench.openai_resend [--shape llava-1.5] [--rounds 3] [--turns 10]
                                          [--new-tokens 32]

A client holds a conversation of ``--turns`` turns on one image (sent in the first user
message). An OpenAI chat-completions client sends the whole conversation every call: every
earlier question, every earlier answer as an assistant message (the text it was given), the
image, and the new question. The last turn's time to first token, on the caller's clock (from
the call to the first streamed token), served five ways, each on its own engine:

  stateless, no reuse    ``Engine.chat(conversation)`` under ``prefix_sharing: off``: every
                         call runs the vision tower and prefills the whole conversation, what a
                         server that keeps nothing does
  resent, opening        ``Engine.chat(conversation)`` without a session under the default
                         ``prefix_sharing: opening``: the image's features and the opening's
                         KV blocks are reused from the calls before, the rest prefilled again
  resent, all            the same under ``prefix_sharing: all``: the blocks of the whole resent
                         conversation the call before computed are reused
  resent, session        ``Engine.chat(conversation, session_id)``: the first call opens the
                         session (``new_session=True``), the later ones continue it: the
                         conversation is matched to the session's and only the new user message
                         is prefilled
  ask, session           for reference, the requestType protocol: ``Engine.open(image)``, then
                         ``Engine.ask(session_id, question)`` every turn

Every chat call first asks ``Engine.images_to_fetch`` which images must be loaded (the handler
does so before it fetches any) and sends the others without their pixels; the image is a PIL
image already decoded, so the fetch and the decode of the HTTP path are not in these numbers.
Every answer is greedy and exactly ``--new-tokens`` tokens long (min_new_tokens equal to
max_new_tokens), so the conversations of every way are of one length.

Shapes (untrained models of the real image geometry):
  llava-1.5  build/realistic-llava (built if missing): 336 px, 576 image tokens an image
  demo       models/demo-llava (64 px, 64 image tokens): the tests' smallest run

Every round uses a new random-noise image (the same for the five ways, each on its own engine,
so no way finds what another computed); medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.budget import MemoryBudget
from llava.sched.conversation import ChatImage, ChatTurn, Conversation
from scripts.bench.prefix import noise_images
from scripts.bench.resume import conversation_args, count_vision, question, shape_loaded

WAYS = ("stateless, no reuse", "resent, opening", "resent, all", "resent, session", "ask, session")
SHARING = {  # each way's engine's prefix_sharing
    "stateless, no reuse": "off",
    "resent, opening": "opening",
    "resent, all": "all",
    "resent, session": "opening",
    "ask, session": "opening",
}
LIMITS = {"rounds": (1, 10), "turns": (2, 20), "new_tokens": (1, 64)}
BUDGET = MemoryBudget(1 << 30)  # an engine's device (here host) bytes: room for its sessions


@dataclass
class Seen:
    """One way's conversation in one round: its last turn, and the whole."""

    ttft_s: float  # the caller's clock: from the last call to its first token
    engine_ttft_s: float  # the last turn's Answer.ttft_s
    prompt: int  # the last turn's prompt tokens (cached and prefilled)
    cached: int  # of them, reused (Answer.cached_tokens)
    vision_runs: int  # images through the vision tower in the last turn
    token_ids: tuple[int, ...]  # the last answer
    conversation_s: float  # every turn, from the first call to the last answer's end


@dataclass
class Row:
    """One way's medians over the rounds."""

    way: str
    sharing: str
    ttft_s: float
    low_s: float
    high_s: float
    engine_ttft_s: float
    prompt: int
    cached: int
    vision_runs: int
    same_answer: bool  # the last answer is the ask way's, token for token, every round
    conversation_s: float


@dataclass
class Client:
    """What an OpenAI client keeps: the image, and every question with the answer it got."""

    image: object  # a PIL image
    ref: str  # the image's source (its URL)
    asked: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    def conversation(self, turn: int) -> Conversation:
        """The messages it sends for turn ``turn``: the image in the first user message, the
        earlier answers as assistant messages, the new question last."""
        turns = []
        for index in range(1, turn + 1):
            images = (ChatImage(self.ref, self.image),) if index == 1 else ()
            answer = self.answers[index - 1] if index < turn else None
            turns.append(ChatTurn(question(index), images, answer))
        return Conversation(tuple(turns))


def without_pixels(conversation: Conversation, needed: list[int]) -> Conversation:
    """The conversation with the pixels of the images not in ``needed`` left out (their refs
    kept), as the handler passes it after ``Engine.images_to_fetch``."""
    kept, turns, index = set(needed), [], 0
    for turn in conversation.turns:
        images = []
        for image in turn.images:
            images.append(image if index in kept else ChatImage(image.ref, None))
            index += 1
        turns.append(ChatTurn(turn.question, tuple(images), turn.answer))
    return Conversation(tuple(turns), conversation.system)


class Timed:
    """The first streamed token's time, for ``on_token``."""

    def __init__(self):
        self.first: float | None = None

    def __call__(self, _text: str, _token_id: int | None) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def since(self, start: float) -> float:
        return (self.first if self.first is not None else time.perf_counter()) - start


def chat_turn(engine: Engine, client: Client, turn: int, params: dict, session: dict):
    """One chat call for turn ``turn``: (seconds to its first token, the Answer). ``session``:
    {} without one; {"id": None} opens one (its id written back), {"id": id} continues it."""
    timed = Timed()
    start = time.perf_counter()
    sent = client.conversation(turn)
    session_id = session.get("id")
    sent = without_pixels(sent, engine.images_to_fetch(sent, session_id))
    new_session = "id" in session and session_id is None
    answer = engine.chat(sent, session_id, params, timed, new_session=new_session)
    ttft = timed.since(start)
    if "id" in session:
        session["id"] = answer.session_id
    return ttft, answer


def converse(engine: Engine, runs: list[int], client: Client, turns: int, params: dict, way: str):
    """The client's whole conversation one way, as Seen: the last turn measured. ``runs``:
    the engine's vision tower counter (count_vision)."""
    session: dict = {"id": None} if way in ("resent, session", "ask, session") else {}
    start = time.perf_counter()
    if way == "ask, session":
        session["id"] = engine.open(client.image).session_id
    for turn in range(1, turns + 1):
        runs[0] = 0
        if way == "ask, session":
            timed = Timed()
            asked = time.perf_counter()
            answer = engine.ask(session["id"], question(turn), params, timed)
            ttft = timed.since(asked)
        else:
            ttft, answer = chat_turn(engine, client, turn, params, session)
        client.answers.append(answer.text)
    elapsed = time.perf_counter() - start
    if session.get("id") is not None:
        engine.close(session["id"])
    return Seen(
        ttft,
        answer.ttft_s,
        answer.cached_tokens + answer.new_tokens,
        answer.cached_tokens,
        runs[0],
        tuple(answer.token_ids),
        elapsed,
    )


def start_engine(loaded, model_dir: Path, sharing: str, side: int, params: dict):
    """A warmed-up engine and its vision tower counter: its own warm-up, then a stateless chat
    and a session's two chat calls on an image no round uses (first-call costs outside the
    timing)."""
    engine = Engine(loaded, EngineConfig(str(model_dir), prefix_sharing=sharing), BUDGET)
    engine.warm_up()
    short = {**params, "max_new_tokens": 1, "min_new_tokens": 1}
    client = Client(noise_images(1, seed=999, side=side)[0], "https://bench.invalid/warm.png")
    chat_turn(engine, client, 1, short, {})
    session = {"id": None}
    client.answers.append(chat_turn(engine, client, 1, short, session)[1].text)
    chat_turn(engine, client, 2, short, session)
    engine.close(session["id"])
    return engine, count_vision(engine)


def summarize(way: str, seen: list[Seen], asked: list[Seen]) -> Row:
    last = seen[-1]  # token counts are the same every round (same sizes, same questions)
    return Row(
        way,
        SHARING[way],
        statistics.median(s.ttft_s for s in seen),
        min(s.ttft_s for s in seen),
        max(s.ttft_s for s in seen),
        statistics.median(s.engine_ttft_s for s in seen),
        last.prompt,
        last.cached,
        last.vision_runs,
        all(s.token_ids == a.token_ids for s, a in zip(seen, asked, strict=True)),
        statistics.median(s.conversation_s for s in seen),
    )


HEADER = (
    "| way | prefix_sharing | TTFT ms | min..max ms | engine ttft_s ms | prompt tokens "
    "| cached tokens | tokens prefilled | vision tower runs | answer as ask's "
    "| conversation s | vs stateless |"
)


def table(rows: list[Row]) -> list[str]:
    """The markdown table: a row per way."""
    lines = [HEADER, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    base = next(row.ttft_s for row in rows if row.way == WAYS[0])
    for row in rows:
        lines.append(
            f"| {row.way} | {row.sharing} | {row.ttft_s * 1000:,.0f} | "
            f"{row.low_s * 1000:,.0f}..{row.high_s * 1000:,.0f} | "
            f"{row.engine_ttft_s * 1000:,.0f} | {row.prompt:,} | {row.cached:,} | "
            f"{row.prompt - row.cached:,} | {row.vision_runs} | "
            f"{'yes' if row.same_answer else 'no'} | {row.conversation_s:,.1f} | "
            f"{row.ttft_s / base:.2f}x |"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return conversation_args(argv, __doc__.splitlines()[0], LIMITS, new_tokens=32)


def main(argv: list[str] | None = None) -> dict[str, Row]:
    args = parse_args(argv)
    shape, loaded = shape_loaded(args.shape)
    # greedy (no sampling parameter sent), every answer exactly --new-tokens long
    params = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
    engines = {}
    seen: dict[str, list[Seen]] = {way: [] for way in WAYS}
    try:
        for way in WAYS:
            engines[way] = start_engine(loaded, shape.model_dir, SHARING[way], shape.side, params)
        for index in range(args.rounds):
            # a new image every round, the same for every way (each on its own engine)
            image = noise_images(1, seed=3000 + index, side=shape.side)[0]
            ref = f"https://bench.invalid/round-{index}.png"
            for way in WAYS:
                engine, runs = engines[way]
                seen[way].append(
                    converse(engine, runs, Client(image, ref), args.turns, params, way)
                )
    finally:
        for engine, _ in engines.values():
            engine.stop()
    rows = {way: summarize(way, seen[way], seen["ask, session"]) for way in WAYS}
    parameters = sum(p.numel() for p in loaded.model.parameters())
    print(
        f"turn {args.turns} of {args.turns}, the conversation resent: time to first token, "
        f"median of {args.rounds} rounds; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.new_tokens} new tokens an answer, greedy"
    )
    print(
        f"  {args.shape}: {shape.model_dir.name}, {parameters / 1e6:.1f} M parameters, "
        f"{shape.side}x{shape.side} px images, one in the first user message"
    )
    print()
    print("\n".join(table(list(rows.values()))))
    return rows


if __name__ == "__main__":
    main()
