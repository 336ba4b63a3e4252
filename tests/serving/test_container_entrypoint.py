"""The container's entrypoint (docker/entrypoint.sh serve) outside a container: a real
TorchServe started from a temporary directory laid out as SageMaker lays out /opt/ml/model,
on 127.0.0.1 and free ports (the SERVE_* overrides), with the demo model.

The image itself is built and run by the container tier
(tests/container/test_container_image.py); these tests cover what the entrypoint does inside
it, quickly and without Docker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest
import requests

from serving.mar import WEIGHTS_SUBDIR, build_mar
from serving.torchserve import TorchServeInstance, free_ports
from tests.checkpoints import UNSUPPORTED, fixture_copy
from tests.conftest import DEMO_MODEL_DIR, REPO
from tests.container_helpers import FrontClient
from tests.unit.test_checkpoint_refusal import REFUSAL_S

pytestmark = pytest.mark.torchserve
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
MAR = REPO / "model-store" / "llava.mar"
START_S = 240  # bound on start to READY, and on a failing start to exit


def lay_out(model_dir: Path, kind: str) -> Path:
    """``model_dir`` as /opt/ml/model would hold the model, in each supported layout."""
    model_dir.mkdir(parents=True)
    if kind == "mar":  # weights inside the archive
        if not MAR.exists():  # `make test` builds it; a bare pytest run may not
            build_mar(DEMO_MODEL_DIR)
        shutil.copy(MAR, model_dir / "llava.mar")
    elif kind == "mar-reference":  # a large checkpoint: weights beside a small .mar
        shutil.copytree(DEMO_MODEL_DIR, model_dir / "weights")
        build_mar(model_dir / "weights", "reference", export_path=model_dir)
    elif kind == "checkpoint":  # just the checkpoint: archived at start with our handler
        shutil.copytree(DEMO_MODEL_DIR, model_dir, dirs_exist_ok=True)
    return model_dir


class Container(FrontClient):
    """docker/entrypoint.sh serve as a process, its paths and ports overridden."""

    def __init__(self, tmp: Path, model_dir: Path, **env: str):
        self.port, *ts_ports = free_ports(4)
        self.ts_inference_port = ts_ports[0]
        self.management_url = f"http://127.0.0.1:{ts_ports[1]}"
        self.ts_root = tmp / "work" / "ts"  # serving/container.py's TorchServe instance directory
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "container.log"
        environ = {
            # As in the image: no PYTHONPATH, so the worker imports llava/ from the .mar.
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "SERVE_MODEL_DIR": str(model_dir),
            "SERVE_HOST": "127.0.0.1",
            "SERVE_PORT": str(self.port),
            "SERVE_TS_PORTS": ",".join(map(str, ts_ports)),
            "SERVE_WORK_DIR": str(tmp / "work"),
            **env,
        }
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [ENTRYPOINT, "serve"], env=environ, stdout=log, stderr=subprocess.STDOUT
            )

    def torchserve_ping(self) -> int | None:
        try:
            return requests.get(
                f"http://127.0.0.1:{self.ts_inference_port}/ping",
                headers=self._auth("inference"),
                timeout=10,
            ).status_code
        except requests.ConnectionError:
            return None

    def management_auth(self) -> dict[str, str]:
        return self._auth("management")

    def _auth(self, api: str) -> dict[str, str]:
        """A new instance object each time: its keys are read anew, as a restart changes them."""
        return TorchServeInstance(self.ts_root).auth_headers(api)

    def worker_ready(self) -> bool:
        return self.ready_worker_pid() is not None

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        for proc in [*self.descendants(), psutil.Process(self.process.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        self.process.wait(30)


def watch_start(container: Container) -> list[tuple[int | None, bool, int | None]]:
    """Poll until /ping is 200 or the process exits: (our ping, READY after it, TorchServe's)."""
    seen = []
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and container.process.poll() is None:
        ours = container.ping()
        seen.append((ours, container.worker_ready(), container.torchserve_ping()))
        if ours == 200:
            return seen
        time.sleep(0.2)
    return seen


@pytest.mark.parametrize("kind", ["mar", "mar-reference", "checkpoint"])
def test_ping_is_200_only_once_ready_then_serves_and_stops(tmp_path, kind):
    sessions = tmp_path / "sessions"  # the persistent tier's directory, set as a deployer would
    container = Container(
        tmp_path,
        lay_out(tmp_path / "opt-ml-model", kind),
        LLAVA_SESSION_TTL_S="321",
        LLAVA_PERSIST_DIR=str(sessions),
    )
    try:
        seen = watch_start(container)
        assert seen and seen[-1][0] == 200, container.output()[-3000:]
        # The worker being READY is monotonic here: not READY after a ping means not READY
        # during it, so that ping must have been 503; a 200 must be followed by READY.
        for ours, ready_after, _ in seen:
            assert ready_after or ours in (None, 503)
        assert any(ours == 503 for ours, _, _ in seen), "never saw the model loading"
        # What the front is for: TorchServe's own /ping said 200 while no worker was READY.
        assert any(ts == 200 and ours == 503 for ours, _, ts in seen)

        opened = container.invoke({"requestType": "NEW_SESSION"}, "NEW_SESSION")
        assert opened.status_code == 200, opened.text
        session = opened.json()["sessionId"]
        assert opened.headers["X-Amzn-SageMaker-New-Session-Id"].startswith(f"{session}; Expires=")
        expires = datetime.strptime(opened.json()["expiresAt"], "%Y-%m-%dT%H:%M:%SZ")
        ttl = (expires.replace(tzinfo=UTC) - datetime.now(UTC)).total_seconds()
        assert 300 < ttl <= 322  # LLAVA_SESSION_TTL_S reached the worker
        assert (sessions / f"{session}.state").is_file()  # and LLAVA_PERSIST_DIR did

        ask = {"requestType": "SESSION", "inputs": "Say that again.", "stream": True}
        with container.invoke(ask, session, stream=True) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["Transfer-Encoding"] == "chunked"
            lines = [json.loads(line) for line in streamed.iter_lines() if line]
        assert len(lines) >= 2 and all("token" in line for line in lines[:-1])
        assert lines[-1]["generation"]["text"] == "".join(t["token"]["text"] for t in lines[:-1])

        unknown = container.invoke({"requestType": "SESSION", "inputs": "hi"}, "nope")
        assert unknown.status_code == 400
        assert unknown.json()["error"]["code"] == "SESSION_NOT_FOUND"
        closed = container.invoke({"requestType": "CLOSE_SESSION"}, session)
        assert closed.headers["X-Amzn-SageMaker-Closed-Session-Id"] == session
        # a closed session leaves no entry, only why it went (the gone log) beside the
        # weights' digest (llava/model/weights_digest.py)
        assert sorted(p.name for p in sessions.iterdir()) == ["gone.log", "weights.sha256.json"]

        processes = container.descendants()
        container.process.terminate()  # what `docker stop` sends
        assert container.process.wait(60) == 0, container.output()[-3000:]
        assert not [p for p in processes if p.is_running() and p.status() != "zombie"]
    finally:
        if container.process.poll() is None:
            container.kill()


def test_model_that_fails_to_load_exits_nonzero_and_never_pings_200(tmp_path):
    model_dir = lay_out(tmp_path / "opt-ml-model", "checkpoint")
    # A checkpoint the checks at start accept (they read no weight) whose weights are garbage.
    (model_dir / "model.safetensors").write_bytes(b"not safetensors")
    container = Container(tmp_path, model_dir)
    began = time.monotonic()
    try:
        seen = watch_start(container)
        status = container.process.wait(30)
    finally:
        if container.process.poll() is None:
            container.kill()
    print(f"failing start exited with {status} after {time.monotonic() - began:.1f} s")
    assert status != 0 and time.monotonic() - began < START_S
    assert all(ours != 200 for ours, _, _ in seen)
    assert any(ours == 503 for ours, _, _ in seen)
    assert "worker crash loop" in container.output()


def test_a_killed_worker_restarts_torchserve_with_503s_meanwhile_and_the_bound_exits(tmp_path):
    """Kill the READY worker: the entrypoint restarts the whole TorchServe (0.12's own restart of
    an async worker never serves again, and traffic during its reload crash-loops it); meanwhile
    /ping and /invocations are clean 503s, never a hang; the session is gone (400
    SESSION_NOT_FOUND). The next death within the window exceeds SERVE_MAX_RESTARTS=1: exit 1."""
    model_dir = lay_out(tmp_path / "opt-ml-model", "mar")
    container = Container(tmp_path, model_dir, SERVE_MAX_RESTARTS="1")
    try:
        assert watch_start(container)[-1][0] == 200, container.output()[-3000:]
        session = container.invoke({"requestType": "NEW_SESSION"}, "NEW_SESSION").json()
        old = container.ready_worker_pid()
        killed_at = time.monotonic()
        os.kill(old, signal.SIGKILL)
        while container.ping() == 200:  # until the kernel has ended it
            assert time.monotonic() - killed_at < 10
        during = []  # (status, error code) of the requests sent until /ping is 200 again
        while container.ping() != 200:
            assert time.monotonic() - killed_at < START_S, container.output()[-3000:]
            assert container.process.poll() is None, container.output()[-3000:]
            reply = container.invoke({"requestType": "NEW_SESSION"}, "NEW_SESSION")
            during.append((reply.status_code, reply.json().get("error", {}).get("code")))
            time.sleep(0.05)  # steady traffic, not a flood on the two shared cores
        back_after = time.monotonic() - killed_at
        print(f"killed worker: /ping 200 again after {back_after:.1f} s, {len(during)} requests")
        assert during and set(during[:-1]) <= {(503, "NOT_READY")}
        assert during[-1] in {(503, "NOT_READY"), (200, None)}  # the last may find it READY

        new = container.ready_worker_pid()
        assert new not in (None, old)
        lost = container.invoke({"requestType": "SESSION", "inputs": "hi"}, session["sessionId"])
        assert lost.status_code == 400 and lost.json()["error"]["code"] == "SESSION_NOT_FOUND"
        assert container.invoke({"requestType": "NEW_SESSION"}, "NEW_SESSION").status_code == 200
        assert container.ready_worker_pid() == new  # no crash loop after the restart
        assert container.output().count("restarting TorchServe") == 1

        os.kill(new, signal.SIGKILL)  # the second death in the window: past the bound
        assert container.process.wait(60) == 1
        assert "worker deaths within 600 s (limit 1 restarts), giving up" in container.output()
    finally:
        if container.process.poll() is None:
            container.kill()


@pytest.mark.parametrize(
    "setup, env, message",
    [
        ("empty", {}, "no model in"),
        ("two-mars", {}, "2 .mar files"),
        ("dangling-reference", {}, "references weights at"),
        ("not-json", {}, "cannot be served: config.json is not a JSON object"),
        ("mar", {"LLAVA_SESION_TTL_S": "5"}, "unknown setting LLAVA_SESION_TTL_S"),
        ("mar", {"LLAVA_SESSION_TTL_S": "abc"}, "bad setting LLAVA_SESSION_TTL_S"),
        ("mar", {"LLAVA_MAX_BATCH": "0"}, "bad setting LLAVA_MAX_BATCH: 0 is not an integer > 0"),
        ("mar", {"SES_TTL_MIN": "10", "LLAVA_SESSION_TTL_S": "300"}, "conflicts with LLAVA_"),
        ("mar", {"SERVE_PORT": "http"}, "bad SERVE_* setting"),
        ("mar", {"SERVE_ENDPOINT_NAME": "llava chat"}, "bad SERVE_ENDPOINT_NAME: 'llava chat'"),
    ],
)
def test_bad_setup_fails_at_once_with_one_line(tmp_path, setup, env, message):
    model_dir = tmp_path / "opt-ml-model"
    if setup == "empty":
        model_dir.mkdir()
    elif setup == "two-mars":
        lay_out(model_dir, "mar")
        shutil.copy(model_dir / "llava.mar", model_dir / "other.mar")
    elif setup == "dangling-reference":  # weights referenced, then gone
        shutil.copytree(DEMO_MODEL_DIR, tmp_path / "gone")
        build_mar(tmp_path / "gone", "reference", export_path=model_dir)
        shutil.rmtree(tmp_path / "gone")
    elif setup == "not-json":
        (lay_out(model_dir, "checkpoint") / "config.json").write_text("{not json")
    else:
        lay_out(model_dir, setup)
    container = Container(tmp_path, model_dir, **env)
    try:
        assert container.process.wait(60) == 2
    finally:
        if container.process.poll() is None:
            container.kill()
    lines = container.output().splitlines()
    assert len(lines) == 1 and lines[0].startswith("serve: ") and message in lines[0], lines


def unsupported_layout(tmp_path: Path, kind: str, case: str) -> Path:
    """/opt/ml/model holding a checkpoint the engine does not serve (UNSUPPORTED[case]): make mar
    refuses to archive one, so a .mar is built from the supported fixture, then the checkpoint
    (and, for weights inside, the archive's copy of its small files) is edited."""
    fixture, edit, _ = UNSUPPORTED[case]
    model_dir = tmp_path / "opt-ml-model"
    if kind == "checkpoint":
        edit(fixture_copy(model_dir, fixture))
    elif kind == "mar-reference":
        checkpoint = fixture_copy(model_dir / "weights", fixture)
        build_mar(checkpoint, "reference", export_path=model_dir)
        edit(checkpoint)
    elif kind == "mar":
        checkpoint = fixture_copy(tmp_path / "supported", fixture)
        built = build_mar(checkpoint, export_path=tmp_path / "built")
        edit(checkpoint)
        model_dir.mkdir()
        with zipfile.ZipFile(built) as old, zipfile.ZipFile(model_dir / "llava.mar", "w") as new:
            for item in old.infolist():
                edited = checkpoint / item.filename.removeprefix(f"{WEIGHTS_SUBDIR}/")
                inside = item.filename.startswith(f"{WEIGHTS_SUBDIR}/") and edited.is_file()
                new.writestr(item, edited.read_bytes() if inside else old.read(item))
    return model_dir


@pytest.mark.parametrize(
    "kind, case",
    [
        ("checkpoint", "sliding window"),
        ("mar", "qwen2 text model"),
        ("mar", "template not append-only"),
        ("mar-reference", "paligemma"),
    ],
)
def test_an_unsupported_checkpoint_stops_the_start_in_one_line_before_torchserve(
    tmp_path, kind, case
):
    model_dir = unsupported_layout(tmp_path, kind, case)
    began = time.monotonic()
    container = Container(tmp_path, model_dir)
    try:
        status = container.process.wait(60)
    finally:
        if container.process.poll() is None:
            container.kill()
    took = time.monotonic() - began
    lines = container.output().splitlines()
    print(f"{kind}, {case}: exit {status} after {took:.1f} s: {lines}")
    assert status == 2 and len(lines) == 1, lines
    where = {
        "checkpoint": f"{model_dir}",
        "mar": f"llava.mar: {tmp_path / 'work' / 'mar-checkpoint' / WEIGHTS_SUBDIR}",
        "mar-reference": f"llava.mar: {model_dir / 'weights'}",
    }[kind]
    assert lines[0].startswith(f"serve: {where} cannot be served: ")
    assert UNSUPPORTED[case][2] in lines[0]
    assert not (tmp_path / "work" / "ts").exists()  # TorchServe never started
    assert not list(tmp_path.glob("work/**/*.safetensors"))  # weights inside: not extracted
    assert took < REFUSAL_S
