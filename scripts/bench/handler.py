"""Handler overhead: per-turn latency through TorchServe vs the engine called in-process.

Same demo model, same image, same questions. Through TorchServe, "round trip" is what the
client measures and "engine" is what the handler reports the engine spent (timing.totalMs):
their difference is TorchServe + handler + HTTP. Prints medians over --turns turns.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import requests

from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava_wire import NEW_SESSION, SESSION, SESSION_HEADER
from scripts.demo import QUESTIONS
from serving.torchserve import TorchServeInstance

REPO = Path(__file__).resolve().parents[2]


def through_torchserve(image_b64: str, turns: int) -> tuple[list[float], list[float], float]:
    instance = TorchServeInstance.on_free_ports(Path(tempfile.mkdtemp(prefix="bench-ts-")))
    start = time.perf_counter()
    instance.start(timeout=180)
    ready_s = time.perf_counter() - start
    url = instance.inference_url + "/invocations"
    http = requests.Session()
    http.headers.update(instance.auth_headers("inference"))
    post = http.post
    try:
        opened = post(
            url,
            data=json.dumps({"requestType": NEW_SESSION, "image": {"b64": image_b64}}),
            timeout=60,
        )
        session = {SESSION_HEADER: opened.json()["sessionId"], "Content-Type": "application/json"}
        round_trips, engine = [], []
        for turn in range(turns):
            body = {"requestType": SESSION, "inputs": QUESTIONS[turn % len(QUESTIONS)][0]}
            start = time.perf_counter()
            reply = post(url, data=json.dumps(body), headers=session, timeout=60)
            round_trips.append((time.perf_counter() - start) * 1000)
            engine.append(reply.json()["timing"]["totalMs"])
    finally:
        instance.stop()
    return round_trips, engine, ready_s


def in_process(image, turns: int) -> list[float]:
    engine = Engine.from_config(EngineConfig(model_dir=str(REPO / "models" / "demo-llava")))
    engine.warm_up()
    session_id = engine.open(image).session_id
    latencies = []
    for turn in range(turns):
        start = time.perf_counter()
        engine.ask(session_id, QUESTIONS[turn % len(QUESTIONS)][0])
        latencies.append((time.perf_counter() - start) * 1000)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    args = parser.parse_args()
    image = held_out_samples(1)[0].image
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    round_trips, engine_ms, ready_s = through_torchserve(
        base64.b64encode(buffer.getvalue()).decode(), args.turns
    )
    direct = in_process(image, args.turns)
    median = statistics.median
    print(f"TorchServe start to READY: {ready_s:.1f} s; median of {args.turns} turns (ms):")
    print(f"  engine in-process              {median(direct):7.1f}")
    print(f"  engine inside the worker       {median(engine_ms):7.1f}")
    print(f"  round trip through TorchServe  {median(round_trips):7.1f}")
    overhead = median(r - e for r, e in zip(round_trips, engine_ms, strict=True))
    print(f"  overhead (round trip - engine) {overhead:7.1f}")


if __name__ == "__main__":
    main()
