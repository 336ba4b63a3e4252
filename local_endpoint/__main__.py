"""Serve the endpoint in the foreground over already running TorchServe instances.

    python -m local_endpoint --backend instance-0=http://127.0.0.1:8080 [--backend ...]
        [--instance instance-1=DIR:INFERENCE:MANAGEMENT:METRICS ...]
        [--host 127.0.0.1] [--port 8090] [--name stateful-llava] [--part-bytes 0]

A ``--backend`` is only forwarded to, with no key: a container's front, say, not a TorchServe
(which wants its key: docs/serving.md §TorchServe's keys). An ``--instance`` (a READY TorchServe
instance started by serving/torchserve.py from DIR on those ports) is also supervised, and
called with its key: when its worker dies, the whole instance is restarted
(serving/supervisor.py) and gets no requests until READY again.
``make endpoint`` (local_endpoint/launcher.py) starts the instances and this in the background.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from local_endpoint.launcher import instance_env
from local_endpoint.router import Backend, Router
from local_endpoint.server import EndpointServer
from serving.supervisor import Supervisor
from serving.torchserve import TorchServeInstance


def backend_spec(spec: str) -> Backend:
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


def supervised(name: str, ts: TorchServeInstance) -> tuple[Backend, Supervisor]:
    persistent = instance_env(name, dict(os.environ))  # its own directory, or {}: tier off
    ts.env.update(persistent)  # what its restarts get, as at start
    supervisor = Supervisor(ts, log=lambda line: print(f"{name}: {line}", flush=True))
    supervisor.adopt()
    # With the persistent tier, a restart keeps the sessions until the supervisor gives up;
    # without it, a worker's death loses them (the router's SESSION_LOST).
    keeps = (lambda: not supervisor.gave_up) if persistent else None
    backend = Backend(
        name,
        ts.inference_url,
        ready=supervisor.ready,
        supervised=keeps,
        auth=lambda: ts.auth_headers("inference"),
    )
    return backend, supervisor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", type=backend_spec, action="append", default=[])
    parser.add_argument("--instance", type=instance, action="append", default=[])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--name", default="stateful-llava", help="the endpoint's name")
    parser.add_argument(
        "--part-bytes", type=int, default=0, help="split streamed chunks into parts this small"
    )
    args = parser.parse_args(argv)
    watched = [supervised(name, ts) for name, ts in args.instance]
    backends = args.backend + [backend for backend, _ in watched]
    if not backends:
        parser.error("give at least one --backend or --instance")
    router = Router(backends)
    stop = threading.Event()
    for backend, supervisor in watched:  # a dead worker's sessions are lost at once, unless
        if not backend.coming_back():  # the persistent tier brings them back
            supervisor.on_death = lambda backend=backend: router.mark_dead(backend)
        supervisor.watch_in_thread(stop)
    server = EndpointServer((args.host, args.port), args.name, router, args.part_bytes)
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
