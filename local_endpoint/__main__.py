"""Serve the endpoint in the foreground over already running TorchServe instances.

    python -m local_endpoint --backend instance-0=http://127.0.0.1:8080 [--backend ...]
        [--instance instance-1=DIR:INFERENCE:MANAGEMENT:METRICS ...]
        [--host 127.0.0.1] [--port 8090] [--name stateful-llava] [--part-bytes 0]

A ``--backend`` is only forwarded to. An ``--instance`` (a READY TorchServe instance started
by serving/torchserve.py from DIR on those ports) is also supervised: when its worker dies,
the whole instance is restarted (serving/supervisor.py) and gets no requests until READY again.
``make endpoint`` (local_endpoint/launcher.py) starts the instances and this in the background.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from local_endpoint.router import Backend, Router
from local_endpoint.server import EndpointServer
from serving.supervisor import Supervisor
from serving.torchserve import TorchServeInstance


def backend(spec: str) -> Backend:
    name, sep, url = spec.partition("=")
    if not sep or not url.startswith("http://"):
        raise argparse.ArgumentTypeError(f"--backend wants NAME=http://HOST:PORT, not {spec!r}")
    return Backend(name, url.rstrip("/"))


def instance(spec: str) -> tuple[str, TorchServeInstance]:
    name, _, where = spec.partition("=")
    try:
        root, *ports = where.rsplit(":", 3)
        return name, TorchServeInstance(Path(root), *(int(p) for p in ports))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"--instance wants NAME=DIR:INFERENCE:MANAGEMENT:METRICS, not {spec!r}"
        ) from None


def supervised(name: str, ts: TorchServeInstance, stop: threading.Event) -> Backend:
    supervisor = Supervisor(ts, log=lambda line: print(f"{name}: {line}", flush=True))
    supervisor.adopt()
    supervisor.watch_in_thread(stop)
    return Backend(name, ts.inference_url, ready=supervisor.ready)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", type=backend, action="append", default=[])
    parser.add_argument("--instance", type=instance, action="append", default=[])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--name", default="stateful-llava", help="the endpoint's name")
    parser.add_argument(
        "--part-bytes", type=int, default=0, help="split streamed chunks into parts this small"
    )
    args = parser.parse_args(argv)
    stop = threading.Event()
    backends = args.backend + [supervised(name, ts, stop) for name, ts in args.instance]
    if not backends:
        parser.error("give at least one --backend or --instance")
    server = EndpointServer((args.host, args.port), args.name, Router(backends), args.part_bytes)
    names = ", ".join(f"{b.name}={b.url}" for b in backends)
    print(f"endpoint {args.name} on http://{args.host}:{args.port} over {names}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
