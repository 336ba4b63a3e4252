"""The image itself, run the way SageMaker runs it: ``docker run --network host IMAGE serve``
with the model under /opt/ml/model, in each layout the entrypoint supports.

The container tier (scripts/container_tier.py, ``make test-container``, run by .ci/run after
``make test``) builds the CPU flavour and names it in LLAVA_TEST_IMAGE; without that these
tests are skipped (``make test`` starts no Docker engine). With it, Docker must answer: a
missing engine then fails here instead of passing quietly.

The entrypoint listens on 8080 as SageMaker requires (the first test checks the image's own
default); these containers share the machine's network, so each gets free loopback ports
through SERVE_PORT / SERVE_TS_PORTS and nothing else on the machine is disturbed. They run one
at a time (pytest runs this module's tests in order, each removes its container).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from serving.mar import build_mar
from serving.torchserve import free_ports
from tests.conftest import DEMO_MODEL_DIR, REPO
from tests.container_helpers import FrontClient
from tests.intake_servers import image_bytes

IMAGE = os.environ.get("LLAVA_TEST_IMAGE", "")
pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(not IMAGE, reason="run by the container tier: make test-container"),
]
MAR = REPO / "model-store" / "llava.mar"
START_S = 240  # bound on start to READY (2 shared cores), and on a restart after a kill
IN_IMAGE = "/opt/ml/model"
NAMESPACE = "StatefulLlava"  # serving/emf.py's default
USER = "10001"  # the Dockerfile's USER: not root


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=check
    )


def lay_out(model_dir: Path, kind: str) -> Path:
    """``model_dir`` as SageMaker would fill /opt/ml/model, in each supported layout."""
    model_dir.mkdir(parents=True)
    if kind == "mar":  # weights inside the archive
        if not MAR.exists():
            build_mar(DEMO_MODEL_DIR)
        shutil.copy(MAR, model_dir / "llava.mar")
    elif kind == "checkpoint":  # just the checkpoint: archived at start with the image's handler
        shutil.copytree(DEMO_MODEL_DIR, model_dir, dirs_exist_ok=True)
    elif kind == "mar-reference":  # weights beside a small .mar that names their path in the image
        shutil.copytree(DEMO_MODEL_DIR, model_dir / "weights")
        # as root: the operator's step writes the archive into this root-owned directory
        docker(
            "run", "--rm", "--network", "none", "--user", "root",
            "-v", f"{model_dir}:{IN_IMAGE}", IMAGE,
            "python", "-m", "serving.mar", "--config", "model-config.yaml",
            "--model-dir", f"{IN_IMAGE}/weights",
            "--weights", "reference", "--export-path", IN_IMAGE,
        )  # fmt: skip
    return model_dir


class Container(FrontClient):
    """``docker run -d --network host IMAGE serve``, the model mounted at /opt/ml/model."""

    def __init__(self, model_dir: Path, **env: str):
        self.name = f"llava-test-{uuid.uuid4().hex[:8]}"
        self.port, inference, management, metrics = free_ports(4)
        self.url = f"http://127.0.0.1:{self.port}"
        self.management_url = f"http://127.0.0.1:{management}"
        settings = {
            "SERVE_PORT": str(self.port),
            "SERVE_TS_PORTS": f"{inference},{management},{metrics}",
            **env,
        }
        environment = [arg for k, v in settings.items() for arg in ("-e", f"{k}={v}")]
        docker(
            "run", "-d", "--network", "host", "--name", self.name,
            "-v", f"{model_dir}:{IN_IMAGE}:ro", *environment, IMAGE, "serve",
        )  # fmt: skip

    def management_auth(self) -> dict[str, str]:
        """Read inside the container, from the key file of its TorchServe (SERVE_WORK_DIR's
        default), as an operator would."""
        run = docker(
            "exec", self.name, "python", "-m", "serving.torchserve", "auth", "management",
            "--instance-dir", "/tmp/llava-serve/ts", check=False,
        )  # fmt: skip
        name, _, value = run.stdout.strip().partition(": ")
        return {name: value} if value else {}

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc_info) -> None:
        docker("rm", "-f", self.name, check=False)

    def wait_ready(self) -> list[int | None]:
        """/ping until 200 (or the container exits): every answer seen."""
        seen = []
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and self.running():
            seen.append(self.ping())
            if seen[-1] == 200:
                return seen
            time.sleep(0.2)
        raise AssertionError(f"/ping never 200: {seen[-5:]}\n{self.logs()[-3000:]}")

    def running(self) -> bool:
        return docker("inspect", "-f", "{{.State.Running}}", self.name).stdout.strip() == "true"

    def logs(self) -> str:
        run = docker("logs", self.name, check=False)
        return run.stdout + run.stderr

    def exit_code(self, timeout: float) -> int:
        return int(docker("wait", self.name, timeout=timeout).stdout.strip())


def open_on(container: Container, sample) -> str:
    b64 = base64.b64encode(image_bytes(sample.image)).decode()
    opened = container.invoke({"requestType": "NEW_SESSION", "image": {"b64": b64}}, "NEW_SESSION")
    assert opened.status_code == 200, opened.text
    session_id = opened.json()["sessionId"]
    assert opened.headers["X-Amzn-SageMaker-New-Session-Id"].startswith(f"{session_id}; Expires=")
    return session_id


def ask(container: Container, session_id: str, question: str) -> str:
    reply = container.invoke({"requestType": "SESSION", "inputs": question}, session_id)
    assert reply.status_code == 200, reply.text
    return reply.json()["generation"]["text"]


def emf_lines(logs: str) -> list[dict]:
    return [json.loads(line) for line in logs.splitlines() if line.startswith('{"_aws"')]


def test_the_image_is_what_sagemaker_runs(tmp_path):
    config = json.loads(docker("image", "inspect", "-f", "{{json .Config}}", IMAGE).stdout)
    assert config["Entrypoint"][0] == "/usr/bin/tini"
    assert config["User"] == f"{USER}:{USER}"
    assert config["Cmd"] == ["serve"]
    assert "8080/tcp" in config["ExposedPorts"]
    assert not any(e.startswith(("PYTHONPATH=", "PIP_FIND_LINKS=")) for e in config["Env"])
    # The entrypoint's own default port, read inside the image (the tests override it).
    probe = "from serving.container import Settings; print(Settings.from_env({}).port)"
    run = docker("run", "--rm", "--network", "none", IMAGE, "python", "-c", probe)
    assert run.stdout.strip() == "8080", run.stderr
    # Not root, and what it needs is there for it: the model SageMaker mounts read-only and
    # owned by root (this test runs as root, so the files here are root's) is readable, and
    # /dev/shm (the persistent tier) and /tmp (TorchServe's work) are writable.
    model_dir = lay_out(tmp_path / "model", "checkpoint")
    probe = "id -u; cat /opt/ml/model/config.json >/dev/null; touch /dev/shm/probe /tmp/probe"
    run = docker("run", "--rm", "--network", "none", "-v", f"{model_dir}:{IN_IMAGE}:ro",
                 IMAGE, "sh", "-ec", probe, check=False)  # fmt: skip
    assert (run.returncode, run.stdout.strip()) == (0, USER), run.stderr


@pytest.mark.parametrize("layout", ["mar", "checkpoint", "mar-reference"])
def test_serves_each_layout_then_docker_stop_exits_0(tmp_path, layout, sample):
    model_dir = lay_out(tmp_path / "model", layout)
    with Container(model_dir, SERVE_METRICS_INTERVAL_S="2") as container:
        seen = container.wait_ready()
        assert 503 in seen, seen  # loading: the front answered, not yet ready
        assert container.ready_worker_pid() is not None

        session_id = open_on(container, sample)
        assert ask(container, session_id, "What color is the shape?") == sample.color
        streamed = {"requestType": "SESSION", "inputs": "And its shape?", "stream": True}
        with container.invoke(streamed, session_id, stream=True) as reply:
            assert reply.status_code == 200 and reply.headers["Transfer-Encoding"] == "chunked"
            lines = [json.loads(line) for line in reply.iter_lines() if line]
        assert len(lines) >= 2 and lines[-1]["generation"]["text"] == sample.shape
        closed = container.invoke({"requestType": "CLOSE_SESSION"}, session_id)
        assert closed.headers["X-Amzn-SageMaker-Closed-Session-Id"] == session_id

        began = time.monotonic()
        docker("stop", "-t", "10", container.name, timeout=30)
        stopped_in = time.monotonic() - began
        assert container.exit_code(timeout=10) == 0, container.logs()[-3000:]
        assert stopped_in < 10, f"docker stop took {stopped_in:.1f} s"
        assert "serve: SIGTERM, stopping" in container.logs()


def test_session_metrics_are_emf_lines_on_stdout(tmp_path, sample):
    """CloudWatch Logs makes metrics of these lines (serving/emf.py): each line is a valid EMF
    document, the counters (increases) add up to what happened, the gauges follow, and with
    nothing happening the lines still come at the interval."""
    with Container(lay_out(tmp_path / "model", "mar"), SERVE_METRICS_INTERVAL_S="2") as container:
        container.wait_ready()
        session_id = open_on(container, sample)
        ask(container, session_id, "What color is the shape?")
        container.invoke({"requestType": "CLOSE_SESSION"}, session_id)
        deadline = time.monotonic() + 30
        while sum(d.get("SessionsClosed", 0) for d in emf_lines(container.logs())) < 1:
            assert time.monotonic() < deadline, container.logs()[-3000:]
            time.sleep(0.5)
        quiet = len(emf_lines(container.logs()))
        deadline = time.monotonic() + 10  # no traffic now: lines only because the interval is up
        while len(documents := emf_lines(container.logs())) <= quiet:
            assert time.monotonic() < deadline, "no line at the interval while nothing changed"
            time.sleep(0.5)

    repeated = documents[quiet:]
    assert all(d.get("SessionsOpened", 0) == 0 for d in repeated)  # nothing new to count
    for document in documents:
        (directive,) = document["_aws"]["CloudWatchMetrics"]
        assert isinstance(document["_aws"]["Timestamp"], int)
        assert directive["Namespace"] == NAMESPACE
        assert directive["Dimensions"] in (
            [["Endpoint"], ["Endpoint", "Host"]],
            [["Endpoint", "Tier"], ["Endpoint", "Host", "Tier"]],
        )
        for dimension in directive["Dimensions"][-1]:
            assert isinstance(document[dimension], str)
        assert document["Endpoint"] == "local"  # no SERVE_ENDPOINT_NAME: not deployed by deploy
        for metric in directive["Metrics"]:
            value = document[metric["Name"]]
            if metric["Unit"] == "Seconds":  # a latency: values and counts, for percentiles
                assert len(value["Values"]) == len(value["Counts"]) and value["Count"] > 0
            else:
                assert isinstance(value, int | float), metric
            assert metric["Unit"] in ("Count", "Bytes", "Seconds")
    assert sum(d.get("SessionsOpened", 0) for d in documents) == 1
    assert sum(d.get("SessionsClosed", 0) for d in documents) == 1
    assert sum(d.get("TurnNewTokens", 0) for d in documents) > 0
    assert any(d.get("TurnLatencySeconds", {}).get("Count", 0) > 0 for d in documents)
    last_open = [d["SessionsOpen"] for d in documents[-2:] if "SessionsOpen" in d]
    assert last_open and all(n == 0 for n in last_open)


def test_a_bad_setting_exits_nonzero_with_one_line(tmp_path):
    model_dir = lay_out(tmp_path / "model", "mar")
    with Container(model_dir, LLAVA_SESION_TTL_S="5") as container:
        assert container.exit_code(timeout=60) == 2
        lines = container.logs().splitlines()
    assert len(lines) == 1 and lines[0].startswith("serve: unknown setting LLAVA_SESION_TTL_S")


def test_a_killed_worker_inside_means_503_then_its_sessions_go_on(tmp_path, sample):
    with Container(lay_out(tmp_path / "model", "mar")) as container:
        container.wait_ready()
        kept = open_on(container, sample)
        # Docker's default /dev/shm (64 MB) is under persist_min_bytes: the tier moved to the
        # archive's persist_fallback_dir, on the container's own disk
        listed = docker("exec", container.name, "ls", "/tmp/stateful-llava").stdout.split()
        assert f"{kept}.state" in listed and f"{kept}.features" in listed
        old = container.ready_worker_pid()
        owner = docker("exec", container.name, "stat", "-c", "%u", f"/proc/{old}").stdout
        assert owner.strip() == USER  # the worker serves as the image's user, not as root
        docker("exec", container.name, "sh", "-c", f"kill -9 {old}")  # the shell's kill
        killed_at = time.monotonic()
        while container.ping() == 200:
            assert time.monotonic() - killed_at < 10, "/ping stayed 200 after the worker died"
            time.sleep(0.05)
        assert container.ping() == 503
        back = container.wait_ready()
        print(f"killed worker: /ping 200 again after {time.monotonic() - killed_at:.1f} s")
        assert back[-1] == 200 and container.ready_worker_pid() not in (None, old)

        # the image's default persistent tier: the restarted worker adopted the session
        assert ask(container, kept, "What shape is it?") == sample.shape
        session_id = open_on(container, sample)
        assert ask(container, session_id, "What color is the shape?") == sample.color
        assert container.running()
