"""Serve the endpoint in the foreground over already running TorchServe instances.

    python -m local_endpoint --backend instance-0=http://127.0.0.1:8080 [--backend ...]
        [--host 127.0.0.1] [--port 8090] [--name stateful-llava] [--part-bytes 0]

``make endpoint`` (scripts/endpoint_ctl.py) starts the instances and this in the background.
"""

from __future__ import annotations

import argparse
import sys

from local_endpoint.router import Backend, Router
from local_endpoint.server import EndpointServer


def backend(spec: str) -> Backend:
    name, sep, url = spec.partition("=")
    if not sep or not url.startswith("http://"):
        raise argparse.ArgumentTypeError(f"--backend wants NAME=http://HOST:PORT, not {spec!r}")
    return Backend(name, url.rstrip("/"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", type=backend, action="append", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--name", default="stateful-llava", help="the endpoint's name")
    parser.add_argument(
        "--part-bytes", type=int, default=0, help="split streamed chunks into parts this small"
    )
    args = parser.parse_args(argv)
    server = EndpointServer(
        (args.host, args.port), args.name, Router(args.backend), args.part_bytes
    )
    names = ", ".join(f"{b.name}={b.url}" for b in args.backend)
    print(f"endpoint {args.name} on http://{args.host}:{args.port} over {names}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
