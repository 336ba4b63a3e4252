"""Serve the endpoint in the foreground over already running TorchServe instances.

    python -m local_endpoint --backend instance-0=http://127.0.0.1:8080 [--backend ...]
        [--instance instance-1=DIR:INFERENCE:MANAGEMENT:METRICS ...]
        [--host 127.0.0.1] [--port 8090] [--name stateful-llava] [--part-bytes 0]
    python -m local_endpoint replace --instance N [--run-dir .run/endpoint] [--kill]

A ``--backend`` is only forwarded to, with no key: a container's front, say, not a TorchServe
(which wants its key: docs/serving.md §TorchServe's keys). An ``--instance`` (a READY TorchServe
instance started by serving/torchserve.py from DIR on those ports) is also supervised, and
called with its key: when its worker dies, the whole instance is restarted
(serving/supervisor.py) and gets no requests until READY again. It can also be replaced, as
SageMaker replaces an instance (``Slot.replace``; ``replace``: local_endpoint/launcher.py).
``make endpoint`` (local_endpoint/launcher.py) starts the instances and this in the background.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from local_endpoint.launcher import instance_env, replace_main
from local_endpoint.router import Backend, Router
from local_endpoint.server import EndpointServer, Rejected
from serving.supervisor import Supervisor
from serving.torchserve import WORKER_FLUSH_S, TorchServeError, TorchServeInstance

# SageMaker SIGKILLs a container 30 s after its SIGTERM: a graceful replace gives the workers
# WORKER_FLUSH_S of that, Java the rest, then kills what is left.
SIGKILL_AFTER_S = 30.0
REPLACED = "which was replaced"  # how its sessions were lost (the router's SESSION_LOST message)


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


class Slot:
    """One supervised instance as the router sees it, and what replaces it.

    With the persistent tier, a restart keeps the sessions until the supervisor gives up;
    without it, a worker's death loses them (the router's SESSION_LOST). While it is being
    replaced it takes no new work and its sessions' calls get 503 NOT_READY (the client waits
    and asks again) until it has stopped; then they are lost.
    """

    def __init__(self, name: str, ts: TorchServeInstance):
        self.name, self.ts = name, ts
        self.persistent = instance_env(name, dict(os.environ))  # its own directory, or {}
        ts.env.update(self.persistent)  # what its restarts get, as at start
        self.replacing = False
        self._replace_lock = threading.Lock()
        self.supervisor = self._supervisor()
        self.supervisor.adopt()
        self.backend = Backend(
            name,
            ts.inference_url,
            ready=self.ready,
            supervised=self.keeps,
            auth=lambda: ts.auth_headers("inference"),
        )
        self.router: Router | None = None
        self._watching = threading.Event()
        self._thread: threading.Thread | None = None

    def _supervisor(self) -> Supervisor:
        return Supervisor(self.ts, log=lambda line: print(f"{self.name}: {line}", flush=True))

    def ready(self) -> bool:
        return not self.replacing and self.supervisor.ready()

    def keeps(self) -> bool:
        """Whether its sessions are still its own: it is being replaced (not stopped yet), or
        its supervisor brings them back with the persistent tier."""
        return self.replacing or (bool(self.persistent) and not self.supervisor.gave_up)

    def watch(self, router: Router) -> None:
        self.router = router
        if not self.persistent:  # a dead worker's sessions are lost at once
            self.supervisor.on_death = lambda: router.mark_dead(self.backend)
        self._watching = threading.Event()
        self._thread = self.supervisor.watch_in_thread(self._watching)

    def close(self) -> None:
        self._watching.set()

    def replace(self, kill: bool) -> dict:
        """Replace the instance as SageMaker does on scale-in, an UpdateEndpoint or a hardware
        fault: stop it entirely (graceful: its workers' SIGTERM, then SIGKILL what is left 30 s
        later; ``kill``: SIGKILL at once), empty its disk (persistent tier, TorchServe's tmp),
        forget its sessions, start a fresh instance on it; return once that one is READY."""
        if not self._replace_lock.acquire(blocking=False):
            raise Rejected(409, "ConflictException", f"{self.name} is being replaced already")
        try:
            return self._replace(kill)
        finally:
            self._replace_lock.release()

    def _replace(self, kill: bool) -> dict:
        assert self.router is not None, "watch() first"
        began = time.monotonic()
        self.replacing = True
        try:
            self._watching.set()  # its supervisor restarts nothing from now on
            if self._thread is not None:
                self._thread.join()  # at most the restart it may be in (bounded by its start)
            how = "SIGKILL" if kill else "SIGTERM to its workers, SIGKILL what is left 30 s on"
            print(f"{self.name}: replacing: stopping it ({how})", flush=True)
            self.ts.stop(SIGKILL_AFTER_S - WORKER_FLUSH_S, graceful=not kill)
            stopped_s = time.monotonic() - began
            lost = self.router.mark_dead(self.backend, REPLACED)
            for disk in (self.persistent.get("LLAVA_PERSIST_DIR"), self.ts.tmp_dir):
                if disk:
                    shutil.rmtree(disk, ignore_errors=True)
            self.supervisor = self._supervisor()
            pid = self.supervisor.start()
        except TorchServeError as e:
            self.supervisor.gave_up = True  # left down, as a supervisor that gave up leaves it
            print(f"{self.name}: replace failed: {e}", flush=True)
            why = f"{self.name}: {str(e).splitlines()[0]}"
            raise Rejected(500, "InternalFailure", why) from None
        finally:
            self.replacing = False
        self.watch(self.router)
        done = {
            "instance": self.name,
            "killed": kill,
            "sessionsLost": lost,
            "stoppedS": round(stopped_s, 3),
            "readyS": round(time.monotonic() - began, 3),
            "workerPid": pid,
        }
        print(f"{self.name}: replaced: {done}", flush=True)
        return done


def replacer(slots: list[Slot]):
    """The admin route's work (local_endpoint/server.py): replace the instance named."""
    by_name = {slot.name: slot for slot in slots}

    def replace(name: str, kill: bool) -> dict:
        if name not in by_name:
            known = ", ".join(by_name) or "none"
            raise Rejected(404, "ResourceNotFound", f"no replaceable instance {name!r} ({known})")
        return by_name[name].replace(kill)

    return replace


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["replace"]:
        return replace_main(argv[1:])
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
    slots = [Slot(name, ts) for name, ts in args.instance]
    backends = args.backend + [slot.backend for slot in slots]
    if not backends:
        parser.error("give at least one --backend or --instance")
    router = Router(backends)
    for slot in slots:
        slot.watch(router)
    server = EndpointServer(
        (args.host, args.port), args.name, router, args.part_bytes, replace=replacer(slots)
    )
    names = ", ".join(f"{b.name}={b.url}" for b in backends)
    print(f"endpoint {args.name} on http://{args.host}:{args.port} over {names}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        for slot in slots:
            slot.close()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
