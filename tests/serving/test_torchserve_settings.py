"""Settings through a real TorchServe: a bad one fails ``make serve``'s start at once with one
line naming it (TorchServe alone would restart the worker for ever), and a misspelt ``LLAVA_*``
name is logged as a warning by a worker that serves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serving.mar import build_mar
from serving.torchserve import TorchServeInstance, free_ports
from tests.conftest import DEMO_MODEL_DIR, REPO

pytestmark = pytest.mark.torchserve
MAR = REPO / "model-store" / "llava.mar"


@pytest.fixture(scope="module")
def demo_store() -> Path:
    if not MAR.exists():  # `make test` builds it with `make mar`; a bare pytest run may not
        build_mar(DEMO_MODEL_DIR)
    return MAR.parent


def serve(instance_dir: Path, model_store: Path, **env: str) -> subprocess.CompletedProcess:
    """What ``make serve`` runs, on free ports, with ``env`` added to the environment."""
    inference, management, metrics = free_ports(3)
    command = [sys.executable, "-m", "serving.torchserve", "start"]
    command += ["--instance-dir", str(instance_dir), "--model-store", str(model_store)]
    command += ["--inference-port", str(inference), "--management-port", str(management)]
    command += ["--metrics-port", str(metrics), "--timeout", "120"]
    return subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )


def assert_failed_on(started: subprocess.CompletedProcess, instance_dir: Path, line: str):
    assert started.returncode == 1
    assert started.stderr.splitlines()[0] == f"torchserve_ctl start: {line}"
    assert "crash loop" not in started.stderr  # stopped at the first failure, not the 4th
    assert TorchServeInstance(instance_dir).processes() == []


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"LLAVA_SESSION_TTL_S": "abc"},
            "bad setting LLAVA_SESSION_TTL_S: 'abc' is not a number of seconds > 0",
        ),
        (
            {"LLAVA_INTAKE": '{"allow": ["127.0.0.1"'},
            """bad setting LLAVA_INTAKE: '{"allow": ["127.0.0.1"' """
            "is not a JSON object of intake settings",
        ),
        (
            {"LLAVA_PERSIST_DIR": "/dev/null/sessions"},  # checked once the model is in
            "bad setting LLAVA_PERSIST_DIR: /dev/null/sessions is not a writable directory "
            "([Errno 20] Not a directory: '/dev/null/sessions')",
        ),
    ],
    ids=["ttl", "intake", "persist-dir"],
)
def test_bad_environment_setting_fails_the_start_with_its_line(tmp_path, demo_store, env, line):
    started = serve(tmp_path / "ts", demo_store, **env)
    assert_failed_on(started, tmp_path / "ts", line)


def test_bad_archived_setting_fails_the_start_with_its_line(tmp_path):
    settings = yaml.safe_load((REPO / "model-config.yaml").read_text())
    settings["handler"]["session_ttl_s"] = -5
    config = tmp_path / "model-config.yaml"
    config.write_text(yaml.safe_dump(settings))
    build_mar(DEMO_MODEL_DIR, config=config, export_path=tmp_path / "store")
    started = serve(tmp_path / "ts", tmp_path / "store")
    line = "bad setting model-config.yaml handler.session_ttl_s: -5 is not a number of seconds > 0"
    assert_failed_on(started, tmp_path / "ts", line)


def test_misspelt_variable_is_a_warning_in_the_log(tmp_path, demo_store):
    instance = TorchServeInstance.on_free_ports(
        tmp_path / "ts", model_store=demo_store, env={"LLAVA_SESION_TTL_S": "60"}
    )
    instance.start(timeout=180)
    try:
        log = (instance.log_dir / "model_log.log").read_text()
    finally:
        instance.stop()
    assert "ignoring LLAVA_SESION_TTL_S: no such setting" in log
