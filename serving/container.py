"""The container's start: ``serve`` = TorchServe behind a truthful ``/ping`` (serving/front.py).

SageMaker runs ``docker run <image> serve`` and then polls ``GET /ping`` on port 8080 until
it answers 200; model data is under ``/opt/ml/model``. docker/entrypoint.sh runs docker/serve.py,
which calls :func:`main` with the application directory (the checkout, or /opt/stateful-llava in
the image: its config.properties and model-config.yaml are the ones served; the installed
serving package has neither). That process

1. checks the settings (a bad one stops the start with one clear line, exit 2);
2. finds the model under the model directory, in this order:
   - exactly one ``*.mar``: served as is (weights inside it, or ``make mar
     MAR_WEIGHTS=reference MODEL_DIR=/opt/ml/model/<dir>`` for weights beside it);
   - a checkpoint (``config.json``) in the directory itself: archived at start with our
     handler, the weights referenced in place (nothing is copied);
   either way a checkpoint the engine does not serve (llava.model.checkpoint: its small files
   only, seconds, no weight read) stops the start with one line, exit 2, like a bad setting;
3. starts the front on the public port at once (``/ping`` 503) and TorchServe on internal
   loopback ports, and waits until the management API reports a READY worker (``/ping`` 200);
4. when the READY worker dies, restarts the whole TorchServe instance (serving/supervisor.py;
   TorchServe 0.12's own restart of an async worker never serves again): ``/ping`` is 503 and
   ``/invocations`` a 503 ``NOT_READY`` meanwhile, sessions are gone (400 ``SESSION_NOT_FOUND``);
5. writes the session metrics as CloudWatch embedded-metric-format lines on stdout
   (serving/emf.py), at once when they change and at least every ``SERVE_METRICS_INTERVAL_S``;
6. exits 1 when TorchServe exits, when the worker crash-loops while loading, when no worker is
   READY within ``SERVE_STARTUP_TIMEOUT_S``, or when the worker died more than
   ``SERVE_MAX_RESTARTS`` times within ``SERVE_RESTART_WINDOW_S``; exits 0 on SIGTERM after
   stopping TorchServe. A container that exits is restarted or replaced by SageMaker, which is
   better than one that crash-loops forever behind a 200.

Engine settings reach the worker as ``LLAVA_*`` variables (docs/settings.md §Engine settings). The
entrypoint's own settings, all overridable so that tests run it unprivileged on loopback:

    SERVE_MODEL_DIR          /opt/ml/model
    SERVE_HOST               0.0.0.0      address of the public port
    SERVE_PORT               8080         (SAGEMAKER_BIND_TO_PORT wins when SageMaker sets it)
    SERVE_TS_PORTS           8180,8181,8182   TorchServe inference, management, metrics (loopback)
    SERVE_WORK_DIR           /tmp/llava-serve  TorchServe's logs, temp files, generated .mar
    SERVE_STARTUP_TIMEOUT_S  1800         from start to a READY worker
    SERVE_MAX_RESTARTS       3            whole-instance restarts allowed within ...
    SERVE_RESTART_WINDOW_S   600          ... this many seconds; one more worker death: exit 1
    SERVE_METRICS_INTERVAL_S 60           EMF lines at least this often (0: none at all)
    SERVE_METRICS_NAMESPACE  StatefulLlava  their CloudWatch namespace
    SERVE_ENDPOINT_NAME      local        their Endpoint dimension (python -m deploy sets it)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import threading
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from llava.config import (
    EngineConfig,
    SettingsError,
    env_name,
    load_config,
    unknown_env_names,
)
from serving.emf import LOCAL_ENDPOINT, NAMESPACE, EmfReporter, endpoint_name
from serving.front import Front
from serving.mar import NotACheckpoint, build_mar
from serving.supervisor import RestartLimit, Supervisor
from serving.torchserve import TorchServeError, TorchServeInstance

MODEL_NAME = "llava"
WEIGHT_FILES = (".safetensors", ".bin", ".pt")  # what the checkpoint checks never read


class SettingError(ValueError):
    """A setting or model layout that cannot work: reported as one line, exit status 2."""


@dataclass(frozen=True)
class Settings:
    model_dir: Path = Path("/opt/ml/model")
    host: str = "0.0.0.0"
    port: int = 8080
    ts_ports: tuple[int, int, int] = (8180, 8181, 8182)
    work_dir: Path = Path("/tmp/llava-serve")
    startup_timeout_s: float = 1800.0
    max_restarts: int = 3
    restart_window_s: float = 600.0
    metrics_interval_s: float = 60.0
    metrics_namespace: str = NAMESPACE
    endpoint_name: str = LOCAL_ENDPOINT

    @classmethod
    def from_env(cls, environ: dict[str, str]) -> Settings:
        defaults = cls()
        try:
            endpoint = endpoint_name(environ)  # its message names the variable
        except ValueError as e:
            raise SettingError(str(e)) from None
        try:
            ports = environ.get("SERVE_TS_PORTS")
            settings = cls(
                model_dir=Path(environ.get("SERVE_MODEL_DIR", defaults.model_dir)),
                host=environ.get("SERVE_HOST", defaults.host),
                port=int(
                    environ.get("SAGEMAKER_BIND_TO_PORT")
                    or environ.get("SERVE_PORT", defaults.port)
                ),
                ts_ports=tuple(int(p) for p in ports.split(",")) if ports else defaults.ts_ports,
                work_dir=Path(environ.get("SERVE_WORK_DIR", defaults.work_dir)),
                startup_timeout_s=float(
                    environ.get("SERVE_STARTUP_TIMEOUT_S", defaults.startup_timeout_s)
                ),
                max_restarts=int(environ.get("SERVE_MAX_RESTARTS", defaults.max_restarts)),
                restart_window_s=float(
                    environ.get("SERVE_RESTART_WINDOW_S", defaults.restart_window_s)
                ),
                metrics_interval_s=float(
                    environ.get("SERVE_METRICS_INTERVAL_S", defaults.metrics_interval_s)
                ),
                metrics_namespace=environ.get(
                    "SERVE_METRICS_NAMESPACE", defaults.metrics_namespace
                ),
                endpoint_name=endpoint,
            )
        except ValueError as e:
            raise SettingError(f"bad SERVE_* setting: {e}") from None
        if len(settings.ts_ports) != 3 or settings.port in settings.ts_ports:
            raise SettingError(
                "SERVE_TS_PORTS must be three ports (inference,management,metrics) "
                f"other than the public port {settings.port}"
            )
        if settings.metrics_interval_s < 0:
            raise SettingError("SERVE_METRICS_INTERVAL_S must be 0 (off) or more seconds")
        return settings


def check_engine_env(environ: dict[str, str]) -> None:
    """Fail on a misspelt ``LLAVA_*`` name, which the engine would only warn about, and on a bad
    value, with the worker's own one-line message naming the variable."""
    unknown = unknown_env_names(environ)
    if unknown:
        known = sorted(env_name(f.name) for f in dataclasses.fields(EngineConfig))
        raise SettingError(f"unknown setting {', '.join(unknown)}; known: {', '.join(known)}")
    try:
        load_config({}, environ, base_dir=".")
    except SettingsError as e:
        raise SettingError(str(e)) from None


def resolve_model(model_dir: Path, work_dir: Path, app: Path) -> tuple[Path, str]:
    """The model store and model name to serve from ``model_dir`` (see the module docstring);
    a bare checkpoint is archived with ``app``'s model-config.yaml. A checkpoint the engine
    does not serve is refused here, from its small files, in seconds."""
    if not model_dir.is_dir():
        raise SettingError(f"model directory {model_dir} not found")
    mars = sorted(model_dir.glob("*.mar"))
    if len(mars) > 1:
        raise SettingError(f"{len(mars)} .mar files in {model_dir}, expected one: {mars}")
    if mars:
        # Imported here: torch and transformers, which a bad setting's refusal doesn't need.
        from llava.model.checkpoint import UnsupportedCheckpoint, inspect_checkpoint

        try:
            inspect_checkpoint(mar_checkpoint(mars[0], work_dir / "mar-checkpoint"))
        except UnsupportedCheckpoint as e:
            raise SettingError(f"{mars[0].name}: {e.problem}") from None
        return model_dir, mars[0].stem
    if (model_dir / "config.json").is_file():
        store = work_dir / "model-store"
        try:
            build_mar(
                model_dir,
                "reference",
                config=app / "model-config.yaml",
                export_path=store,
                model_name=MODEL_NAME,
            )
        except NotACheckpoint as e:
            raise SettingError(str(e)) from None
        return store, MODEL_NAME
    raise SettingError(
        f"no model in {model_dir}: expected one .mar (make mar) or a checkpoint (config.json)"
    )


def mar_checkpoint(mar: Path, scratch: Path) -> Path:
    """The checkpoint directory a .mar serves: the absolute one that ``--weights reference``
    names, or, for weights inside, the archived one's files but the weights, extracted under
    ``scratch`` (what the checks read; the weights stay in the archive)."""
    try:
        with zipfile.ZipFile(mar) as archive:
            config = yaml.safe_load(archive.read("model-config.yaml")) or {}
            checkpoint = Path(config.get("handler", {}).get("model_dir", "."))
            if checkpoint.is_absolute():
                if not checkpoint.is_dir():
                    raise SettingError(
                        f"{mar.name} references weights at {checkpoint}, which is not there"
                    )
                return checkpoint
            inside = "" if checkpoint == Path(".") else f"{checkpoint.as_posix()}/"
            shutil.rmtree(scratch, ignore_errors=True)
            small = [n for n in archive.namelist() if not n.endswith(WEIGHT_FILES)]
            archive.extractall(scratch, [n for n in small if n.startswith(inside)])
            return scratch / checkpoint
    except (zipfile.BadZipFile, KeyError, yaml.YAMLError) as e:
        raise SettingError(f"{mar} is not a .mar built by make mar: {e}") from None


class Stopped(Exception):
    """SIGTERM or SIGINT: stop TorchServe and exit 0."""


def _on_signal(signum, frame) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal must not abort the cleanup
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signal.Signals(signum).name)


_stdout = threading.Lock()  # whole lines: TorchServe's log and EMF lines share stdout


def _print_line(line: bytes) -> None:
    with _stdout:
        sys.stdout.buffer.write(line if line.endswith(b"\n") else line + b"\n")
        sys.stdout.flush()


def _follow(path: Path, done: threading.Event) -> None:
    """Copy TorchServe's console output (frontend and worker logs) to ours: the container log."""
    while not path.exists() and not done.wait(0.2):
        pass
    pending = b""  # a line TorchServe is still writing: never split by an EMF line
    with open(path, "rb") as log:
        while True:
            if chunk := log.readline():
                pending += chunk
                if pending.endswith(b"\n"):
                    _print_line(pending)
                    pending = b""
            elif done.wait(0.2):
                if pending:
                    _print_line(pending)
                return


def _report_metrics(settings: Settings, metrics_port: int, name: str, done: threading.Event):
    """EMF lines from TorchServe's metrics endpoint until ``done`` (serving/emf.py)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.read().decode("utf-8", errors="replace")

    reporter = EmfReporter(
        scrape,
        lambda line: _print_line(line.encode()),
        name,
        settings.metrics_interval_s,
        settings.metrics_namespace,
        endpoint=settings.endpoint_name,
    )
    reporter.run(done, poll_s=min(1.0, settings.metrics_interval_s))


def serve(settings: Settings, app: Path) -> int:
    store, name = resolve_model(settings.model_dir, settings.work_dir, app)
    inference, management, metrics = settings.ts_ports
    ts = TorchServeInstance(
        settings.work_dir / "ts",
        inference,
        management,
        metrics,
        store,
        name,
        ts_config=app / "config.properties",
        host="127.0.0.1",
    )
    supervisor = Supervisor(
        ts,
        settings.max_restarts,
        settings.restart_window_s,
        settings.startup_timeout_s,
        log=lambda line: print(f"serve: {line}", flush=True),
    )
    try:
        front = Front(
            (settings.host, settings.port),
            ("127.0.0.1", inference),
            supervisor.ready,
            upstream_auth=lambda: ts.auth_headers("inference"),
        )
    except OSError as e:
        raise SettingError(f"cannot listen on {settings.host}:{settings.port}: {e}") from None
    threading.Thread(target=front.serve_forever, name="front", daemon=True).start()
    done = threading.Event()
    (ts.root / "torchserve.out").unlink(missing_ok=True)  # the follower must see the new one
    threading.Thread(target=_follow, args=(ts.root / "torchserve.out", done), daemon=True).start()
    if settings.metrics_interval_s > 0:
        threading.Thread(
            target=_report_metrics, args=(settings, metrics, name, done), daemon=True
        ).start()
    began = time.monotonic()
    print(f"serve: {name} from {store} on {settings.host}:{settings.port}", flush=True)
    try:
        supervisor.start()
        print(f"serve: READY in {time.monotonic() - began:.1f} s", flush=True)
        supervisor.watch(threading.Event())  # returns only by raising
    except RestartLimit as e:
        print(f"serve: {e}; exiting so that the container is replaced", file=sys.stderr, flush=True)
        return 1
    except TorchServeError as e:
        print(f"serve: TorchServe failed: {e}", file=sys.stderr, flush=True)
        return 1
    except Stopped as e:
        print(f"serve: {e}, stopping", flush=True)
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # nothing interrupts the cleanup
            signal.signal(sig, signal.SIG_IGN)
        front.shutdown()
        front.server_close()
        ts.stop()
        done.set()


def main(argv: list[str], app: Path) -> int:
    """``serve``: the container's whole life, its exit status returned; ``app`` holds the
    config.properties and model-config.yaml to serve."""
    if argv != ["serve"]:
        print(
            "usage: serve.py serve   (what SageMaker runs: docker run <image> serve)",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        settings = Settings.from_env(dict(os.environ))
        check_engine_env(os.environ)
        return serve(settings, app)
    except SettingError as e:
        print(f"serve: {e}", file=sys.stderr, flush=True)
        return 2
    except Stopped:
        return 0
