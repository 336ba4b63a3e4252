"""The demo: a real TorchServe serving the demo model, a real image URL, a real chat.

Starts TorchServe with model-store/llava.mar on free loopback ports, serves a held-out
synthetic image from a loopback HTTP server, opens a session on its URL, asks three
questions (the last one only makes sense with the previous turn), prints each answer with
its latency and cached/new token counts, closes the session and stops TorchServe.
Exits non-zero if an answer is wrong.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

from demo_model.synthetic import held_out_samples
from llava_wire import CLOSE_SESSION, CLOSED_SESSION_HEADER, NEW_SESSION, SESSION, SESSION_HEADER
from serving.torchserve import TorchServeInstance

REPO = Path(__file__).resolve().parent.parent

QUESTIONS = [
    ("What shape is it?", "shape"),
    ("And its color?", "color"),  # a follow-up: "its" refers to the previous turn
    ("Say that again.", "color"),
]


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def serve_directory(directory: Path) -> ThreadingHTTPServer:
    handler = functools.partial(QuietHandler, directory=str(directory))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def invoke(
    instance: TorchServeInstance, body: dict, session_id: str
) -> tuple[requests.Response, float]:
    headers = {"Content-Type": "application/json", SESSION_HEADER: session_id}
    start = time.perf_counter()
    reply = requests.post(
        f"{instance.inference_url}/invocations",
        data=json.dumps(body),
        timeout=60,
        headers={**headers, **instance.auth_headers("inference")},
    )
    elapsed_ms = (time.perf_counter() - start) * 1000
    if reply.status_code != 200:
        raise SystemExit(f"{body['requestType']} failed: {reply.status_code} {reply.text}")
    return reply, elapsed_ms


def chat(base: TorchServeInstance, image_url: str, truth) -> bool:
    reply, ms = invoke(base, {"requestType": NEW_SESSION, "image": {"url": image_url}}, NEW_SESSION)
    opened = reply.json()
    session_id = opened["sessionId"]
    print(
        f"open   {ms:7.1f} ms  session {session_id} (expires {opened['expiresAt']}), "
        f"{opened['imageTokens']} image tokens prefilled once"
    )
    all_right = True
    for question, attribute in QUESTIONS:
        body = {"requestType": SESSION, "inputs": question}
        answer, ms = invoke(base, body, session_id)
        answer = answer.json()
        text, usage = answer["generation"]["text"], answer["usage"]
        right = text == getattr(truth, attribute)
        all_right &= right
        print(
            f"ask    {ms:7.1f} ms  Q: {question:<26} A: {text:<8} "
            f"{'(right)' if right else '(WRONG, expected ' + getattr(truth, attribute) + ')'}"
            f"  new tokens {usage['newTokens']:>3}, cached {usage['cachedTokens']:>3}"
        )
    reply, ms = invoke(base, {"requestType": CLOSE_SESSION}, session_id)
    print(f"close  {ms:7.1f} ms  {reply.headers[CLOSED_SESSION_HEADER]}")
    return all_right


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=31_337, help="which held-out image")
    args = parser.parse_args()
    sample = held_out_samples(1, seed=args.seed)[0]
    with tempfile.TemporaryDirectory(prefix="llava-demo-") as tmp:
        sample.image.save(Path(tmp) / "shape.png")
        httpd = serve_directory(Path(tmp))
        image_url = f"http://127.0.0.1:{httpd.server_address[1]}/shape.png"
        instance = TorchServeInstance.on_free_ports(
            REPO / ".run" / "demo",
            # the default intake policy refuses loopback; the demo image is on loopback
            env={"LLAVA_INTAKE": json.dumps({"allow": ["127.0.0.1"]})},
        )
        start = time.perf_counter()
        instance.start(timeout=180)
        print(
            f"TorchServe READY in {time.perf_counter() - start:.1f} s "
            f"at {instance.inference_url}; image at {image_url} "
            f"(a {sample.color} {sample.shape})"
        )
        try:
            ok = chat(instance, image_url, sample)
        finally:
            instance.stop()
            httpd.shutdown()
    print("all answers right" if ok else "SOME ANSWERS WERE WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
