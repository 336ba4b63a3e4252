"""Start, stop and inspect one TorchServe instance serving one .mar.

Why not plain ``torchserve --start``: it returns before Java has bound a port, even if Java
dies a second later; ``/ping`` says Healthy before the model is loaded and while its worker
crash-loops; and instances sharing a $TMPDIR share the pid file, the worker sockets and the
extracted archives. So an instance owns a directory (``tmp/`` as TMPDIR/TEMP, ``logs/``,
``torchserve.out``) and its ports, and ``start`` returns only once the management API reports
a READY worker that is a child of this instance's Java process.

    python -m serving.torchserve start|stop|status [--instance-dir .run/llava]
        [--inference-port 8080 --management-port 8081 --metrics-port 8082] [--timeout 180]
    python -m serving.torchserve auth inference|management [--instance-dir .run/llava]

Ports reach TorchServe as TS_*_ADDRESS environment variables (config.properties sets
enable_envvars_config=true), so every instance shares the one config.properties; so do the
archive URLs the management API may fetch (TS_ALLOWED_URLS: only the instance's model store).

Token authorization is on: every call to the inference or management API carries the key that
the instance's TorchServe wrote at start (``auth_headers``). A shell gets it with

    curl -H "$(python -m serving.torchserve auth inference)" http://127.0.0.1:8080/...
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
TORCHSERVE = Path(sys.executable).parent / "torchserve"
JAVA_MAIN = "org.pytorch.serve.ModelServer"
UNIX_PATH_MAX = 107  # worker sockets are $TMPDIR/.ts.sock.<port>; longer paths fail to bind
# The one line a worker logs when a setting is bad (llava.config.SettingsError): TorchServe
# would restart that worker forever, so the first one ends the start.
SETTINGS_ERROR = re.compile(r"SettingsError: (.+)$", re.MULTILINE)
READY_POLL_S = 0.05  # the management API, asked while a worker loads: a restart waits on it
# TorchServe 0.12 writes its keys here, in its working directory, when it starts with token
# authorization on; `torchserve --stop` deletes the one in its own working directory.
KEY_FILE = "key_file.json"
API = Literal["inference", "management"]
WORKER_SCRIPT = "model_service_worker.py"  # what a TorchServe worker process runs
# How long a stop waits for the workers to exit after their SIGTERM: the engine's flush of its
# dirty sessions (durable_flush_s, 20 s) and a margin, within the 30 s SageMaker gives a
# container between its SIGTERM and its SIGKILL (docs/serving.md §TorchServe 0.12 facts).
WORKER_FLUSH_S = 25.0


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all bound at once, so none is handed out twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


class TorchServeError(RuntimeError):
    """TorchServe did not come up (or go down) as asked; the message carries the logs' tail."""


@dataclass
class TorchServeInstance:
    root: Path
    inference_port: int = 8080
    management_port: int = 8081
    metrics_port: int = 8082
    model_store: Path = ROOT / "model-store"
    mar_name: str = "llava"
    ts_config: Path = ROOT / "config.properties"
    host: str = "127.0.0.1"  # the address TorchServe binds; we always poll via 127.0.0.1
    env: dict[str, str] = field(default_factory=dict)  # extra environment, e.g. LLAVA_* settings
    # The keys as last read, with the key file's (inode, mtime, size) then.
    _keys: tuple[tuple[int, int, int], dict[str, str]] | None = field(
        default=None, init=False, repr=False
    )

    @classmethod
    def on_free_ports(cls, root: Path, **settings) -> TorchServeInstance:
        """An instance whose three ports are free now: for tests, demos and benchmarks."""
        inference, management, metrics = free_ports(3)
        return cls(root, inference, management, metrics, **settings)

    def __post_init__(self) -> None:
        self.root = Path(self.root).absolute()
        self.model_store = Path(self.model_store).absolute()
        if len(f"{self.tmp_dir}/.ts.sock.65535") > UNIX_PATH_MAX:
            raise ValueError(f"instance dir too long for a unix socket path: {self.root}")

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    @property
    def key_file(self) -> Path:
        return self.root / KEY_FILE

    @property
    def workflow_store(self) -> Path:
        """Empty and read-only: nothing to register by name, nowhere to download to."""
        return self.root / "workflow-store"

    @property
    def started_worker_file(self) -> Path:
        """The pid of the worker that ``start`` saw READY: ``status`` tells if it died."""
        return self.root / "worker.pid"

    @property
    def inference_url(self) -> str:
        return f"http://127.0.0.1:{self.inference_port}"

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.management_port}"

    def start(self, timeout: float = 180.0) -> int:
        """Start TorchServe and wait until its worker is READY; return the worker's pid."""
        if (pid := self.java_pid()) is not None:
            raise TorchServeError(f"already running (pid {pid}) in {self.root}: stop it first")
        mar = self.model_store / f"{self.mar_name}.mar"
        if not mar.is_file():
            raise TorchServeError(f"{mar} not found (make mar)")
        # Private: TorchServe writes the key file with the umask's mode, then makes it 0600.
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)
        self.key_file.unlink(missing_ok=True)  # a killed instance leaves its old keys
        # ... and its extracted archives (root ignores the workflow store's mode: emptied too)
        for d in (self.tmp_dir, self.log_dir, self.workflow_store):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        self.workflow_store.chmod(0o555)
        # Appended: a supervisor's restart (serving/supervisor.py) keeps one console log.
        with open(self.root / "torchserve.out", "ab") as out:
            launched = subprocess.run(
                [
                    TORCHSERVE,
                    "--start",
                    "--ncs",
                    "--ts-config",
                    self.ts_config,
                    "--model-store",
                    self.model_store,
                    "--workflow-store",
                    self.workflow_store,
                    "--models",
                    f"{self.mar_name}={mar.name}",
                ],
                env=self._env(),
                cwd=self.root,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        if launched.returncode != 0:
            raise self._failure(f"torchserve --start exited with {launched.returncode}")
        try:
            pid = self.wait_ready(timeout)
        except TorchServeError:
            self.stop()
            raise
        self.started_worker_file.write_text(str(pid))
        return pid

    def wait_ready(self, timeout: float = 180.0) -> int:
        """Poll the management API until a worker of ours is READY; return its pid.

        Fails with the logs' tail when Java has exited, when a worker refused a setting (at
        once, the setting's line first), when a worker died before it was READY (in async mode
        TorchServe would wait 10 minutes before retrying; a sync worker would be retried for
        ever), or after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        worker_pids: set[int] = set()
        while True:
            java = self.java_pid()
            if java is None:
                raise self._failure("TorchServe exited")
            workers = self.workers()
            if (pid := _ready_pid(workers, java)) is not None:
                return pid
            if bad_setting := SETTINGS_ERROR.search(tail(self.log_dir / "model_log.log", 200)):
                raise self._failure(bad_setting.group(1))
            worker_pids.update(w["pid"] for w in workers if w["pid"] > 0)
            # Async mode retries a failed load only after 10 minutes, sync mode for ever.
            if any(not alive(pid) for pid in worker_pids):
                raise self._failure("worker crash loop: the worker died loading the model")
            if time.monotonic() > deadline:
                raise self._failure(f"no READY worker after {timeout:.0f} s")
            time.sleep(READY_POLL_S)

    def stop(
        self, timeout: float = 60.0, graceful: bool = True, flush_s: float = WORKER_FLUSH_S
    ) -> None:
        """Stop gracefully (unless told not to: then at once), then kill whatever of this
        instance is left; stopped is fine.

        Graceful: the workers first get a SIGTERM and up to ``flush_s`` to exit (a worker
        flushes its dirty sessions to the durable store then), and only then does Java get
        ``torchserve --stop``: that SIGKILLs the workers (measured: Java's shutdown kills its
        workers with SIGKILL, never a SIGTERM), so a worker's own SIGTERM has to come first.
        """
        if graceful:
            self.terminate_workers(flush_s)
        procs = self.processes()
        if graceful and self.java_pid() is not None:  # SIGTERM to Java; we wait, bounded, below
            subprocess.run(
                [TORCHSERVE, "--stop"],
                env=self._env(),
                cwd=self.root,
                stdout=subprocess.DEVNULL,
                check=False,
            )
        left = _running_after(procs, timeout if graceful else 0)
        # ... and any worker Java spawned meanwhile (it restarts one ~1 s after one exits)
        known = {p.pid for p in procs}
        left += [p for p in self.processes() if p.pid not in known]
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        left = _running_after(left, 10)
        if left:
            raise TorchServeError(f"processes left after kill: {[p.pid for p in left]}")
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        self.key_file.unlink(missing_ok=True)  # what `torchserve --stop` does, killed or not

    def terminate_workers(self, timeout: float = WORKER_FLUSH_S) -> list[int]:
        """SIGTERM this instance's Python workers and wait, at most ``timeout`` s, for them to
        exit; return the pids of those still running then (``stop`` kills them)."""
        workers = [p for p in self.processes() if _is_worker(p)]
        for proc in workers:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        return [p.pid for p in _running_after(workers, timeout)]

    def auth_headers(self, api: API) -> dict[str, str]:
        """The ``Authorization`` header for TorchServe's ``api``, from the key file this
        instance's TorchServe wrote at start; read again only when the file changes (each
        start writes new keys, whichever process restarts the instance). No header while there
        is none yet (the call then gets TorchServe's 400)."""
        try:
            found = self.key_file.stat()
        except OSError:
            return {}
        version = (found.st_ino, found.st_mtime_ns, found.st_size)
        cached = self._keys
        if cached is None or cached[0] != version:
            try:
                written = json.loads(self.key_file.read_text())
                keys = {name: written[name]["key"] for name in ("inference", "management")}
            except (OSError, ValueError, LookupError, TypeError):  # gone, or half written
                return {}
            cached = self._keys = (version, keys)
        return {"Authorization": f"Bearer {cached[1][api]}"}

    def java_pid(self) -> int | None:
        """The frontend's pid from this instance's pid file, if that process still runs."""
        try:
            proc = psutil.Process(int((self.tmp_dir / ".model_server.pid").read_text()))
            if proc.status() != psutil.STATUS_ZOMBIE and JAVA_MAIN in proc.cmdline():
                return proc.pid
        except (OSError, ValueError, psutil.Error):
            pass
        return None

    def workers(self) -> list[dict]:
        """The model's workers as the management API lists them; [] while it doesn't answer."""
        try:
            reply = requests.get(
                f"{self.management_url}/models/{self.mar_name}",
                headers=self.auth_headers("management"),
                timeout=5,
            )
            reply.raise_for_status()
            return reply.json()[0]["workers"]
        except (requests.RequestException, ValueError, LookupError):
            return []

    def worker_pid(self) -> int | None:
        """The READY python worker's pid (where the sessions live), or None."""
        return _ready_pid(self.workers(), self.java_pid())

    def _env(self) -> dict[str, str]:
        tmp, logs = str(self.tmp_dir), str(self.log_dir)
        # Workers inherit this environment, and a PYTHONPATH comes before the extracted .mar
        # on their sys.path: a checkout's llava/ would be served instead of the archive's.
        inherited = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return {
            **inherited,
            "TMPDIR": tmp,
            "TEMP": tmp,
            "TMP": tmp,
            "LOG_LOCATION": logs,
            "METRICS_LOCATION": logs,
            "TS_INFERENCE_ADDRESS": f"http://{self.host}:{self.inference_port}",
            "TS_MANAGEMENT_ADDRESS": f"http://{self.host}:{self.management_port}",
            "TS_METRICS_ADDRESS": f"http://{self.host}:{self.metrics_port}",
            "TS_ALLOWED_URLS": allowed_urls(self.model_store),
            # On whatever the inherited environment says (it wins over config.properties):
            # every caller sends the key, and auth_headers needs the key file.
            "TS_DISABLE_TOKEN_AUTHORIZATION": "false",
            **self.env,
        }

    def processes(self) -> list[psutil.Process]:
        """Java and workers of this instance, found by their tmp dir (also once orphaned)."""
        own = (f"-Djava.io.tmpdir={self.tmp_dir}", f"{self.tmp_dir}/.ts.sock.")
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            if any(arg.startswith(own) for arg in proc.info["cmdline"] or ()):
                found.append(proc)
                found.extend(_children(proc))
        return list({p.pid: p for p in found}.values())

    def _failure(self, reason: str) -> TorchServeError:
        logs = ((self.root / "torchserve.out", 30), (self.log_dir / "model_log.log", 50))
        tails = "".join(f"\n--- {path} (last {n} lines) ---\n{tail(path, n)}" for path, n in logs)
        return TorchServeError(f"{reason}{tails}")


def allowed_urls(model_store: Path) -> str:
    """TorchServe's allowed_urls (Java regexes, comma-separated): an archive directly in the
    model store, by a name that cannot be ``..``."""
    return f"file://{re.escape(str(model_store))}/[^/.][^/]*\\.mar".replace(",", r"\x2c")


def _ready_pid(workers: list[dict], java: int | None) -> int | None:
    """The first live READY worker that Java started: not another server's answering on our
    port, nor a killed one that Java has not reaped yet (the API says READY a while longer)."""
    for w in workers:
        try:
            if w["status"] != "READY" or not java:
                continue
            if psutil.Process(w["pid"]).ppid() == java and alive(w["pid"]):
                return w["pid"]
        except psutil.Error:
            pass
    return None


def _is_worker(proc: psutil.Process) -> bool:
    try:
        return any(arg.endswith(WORKER_SCRIPT) for arg in proc.cmdline())
    except psutil.Error:
        return False


def _dead_started_worker(ts: TorchServeInstance) -> int | None:
    """The worker ``start`` saw READY, if it has died since while Java runs on."""
    try:
        pid = int(ts.started_worker_file.read_text())
    except (OSError, ValueError):
        return None
    return pid if ts.java_pid() is not None and not alive(pid) else None


def _running_after(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``procs`` still running after at most ``timeout`` s. One that exited is gone
    even before it is reaped (a zombie's ports and files are closed): a killed worker is an
    orphan that PID 1 reaps when it gets to it, 1.2 to 2 s later on this machine, a wait that
    was most of a restart's idle time (docs/serving.md §Supervisor: restart the whole instance)."""
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in procs if p.is_running() and alive(p.pid)]
        if not running or time.monotonic() >= deadline:
            psutil.wait_procs(procs, timeout=0)  # reaps those that are our own children
            return running
        time.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def tail(path: Path, lines: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(collections.deque(f, maxlen=lines))
    except OSError as e:
        return f"({e})\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["start", "stop", "status", "auth"])
    parser.add_argument(
        "api", nargs="?", choices=["inference", "management"], help="auth: whose key header"
    )
    parser.add_argument("--instance-dir", default=ROOT / ".run" / "llava", type=Path)
    parser.add_argument("--inference-port", default=8080, type=int)
    parser.add_argument("--management-port", default=8081, type=int)
    parser.add_argument("--metrics-port", default=8082, type=int)
    parser.add_argument("--host", default="127.0.0.1", help="address TorchServe binds")
    parser.add_argument("--model-store", default=ROOT / "model-store", type=Path)
    parser.add_argument("--model", default="llava", help="model name; archive <model>.mar")
    parser.add_argument("--timeout", default=180.0, type=float, help="start: seconds to READY")
    args = parser.parse_args(argv)
    ts = TorchServeInstance(
        args.instance_dir,
        args.inference_port,
        args.management_port,
        args.metrics_port,
        args.model_store,
        args.model,
        host=args.host,
    )
    try:
        if args.command == "start":
            began = time.monotonic()
            pid = ts.start(args.timeout)
            print(
                f"{args.model} READY in {time.monotonic() - began:.1f} s: worker pid {pid}, "
                f"{ts.inference_url}/predictions/{args.model}, logs in {ts.log_dir}"
            )
        elif args.command == "auth":
            if not (auth := ts.auth_headers(args.api or "inference")):
                raise TorchServeError(f"no key file in {ts.root}: is it running? (make serve)")
            print(f"Authorization: {auth['Authorization']}")
        elif args.command == "stop":
            ts.stop()
            print(f"stopped ({ts.root})")
        else:
            pid = ts.worker_pid()
            print(f"{args.model}: java {ts.java_pid()}, READY worker {pid}")
            if pid is None and (dead := _dead_started_worker(ts)):
                print(
                    f"worker {dead} died: TorchServe 0.12 async mode never serves its own "
                    "restart of it (the management API says UNLOADING); its sessions are gone. "
                    "Restart the instance: make stop && make serve"
                )
            return 0 if pid else 1
    except TorchServeError as e:
        print(f"torchserve_ctl {args.command}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
