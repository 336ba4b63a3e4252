"""`make endpoint` gives each TorchServe instance its share of the cores: torch threads, as
OMP_NUM_THREADS, in the environment every instance starts with and the endpoint process's (which
a restarted instance inherits). A bad ``--threads`` refuses the start in one line.

No TorchServe: the instances' start and the endpoint process are stood in for, and what they
would have been given is read (tests/serving/test_local_endpoint.py reads a real worker's)."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import pytest

from local_endpoint import launcher
from local_endpoint.launcher import LocalEndpoint
from serving.torchserve import TorchServeInstance, free_ports
from tests.conftest import REPO


def launched(monkeypatch, tmp_path, cores: int, **settings) -> tuple[list[dict], dict]:
    """Start an endpoint on a machine of ``cores`` cores: each instance's environment, and the
    endpoint process's."""
    instances, spawned = [], {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(
        TorchServeInstance, "start", lambda ts, timeout: instances.append(ts._env())
    )

    def popen(command, env, **kwargs):
        spawned.update(env)
        return SimpleNamespace(pid=0, poll=lambda: None)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(launcher, "answers_ping", lambda url: True)
    LocalEndpoint(tmp_path, port=free_ports(1)[0], **settings).start()
    return instances, spawned


@pytest.mark.parametrize(
    ("cores", "instances", "share"), [(2, 2, "1"), (2, 1, "2"), (8, 3, "2"), (1, 2, "1")]
)
def test_each_instance_and_its_restarts_get_their_share_of_the_cores(
    monkeypatch, tmp_path, cores, instances, share
):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the caller's own does not reach them
    started, endpoint = launched(monkeypatch, tmp_path, cores, instances=instances)
    assert [env["OMP_NUM_THREADS"] for env in started] == [share] * instances
    assert endpoint["OMP_NUM_THREADS"] == share


def test_the_operators_threads_win_over_the_share(monkeypatch, tmp_path):
    started, endpoint = launched(monkeypatch, tmp_path, 8, instances=2, threads=3)
    assert [env["OMP_NUM_THREADS"] for env in started] == ["3", "3"]
    assert endpoint["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_a_bad_threads_value_refuses_the_start_in_one_line(tmp_path, capsys, value):
    run_dir = tmp_path / "endpoint"
    argv = ["start", f"--threads={value}", "--run-dir", str(run_dir)]
    assert launcher.main([*argv, "--port", str(free_ports(1)[0])]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        f"endpoint_ctl start: --threads wants auto or a whole number of at least 1, "
        f"not {value!r}\n",
    )
    assert not run_dir.exists()  # nothing started


def test_make_endpoint_passes_the_operators_threads():
    def launcher_words(*settings: str) -> list[str]:
        done = subprocess.run(
            ["make", "-n", "endpoint", *settings],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.replace("\\\n", " ").splitlines()  # the recipe's continued line
        [line] = [line for line in lines if "local_endpoint.launcher" in line]
        return line.split()

    assert "--threads=auto" in launcher_words()
    words = launcher_words("ENDPOINT_INSTANCES=3", "ENDPOINT_THREADS=5")
    assert "--threads=5" in words and words[words.index("--instances") + 1] == "3"
