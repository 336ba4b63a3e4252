"""Per-request cost vs sessions held: the handler's time per ask with 10 ... 5,000 idle sessions.

The real handler runs in-process (TorchServe's Context, no frontend) on the demo model; the
idle sessions each hold one block of the engine's KV pool (only the bookkeeping is measured).
Columns: the handler's time per ask, the store's own bookkeeping per request (a turn's
enter/leave plus the stats the handler publishes), and, for contrast, one walk of every
session's memory (the integrity check a debug engine runs when idle), which is what each
request used to pay (twice: once for the stats, once for the budget check).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from llava.config import EngineConfig
from llava.engine import Engine
from llava.sessions.session import Session
from llava.sessions.store import new_session_id
from llava_wire import CLOSE_SESSION, NEW_SESSION, SESSION, SESSION_HEADER
from scripts.handler_harness import InProcessWorker

REPO = Path(__file__).resolve().parents[2]

HELD = (10, 100, 1000, 5000)
ASK = {"requestType": SESSION, "inputs": "What shape is it?", "parameters": {"max_new_tokens": 1}}


def idle_session(engine: Engine) -> Session:
    holding = engine.memory.hold()
    assert engine.memory.start(holding, 1) is None
    return Session(new_session_id(), [0], holding)


def median_ms(action, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = Engine.from_config(EngineConfig(model_dir=str(REPO / "models" / "demo-llava")))
    engine.warm_up()
    worker = InProcessWorker(engine)
    print(
        "Per-request cost vs idle sessions held (each one KV pool block), "
        f"median of {args.turns} asks (ms):"
    )
    print(
        f"{'sessions':>9} {'handler per ask':>16} {'store bookkeeping':>18} {'one full walk':>14}"
    )
    try:
        for held in HELD:
            while len(engine.store) < held:
                engine.store.add(idle_session(engine))
            opened = worker.invoke({"requestType": NEW_SESSION}).json()["sessionId"]

            def ask(session_id=opened):
                worker.invoke(ASK, {SESSION_HEADER: session_id})

            def bookkeeping(session_id=opened):
                with engine.store.use(session_id):
                    pass
                engine.stats()

            handler = median_ms(ask, args.turns)
            store = median_ms(bookkeeping, args.turns)
            walk = median_ms(engine.check_integrity, 5)
            worker.invoke({"requestType": CLOSE_SESSION}, {SESSION_HEADER: opened})
            print(f"{held:>9,} {handler:>16.2f} {store:>18.3f} {walk:>14.2f}")
    finally:
        worker.stop()


if __name__ == "__main__":
    main()
