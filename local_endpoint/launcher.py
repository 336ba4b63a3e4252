"""Start and stop the local SageMaker-compatible endpoint: N TorchServe instances behind it.

    python -m local_endpoint.launcher start [--instances 2] [--threads auto] [--port 8090]
        [--name stateful-llava] [--run-dir .run/endpoint] [--part-bytes 0] [--timeout 180]
        [--durable-store s3-local|DIR|s3://BUCKET/PREFIX]
    python -m local_endpoint.launcher stop|status [--run-dir .run/endpoint]
    python -m local_endpoint replace --instance N [--run-dir .run/endpoint] [--kill]

``start`` returns once every instance has a READY worker and the endpoint answers ``/ping``;
the instances (``<run-dir>/instance-<i>``, free loopback ports) and the endpoint process keep
running in the background until ``stop``. The endpoint process supervises the instances: one
whose worker dies is restarted whole (serving/supervisor.py) and adopts its sessions from
its own persistent-tier directory, ``<LLAVA_PERSIST_DIR>/instance-<i>`` (instances on one
machine must not adopt each other's sessions; ``LLAVA_PERSIST_DIR=null`` turns the tier off).
LLAVA_* variables in the environment reach the instances (e.g.
``LLAVA_INTAKE='{"allow": ["127.0.0.1"]}'`` for images served on loopback). Each instance
runs torch on its share of the cores (``--threads``, as OMP_NUM_THREADS; ``auto``: the cores
split evenly), it and its restarts alike.

``--durable-store`` gives every instance one shared durable store (LLAVA_DURABLE_STORE):
``s3-local`` starts moto's S3 server on a free loopback port (``python -m moto.server``, its
pid in ``<run-dir>/s3-local.json``; ``stop`` stops it last, after the instances' flush; its
objects live in its memory only), with a bucket, and points the instances' boto3 at it; a
directory or an ``s3://`` URL is passed on as it is (real S3: the caller's AWS credentials).
``replace`` replaces one instance as SageMaker does (local_endpoint/__main__.py ``Slot``),
through the endpoint process's admin route.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from local_endpoint.router import answers_ping
from serving.torchserve import TorchServeError, TorchServeInstance, free_ports, tail

REPO = Path(__file__).resolve().parent.parent

STATE = "endpoint.json"
S3_LOCAL_STATE = "s3-local.json"  # the moto server --durable-store s3-local started
S3_LOCAL_BUCKET = "stateful-llava-local"
# What the instances' boto3 is given for moto (which checks no signature).
S3_LOCAL_AWS = {
    "AWS_ACCESS_KEY_ID": "local",
    "AWS_SECRET_ACCESS_KEY": "local",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# The served archive's persist_dir (model-config.yaml), when LLAVA_PERSIST_DIR does not say.
DEFAULT_PERSIST_DIR = "/dev/shm/stateful-llava"


def thread_share(instances: int, threads: int | None = None) -> int:
    """Torch's threads in each instance: ``threads``, or this process's cores split evenly, at
    least one each. Instances that each ran a thread per core fought over the cores: on 2 cores
    two such instances answered slower than one (docs/performance.md §Endpoint instances and
    cores)."""
    if threads is not None:
        return threads
    return max(1, len(os.sched_getaffinity(0)) // instances)


def parse_threads(value: str) -> int | None:
    """``--threads``: a whole number of at least 1, or ``auto`` (None: :func:`thread_share`)."""
    if value == "auto":
        return None
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"--threads wants auto or a whole number of at least 1, not {value!r}")
    return threads


def instance_env(name: str, environ: dict[str, str]) -> dict[str, str]:
    """The settings one instance gets beside the shared ones: its own persistent-tier
    directory under the shared one (docs/engine/sessions.md §Persistent tier)."""
    base = environ.get("LLAVA_PERSIST_DIR", DEFAULT_PERSIST_DIR)
    if base == "null":
        return {}
    return {"LLAVA_PERSIST_DIR": os.path.join(base, name)}


@dataclass
class LocalEndpoint:
    run_dir: Path
    instances: int = 2
    port: int = 8090
    name: str = "stateful-llava"
    part_bytes: int = 0
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the instances
    threads: int | None = None  # torch threads per instance; None: the cores split evenly
    # None: none. "s3-local" (moto on loopback), a directory, or s3://bucket/prefix
    durable_store: str | None = None
    instances_started: list[TorchServeInstance] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir).absolute()
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, not {self.threads}")

    @property
    def instance_settings(self) -> dict[str, str]:
        """The environment every instance starts with, and restarts with (the endpoint process
        has it, and a restarted instance inherits the endpoint's environment)."""
        threads = thread_share(self.instances, self.threads)
        return {**self.env, "OMP_NUM_THREADS": str(threads)}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def runtime(self, config=None):
        """An unmodified boto3 sagemaker-runtime client for this endpoint (dummy credentials:
        the local endpoint checks no signature)."""
        import boto3  # here, not at the top: the endpoint process imports this module for
        # instance_env alone, and boto3 is most of its import time (~130 ms)

        return boto3.client(
            "sagemaker-runtime",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="local",
            aws_secret_access_key="local",
            config=config,
        )

    @property
    def log(self) -> Path:
        return self.run_dir / "endpoint.log"

    def start(self, timeout: float = 180.0) -> list[TorchServeInstance]:
        if self.server_pid() is not None:
            raise TorchServeError(f"the endpoint already runs from {self.run_dir}: stop it first")
        check_port_free(self.port)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.durable_store:
                self.env = {**self.env, **self._durable_store_env()}
            settings = self.instance_settings
            shared = {**os.environ, **settings}
            instances = [
                TorchServeInstance.on_free_ports(
                    self.run_dir / f"instance-{i}",
                    env={**settings, **instance_env(f"instance-{i}", shared)},
                )
                for i in range(self.instances)
            ]
            with ThreadPoolExecutor(len(instances)) as pool:  # they load their models at once
                list(pool.map(lambda ts: ts.start(timeout), instances))
            self.instances_started = instances
            self._spawn_server(instances, timeout=30.0)
        except BaseException:
            self.stop()
            raise
        return instances

    def _durable_store_env(self) -> dict[str, str]:
        store = self.durable_store
        if store == "s3-local":
            return start_s3_local(self.run_dir)
        if store.startswith("s3://"):
            return {"LLAVA_DURABLE_STORE": store}
        directory = Path(store).absolute()  # shared by the instances, as EFS would be
        directory.mkdir(parents=True, exist_ok=True)
        return {"LLAVA_DURABLE_STORE": str(directory)}

    def replace(self, instance: str, kill: bool = False, timeout: float = 300.0) -> dict:
        """Replace one instance (``instance-<i>``) through the running endpoint; what it did."""
        return replace_instance(self.url, instance, kill, timeout)

    def _spawn_server(self, instances: list[TorchServeInstance], timeout: float) -> None:
        supervised = [  # the endpoint restarts an instance whose worker dies (serving/supervisor)
            f"--instance=instance-{i}={ts.root}:{ts.inference_port}:{ts.management_port}:"
            f"{ts.metrics_port}"
            for i, ts in enumerate(instances)
        ]
        with open(self.log, "wb") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "local_endpoint", "--port", str(self.port)]
                + ["--name", self.name, "--part-bytes", str(self.part_bytes), *supervised],
                cwd=REPO,
                env={**os.environ, **self.instance_settings},  # what a restart's workers get
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives `make endpoint`
            )
        (self.run_dir / STATE).write_text(json.dumps({"pid": server.pid, "port": self.port}))
        deadline = time.monotonic() + timeout
        while not answers_ping(self.url):
            if server.poll() is not None or time.monotonic() > deadline:
                raise TorchServeError(f"the endpoint did not come up:\n{tail(self.log, 20)}")
            time.sleep(0.1)

    def server_pid(self) -> int | None:
        try:
            pid = json.loads((self.run_dir / STATE).read_text())["pid"]
            if "local_endpoint" in psutil.Process(pid).cmdline():
                return pid
        except (OSError, ValueError, KeyError, psutil.Error):
            pass
        return None

    def stop(self) -> None:
        """Stop the endpoint (first: its supervisors must restart nothing), every instance
        under the run dir (at once: each worker's SIGTERM flush may take seconds), then the
        local S3 they flushed to; stopped is fine."""
        if (pid := self.server_pid()) is not None:
            _terminate(psutil.Process(pid))
        (self.run_dir / STATE).unlink(missing_ok=True)
        dirs = sorted(self.run_dir.glob("instance-*"))
        if dirs:
            with ThreadPoolExecutor(len(dirs)) as pool:  # each finds its processes by directory
                list(pool.map(lambda d: TorchServeInstance(d).stop(), dirs))
        stop_s3_local(self.run_dir)


def _terminate(proc: psutil.Process) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_s3_local(run_dir: Path, timeout: float = 30.0) -> dict[str, str]:
    """Start moto's S3 server on a free loopback port, in the background (it outlives `make
    endpoint`; ``stop_s3_local`` ends it), make the bucket; the instances' settings for it."""
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    with open(run_dir / "s3-local.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            cwd=run_dir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (run_dir / S3_LOCAL_STATE).write_text(json.dumps({"pid": server.pid, "url": url}))
    deadline = time.monotonic() + timeout
    while not _answers(url):
        if server.poll() is not None or time.monotonic() > deadline:
            raise TorchServeError(f"moto's S3 server did not come up:\n{tail(log.name, 20)}")
        time.sleep(0.1)
    import boto3  # only here: see runtime()

    s3 = boto3.client("s3", endpoint_url=url, **_boto3_dummies())
    s3.create_bucket(Bucket=S3_LOCAL_BUCKET)
    return {
        "LLAVA_DURABLE_STORE": f"s3://{S3_LOCAL_BUCKET}/sessions",
        "AWS_ENDPOINT_URL_S3": url,
        **S3_LOCAL_AWS,
    }


def _boto3_dummies() -> dict[str, str]:
    return {
        "region_name": S3_LOCAL_AWS["AWS_DEFAULT_REGION"],
        "aws_access_key_id": S3_LOCAL_AWS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": S3_LOCAL_AWS["AWS_SECRET_ACCESS_KEY"],
    }


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False


def stop_s3_local(run_dir: Path) -> None:
    """Stop the moto server ``start_s3_local`` started from ``run_dir``, if it runs."""
    state = run_dir / S3_LOCAL_STATE
    try:
        proc = psutil.Process(json.loads(state.read_text())["pid"])
        if "moto.server" in proc.cmdline():
            _terminate(proc)
    except (OSError, ValueError, KeyError, psutil.Error):
        pass
    state.unlink(missing_ok=True)


def endpoint_url(run_dir: Path) -> str:
    """The running endpoint's URL, from the state file ``start`` wrote in ``run_dir``."""
    try:
        return f"http://127.0.0.1:{json.loads((run_dir / STATE).read_text())['port']}"
    except (OSError, ValueError, KeyError):
        raise TorchServeError(f"no endpoint runs from {run_dir} (make endpoint)") from None


def replace_instance(url: str, instance: str, kill: bool, timeout: float) -> dict:
    """POST the endpoint's admin route (local_endpoint/server.py): it answers once the fresh
    instance is READY, with what it did; its refusal's message otherwise."""
    name = f"instance-{instance}" if instance.isdigit() else instance
    request = urllib.request.Request(
        f"{url}/local-admin/instances/{urllib.parse.quote(name)}/replace?kill={int(kill)}",
        method="POST",
        data=b"",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as refused:
        with refused:
            message = json.loads(refused.read() or b"{}").get("message", refused.reason)
        raise TorchServeError(f"replace {name}: {refused.code} {message}") from None
    except OSError as e:
        why = f"replace {name}: the endpoint at {url} did not answer: {e}"
        raise TorchServeError(why) from None


def replace_main(argv: list[str]) -> int:
    """``python -m local_endpoint replace``: replace one instance of the running endpoint."""
    parser = argparse.ArgumentParser(
        prog="python -m local_endpoint replace",
        description="Replace one instance as SageMaker does: stop it entirely, empty its disk, "
        "forget its sessions, start a fresh one; returns once that one is READY.",
    )
    parser.add_argument("--instance", required=True, help="its index (0) or name (instance-0)")
    parser.add_argument("--run-dir", default=REPO / ".run" / "endpoint", type=Path)
    parser.add_argument("--kill", action="store_true", help="SIGKILL at once (a hardware fault)")
    parser.add_argument("--timeout", default=300.0, type=float, help="seconds to wait in all")
    args = parser.parse_args(argv)
    try:
        done = replace_instance(endpoint_url(args.run_dir), args.instance, args.kill, args.timeout)
    except TorchServeError as e:
        print(f"endpoint_ctl replace: {e}", file=sys.stderr)
        return 1
    print(
        f"{done['instance']} replaced ({'killed' if done['killed'] else 'graceful'}): stopped in "
        f"{done['stoppedS']:.1f} s, READY in {done['readyS']:.1f} s, "
        f"{done['sessionsLost']} session(s) forgotten"
    )
    return 0


def check_port_free(port: int) -> None:
    # SO_REUSEADDR as the server itself binds (http.server does): a port whose last server
    # just stopped, its sockets in TIME_WAIT, is free for it, and `make stop && make endpoint`
    # must not wait a minute for them to expire.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise TorchServeError(f"port {port} is in use (another endpoint?)") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument("--run-dir", default=REPO / ".run" / "endpoint", type=Path)
    parser.add_argument("--instances", default=2, type=int)
    parser.add_argument("--threads", default="auto", help="torch threads per instance, or auto")
    parser.add_argument("--port", default=8090, type=int)
    parser.add_argument("--name", default="stateful-llava")
    parser.add_argument("--part-bytes", default=0, type=int, help="split streamed chunks")
    parser.add_argument("--timeout", default=180.0, type=float, help="start: seconds to READY")
    parser.add_argument(
        "--durable-store", default="", help="start: s3-local, a directory, or s3://bucket/prefix"
    )
    args = parser.parse_args(argv)
    if args.instances < 1:
        parser.error("--instances must be at least 1")
    try:
        threads = parse_threads(args.threads)
    except ValueError as e:  # one line, before anything starts
        print(f"endpoint_ctl {args.command}: {e}", file=sys.stderr)
        return 1
    endpoint = LocalEndpoint(
        args.run_dir,
        args.instances,
        args.port,
        args.name,
        args.part_bytes,
        threads=threads,
        durable_store=args.durable_store or None,
    )
    actions = {
        "start": lambda: _start(endpoint, args.timeout),
        "stop": lambda: _stop(endpoint),
        "status": lambda: _status(endpoint),
    }
    try:
        return actions[args.command]()
    except TorchServeError as e:
        print(f"endpoint_ctl {args.command}: {e}", file=sys.stderr)
        return 1


def _start(endpoint: LocalEndpoint, timeout: float) -> int:
    began = time.monotonic()
    urls = ", ".join(ts.inference_url for ts in endpoint.start(timeout))
    threads = endpoint.instance_settings["OMP_NUM_THREADS"]
    print(
        f"endpoint {endpoint.name} READY in {time.monotonic() - began:.1f} s at {endpoint.url} "
        f"over TorchServe {urls} ({threads} torch thread(s) each); logs in {endpoint.run_dir}"
    )
    return 0


def _stop(endpoint: LocalEndpoint) -> int:
    endpoint.stop()
    print(f"endpoint stopped ({endpoint.run_dir})")
    return 0


def _status(endpoint: LocalEndpoint) -> int:
    pid = endpoint.server_pid()
    print(f"endpoint: pid {pid}" if pid else "endpoint: not running")
    return 0 if pid else 1


if __name__ == "__main__":
    sys.exit(main())
