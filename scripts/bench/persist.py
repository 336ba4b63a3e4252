"""The persistent tier (docs/engine/sessions.md §Persistent tier): what it costs and what it
saves.

1. Turn latency with the tier on (a directory under /dev/shm) and off, the demo model in
   process, turns of several sessions interleaved, on and off alternating.
2. Bytes persisted per session: the demo model measured (an entry after open and 3 turns);
   LLaVA-1.5-7B by arithmetic (576 image tokens x 4096 hidden, bf16 features) and its
   features written once through the journal (the open's extra cost).
3. Time from SIGKILL of the worker to the first answered turn on a surviving session: a real
   TorchServe, supervised (serving/supervisor.py), the demo model (``--kills 0`` skips it).
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.budget import MemoryBudget
from llava.model.loading import load_model
from llava.sessions.persist import FEATURES, STATE, SessionJournal, Snapshot
from llava_wire import SESSION_HEADER
from serving.mar import build_mar
from serving.supervisor import Supervisor
from serving.torchserve import TorchServeInstance

REPO = Path(__file__).resolve().parents[2]

DEMO = REPO / "models" / "demo-llava"
MAR = REPO / "model-store" / "llava.mar"
QUESTIONS = ["What shape is it?", "And its color?", "Say that again.", "What color is the shape?"]
SEVEN_B = {"image_tokens": 576, "hidden": 4096, "bytes_per_element": 2, "vocab_size": 32064}


def scratch_dir() -> str:
    """A directory of our own under /dev/shm (never the served default), else under /tmp."""
    return tempfile.mkdtemp(
        prefix="bench-persist-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )


def turn_latency(loaded, rounds: int, sessions: int) -> dict[str, list[float]]:
    """Milliseconds per ask, persistence on and off, engines used alternately."""
    directory = scratch_dir()
    engines = {
        "off": Engine(loaded, EngineConfig(model_dir="-"), MemoryBudget(1 << 30)),
        "on": Engine(
            loaded, EngineConfig(model_dir="-", persist_dir=directory), MemoryBudget(1 << 30)
        ),
    }
    images = [s.image for s in held_out_samples(sessions, seed=92_000)]
    times: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        engine.warm_up()
    for _ in range(rounds):
        for name, engine in engines.items():
            ids = [engine.open(image).session_id for image in images]
            for question in QUESTIONS:
                for session_id in ids:
                    start = time.perf_counter()
                    engine.ask(session_id, question)
                    times[name].append((time.perf_counter() - start) * 1000)
            for session_id in ids:
                engine.close(session_id)
    shutil.rmtree(directory)
    return times


def demo_entry_bytes(loaded) -> tuple[int, int]:
    """(features file, state file) bytes of a demo session after open and 3 turns."""
    directory = scratch_dir()
    engine = Engine(
        loaded, EngineConfig(model_dir="-", persist_dir=directory), MemoryBudget(1 << 30)
    )
    session_id = engine.open(held_out_samples(1, seed=92_100)[0].image).session_id
    for question in QUESTIONS[:3]:
        engine.ask(session_id, question)
    sizes = entry_sizes(directory, session_id)
    shutil.rmtree(directory)
    return sizes


def seven_b_writes(repeats: int) -> tuple[int, int, float, float]:
    """A 7B session's features and state file bytes (576 image tokens and 100 of text), and
    the median ms to write an open's entry (both files) and a turn's (the state only)."""
    directory = scratch_dir()
    journal = SessionJournal(directory, 1 << 40, "bench", SEVEN_B["vocab_size"], 20 * 60.0)
    features = torch.randn(SEVEN_B["image_tokens"], SEVEN_B["hidden"]).to(torch.bfloat16)
    ids = [32000] * SEVEN_B["image_tokens"] + list(range(29000, 29100))
    opens, turns = [], []
    for i in range(repeats):
        image = ((None, SEVEN_B["image_tokens"]),)
        snapshot = Snapshot(f"s{i}", ids, [], 0, time.time(), 1200.0, image, opening_images=1)
        for times, extra in ((opens, features), (turns, None)):
            start = time.perf_counter()
            journal.save(snapshot, extra)
            times.append((time.perf_counter() - start) * 1000)
    sizes = entry_sizes(directory, "s0")
    shutil.rmtree(directory)
    return *sizes, statistics.median(opens), statistics.median(turns)


def entry_sizes(directory: str, session_id: str) -> tuple[int, int]:
    """A session's features and state file bytes in the journal's directory."""
    path = os.path.join(directory, session_id)
    return os.path.getsize(path + FEATURES), os.path.getsize(path + STATE)


def kill_to_answer(kills: int) -> list[float]:
    """Seconds from SIGKILL of the worker to the first 200 on a session opened before it."""
    if not MAR.exists():
        build_mar(DEMO)
    root, persist_dir = Path(tempfile.mkdtemp(prefix="bench-persist-ts-")), scratch_dir()
    instance = TorchServeInstance.on_free_ports(
        root, model_store=MAR.parent, env={"LLAVA_PERSIST_DIR": persist_dir}
    )
    supervisor, stop = Supervisor(instance, log=lambda line: None), threading.Event()
    supervisor.start()
    supervisor.watch_in_thread(stop)
    url = instance.inference_url
    image = io.BytesIO()
    held_out_samples(1, seed=92_200)[0].image.save(image, "PNG")
    b64 = base64.b64encode(image.getvalue()).decode()
    seconds = []
    try:
        for _ in range(kills):
            opened = requests.post(
                f"{url}/invocations",
                json={"requestType": "NEW_SESSION", "image": {"b64": b64}},
                headers=instance.auth_headers("inference"),
                timeout=60,
            ).json()["sessionId"]
            ask = {"requestType": "SESSION", "inputs": QUESTIONS[0]}
            headers = {SESSION_HEADER: opened, **instance.auth_headers("inference")}
            requests.post(f"{url}/invocations", json=ask, headers=headers, timeout=60)
            killed = time.monotonic()
            os.kill(instance.worker_pid(), signal.SIGKILL)
            while time.monotonic() - killed < 300:
                if supervisor.ready() and answered(instance, ask, opened):  # as the front does
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError("no answer within 300 s of the kill")
            seconds.append(time.monotonic() - killed)
    finally:
        stop.set()
        instance.stop(graceful=False)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(persist_dir, ignore_errors=True)
    return seconds


def answered(instance: TorchServeInstance, body: dict, session_id: str) -> bool:
    """Whether the instance answers 200 (its key read anew: a restart makes new keys)."""
    headers = {SESSION_HEADER: session_id, **instance.auth_headers("inference")}
    try:
        reply = requests.post(
            f"{instance.inference_url}/invocations", json=body, headers=headers, timeout=60
        )
    except requests.RequestException:  # the instance being restarted under us
        return False
    return reply.status_code == 200


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--kills", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    loaded = load_model(str(DEMO))

    times = turn_latency(loaded, args.rounds, args.sessions)
    print(f"turn latency, demo model in process ({len(times['on'])} turns each, ms)")
    print(f"{'persistence':<12} {'median':>8} {'mean':>8} {'p90':>8}")
    for name in ("off", "on"):
        ms = sorted(times[name])
        p90 = ms[int(0.9 * (len(ms) - 1))]
        print(f"{name:<12} {statistics.median(ms):8.2f} {statistics.mean(ms):8.2f} {p90:8.2f}")

    features, state = demo_entry_bytes(loaded)
    seven_features, seven_state, open_ms, turn_ms = seven_b_writes(repeats=20)
    arithmetic = SEVEN_B["image_tokens"] * SEVEN_B["hidden"] * SEVEN_B["bytes_per_element"]
    print("\nbytes persisted per session")
    print(f"{'model':<44} {'features':>12} {'state':>8}")
    print(f"{'demo, after open and 3 turns (measured)':<44} {features:12,} {state:8,}")
    print(f"{'7B: 576 x 4096 x 2 bytes (arithmetic)':<44} {arithmetic:12,} {'':>8}")
    print(
        f"{'7B files as written (676 ids, no messages)':<44} {seven_features:12,} {seven_state:8,}"
    )
    print(f"7B writes (median of 20): an open's entry {open_ms:.2f} ms, a turn's {turn_ms:.2f} ms")

    if args.kills:
        seconds = kill_to_answer(args.kills)
        print("\nSIGKILL of the worker -> first answered turn on a surviving session (s)")
        print("  " + ", ".join(f"{s:.1f}" for s in seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
