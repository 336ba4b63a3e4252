"""Turn latency through the local endpoint vs straight to TorchServe.

One TorchServe instance behind the local endpoint, one image, three sessions asked in turn
(so machine load falls on all three alike):

* direct:          HTTP straight to TorchServe's /invocations (requests, keep-alive);
* endpoint (HTTP): the same request to the endpoint's /endpoints/<name>/invocations;
* endpoint (boto3): llava_client.Session.ask through unmodified boto3 (SigV4 signing,
  botocore parsing).

"engine" is what the handler reports the engine spent (timing.totalMs). Prints medians and
90th percentiles over --turns turns per path, in ms.

``--load``: many sessions at once through the endpoint, over each ``--setup``
(``INSTANCES:THREADS``, threads as the launcher's ``--threads``), the setups taking turns for
``--rounds`` rounds so machine load falls on all alike. A run opens --sessions sessions at once,
each on its own image, and asks each --session-turns questions in turn; it prints the run's
seconds from the first open to the last answer, the median open and the median turn, then the
medians over the rounds (docs/performance.md §Endpoint instances and cores).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import requests

from demo_model.synthetic import held_out_samples
from llava_client import LlavaClient
from llava_client.images import image_source
from llava_wire import NEW_SESSION, NEW_SESSION_HEADER, SESSION, SESSION_HEADER
from local_endpoint.launcher import LocalEndpoint, parse_threads
from scripts.demo import QUESTIONS
from serving.torchserve import free_ports

REPO = Path(__file__).resolve().parents[2]

NAME = "stateful-llava"
RUN_BOUND_S = 300  # a load run that takes longer is a failure, not a number


class RawSession:
    """Open and ask over plain HTTP at ``url`` (TorchServe's, with ``auth``, its key header,
    or the endpoint's invocations)."""

    def __init__(self, url: str, image_b64: str, auth: dict[str, str] | None = None):
        self.url, self.http = url, requests.Session()
        self.http.headers.update(auth or {})
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


def conversation(url: str, image_b64: str, turns: int) -> tuple[float, list[float]]:
    """One session: the open's seconds and each turn's."""
    start = time.perf_counter()
    session = RawSession(url, image_b64)
    opened = time.perf_counter() - start
    took = []
    for turn in range(turns):
        start = time.perf_counter()
        session.ask(QUESTIONS[turn % len(QUESTIONS)][0])
        took.append(time.perf_counter() - start)
    return opened, took


def load_run(setup: str, images: list[str], turns: int) -> tuple[float, float, float]:
    """Seconds for the whole run, the median open and the median turn, on a fresh endpoint."""
    instances, threads = setup.split(":")
    # The persistent tier on, as `make endpoint` runs it, in a directory of this run's own: no
    # run adopts the sessions of the one before it.
    persist = tempfile.mkdtemp(prefix="bench-ep-", dir="/dev/shm")
    endpoint = LocalEndpoint(
        Path(tempfile.mkdtemp(prefix="bench-ep-")),
        int(instances),
        free_ports(1)[0],
        env={"LLAVA_PERSIST_DIR": persist},
        threads=parse_threads(threads),
    )
    endpoint.start(timeout=180)
    url = f"{endpoint.url}/endpoints/{NAME}/invocations"
    pool = ThreadPoolExecutor(len(images))
    try:
        start = time.perf_counter()
        runs = [pool.submit(conversation, url, image, turns) for image in images]
        _, late = wait(runs, timeout=RUN_BOUND_S)
        if late:
            raise TimeoutError(f"{setup}: the load took over {RUN_BOUND_S} s")
        total = time.perf_counter() - start
    finally:
        endpoint.stop()  # first: a late run's requests then fail at once
        pool.shutdown(cancel_futures=True)
        shutil.rmtree(persist)
    done = [run.result() for run in runs]
    opens = statistics.median(opened for opened, _ in done)
    return total, opens, statistics.median(t for _, took in done for t in took)


def load(args) -> None:
    images = [image_source(sample.image)["b64"] for sample in held_out_samples(args.sessions)]
    results = {setup: [] for setup in args.setup}
    print(
        f"{args.sessions} sessions at once x {args.session_turns} turns, demo model, "
        f"{len(os.sched_getaffinity(0))} cores; instances:threads, total s, open p50, turn p50"
    )
    for round_ in range(args.rounds):
        for setup in args.setup:
            results[setup].append(load_run(setup, images, args.session_turns))
            total, opens, turns = results[setup][-1]
            print(f"  round {round_ + 1} {setup:<8} {total:6.1f} s {opens:6.2f} s {turns:6.2f} s")
    print(f"median of {args.rounds} rounds:")
    for setup, runs in results.items():
        total, opens, turns = (statistics.median(column) for column in zip(*runs, strict=True))
        print(f"  {setup:<8} {total:6.1f} s {opens:6.2f} s {turns:6.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--load", action="store_true", help="many sessions at once instead")
    parser.add_argument("--setup", nargs="+", default=["2:2", "2:auto", "1:auto"])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--session-turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.load:
        load(args)
        return
    image_b64 = image_source(held_out_samples(1)[0].image)["b64"]
    endpoint = LocalEndpoint(Path(tempfile.mkdtemp(prefix="bench-ep-")), 1, free_ports(1)[0])
    (instance,) = endpoint.start(timeout=180)
    try:
        runtime = endpoint.runtime()
        chat = LlavaClient(NAME, runtime=runtime).open(base64.b64decode(image_b64))
        paths = {
            "direct to TorchServe": RawSession(
                f"{instance.inference_url}/invocations",
                image_b64,
                instance.auth_headers("inference"),
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
