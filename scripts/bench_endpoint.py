"""Turn latency through the local endpoint vs straight to TorchServe.

One TorchServe instance behind the local endpoint, one image, three sessions asked in turn
(so machine load falls on all three alike):

* direct:          HTTP straight to TorchServe's /invocations (requests, keep-alive);
* endpoint (HTTP): the same request to the endpoint's /endpoints/<name>/invocations;
* endpoint (boto3): llava_client.Session.ask through unmodified boto3 (SigV4 signing,
  botocore parsing).

"engine" is what the handler reports the engine spent (timing.totalMs). Prints medians and
90th percentiles over --turns turns per path, in ms.
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
from llava_client import LlavaClient
from llava_wire import NEW_SESSION, NEW_SESSION_HEADER, SESSION, SESSION_HEADER
from local_endpoint.launcher import LocalEndpoint
from scripts.demo import QUESTIONS
from serving.torchserve import free_ports

REPO = Path(__file__).resolve().parent.parent

NAME = "stateful-llava"


class RawSession:
    """Open and ask over plain HTTP at ``url`` (TorchServe's or the endpoint's invocations)."""

    def __init__(self, url: str, image_b64: str):
        self.url, self.http = url, requests.Session()
        opened = self.post({"requestType": NEW_SESSION, "image": {"b64": image_b64}}, NEW_SESSION)
        value = opened.headers.get(NEW_SESSION_HEADER) or opened.headers[SESSION_HEADER]
        self.session_id = value.split(";")[0]

    def post(self, body: dict, session_id: str) -> requests.Response:
        headers = {"Content-Type": "application/json", SESSION_HEADER: session_id}
        reply = self.http.post(self.url, data=json.dumps(body), headers=headers, timeout=60)
        reply.raise_for_status()
        return reply

    def ask(self, question: str) -> dict:
        return self.post({"requestType": SESSION, "inputs": question}, self.session_id).json()


def timed(ask, question: str) -> tuple[float, float]:
    start = time.perf_counter()
    reply = ask(question)
    return (time.perf_counter() - start) * 1000, reply["timing"]["totalMs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    args = parser.parse_args()
    buffer = io.BytesIO()
    held_out_samples(1)[0].image.save(buffer, format="PNG")
    image_b64 = base64.b64encode(buffer.getvalue()).decode()
    endpoint = LocalEndpoint(Path(tempfile.mkdtemp(prefix="bench-ep-")), 1, free_ports(1)[0])
    (instance,) = endpoint.start(timeout=180)
    try:
        runtime = endpoint.runtime()
        chat = LlavaClient(NAME, runtime=runtime).open(base64.b64decode(image_b64))
        paths = {
            "direct to TorchServe": RawSession(
                f"{instance.inference_url}/invocations", image_b64
            ).ask,
            "endpoint, plain HTTP": RawSession(
                f"{endpoint.url}/endpoints/{NAME}/invocations", image_b64
            ).ask,
            "endpoint, boto3 client": lambda q: chat.ask(q).reply,
        }
        rows = {name: [] for name in paths}
        for turn in range(args.turns):
            question = QUESTIONS[turn % len(QUESTIONS)][0]
            for name, ask in paths.items():
                rows[name].append(timed(ask, question))
    finally:
        endpoint.stop()
    print(f"median / p90 of {args.turns} turns (ms), demo model, one TorchServe instance:")
    print(f"  {'path':<24} {'round trip':>17} {'engine':>8} {'round trip - engine':>20}")
    for name, samples in rows.items():
        trips, engine = [t for t, _ in samples], [e for _, e in samples]
        p90 = statistics.quantiles(trips, n=10)[-1]
        over = statistics.median(t - e for t, e in samples)
        print(
            f"  {name:<24} {statistics.median(trips):8.1f} / {p90:6.1f} "
            f"{statistics.median(engine):8.1f} {over:20.1f}"
        )


if __name__ == "__main__":
    main()
