"""What the container's front (serving/front.py) adds per turn: the same session's turns sent
through the front and straight to TorchServe's internal inference port, alternating.

Runs docker/entrypoint.sh serve on loopback with free ports and the demo model's .mar
(model-store/llava.mar, `make mar`) laid out as /opt/ml/model; prints medians.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from llava_wire import NEW_SESSION, SESSION, SESSION_HEADER
from serving.torchserve import free_ports

ROOT = Path(__file__).resolve().parents[2]

TURNS = 60


def _ping(url: str) -> int | None:
    try:
        return requests.get(f"{url}/ping", timeout=10).status_code
    except requests.ConnectionError:  # the front is not listening yet
        return None


def _open(url: str) -> str:
    opened = requests.post(f"{url}/invocations", json={"requestType": NEW_SESSION}, timeout=60)
    opened.raise_for_status()
    return opened.json()["sessionId"]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="bench_front-") as tmp:
        model_dir = Path(tmp, "model")
        model_dir.mkdir()
        shutil.copy(ROOT / "model-store" / "llava.mar", model_dir)
        port, inference, management, metrics = free_ports(4)
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "SERVE_MODEL_DIR": str(model_dir),
            "SERVE_HOST": "127.0.0.1",
            "SERVE_PORT": str(port),
            "SERVE_TS_PORTS": f"{inference},{management},{metrics}",
            "SERVE_WORK_DIR": str(Path(tmp, "work")),
        }
        with open(Path(tmp, "log"), "wb") as log:
            container = subprocess.Popen(
                [ROOT / "docker" / "entrypoint.sh", "serve"], env=env, stdout=log, stderr=log
            )
        try:
            front, direct = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{inference}"
            began = time.monotonic()
            while _ping(front) != 200:
                if container.poll() is not None or time.monotonic() - began > 300:
                    print(Path(tmp, "log").read_text()[-3000:], file=sys.stderr)
                    return 1
                time.sleep(0.2)
            print(f"/ping 200 after {time.monotonic() - began:.1f} s")
            ask = {
                "requestType": SESSION,
                "inputs": "Say that again.",
                "parameters": {"max_new_tokens": 1},
            }
            timings = {front: [], direct: []}
            for turn in range(2 * TURNS):
                if turn % 10 == 0:  # the demo model's context is short: a new session now and then
                    session = _open(front)
                url = (front, direct)[turn % 2]
                t0 = time.perf_counter()
                reply = requests.post(
                    f"{url}/invocations", json=ask, headers={SESSION_HEADER: session}, timeout=60
                )
                timings[url].append((time.perf_counter() - t0) * 1000)
                reply.raise_for_status()
            via_front, straight = (statistics.median(timings[u]) for u in (front, direct))
            print(f"| path ({TURNS} turns each, demo model) | median per turn |")
            print("|---|---:|")
            print(f"| client → TorchServe | {straight:.1f} ms |")
            print(f"| client → front → TorchServe | {via_front:.1f} ms |")
            print(f"front adds {via_front - straight:.1f} ms per turn")
        finally:
            container.terminate()
            container.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
