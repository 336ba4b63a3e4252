"""What the Makefile would run (``make -n``: printed, not run)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.conftest import REPO


def dry_run(*args: str) -> list[str]:
    done = subprocess.run(
        ["make", "-n", "-B", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def pip_installs(lines: list[str]) -> list[str]:
    return [
        line.split(" install -q ", 1)[1].strip() for line in lines if " pip install -q " in line
    ]


PROJECT = "-e '.[engine,serve,deploy,dev,notebook]'"


def test_setup_installs_the_cpu_torch_first_by_default(tmp_path):
    installs = pip_installs(dry_run("setup", f"VENV={tmp_path}/venv"))
    assert installs == ["--upgrade pip", "torch==2.13.0", PROJECT]


def test_setup_on_a_cuda_machine_takes_torch_from_the_index_given(tmp_path):
    index = "https://wheels.example/whl/cu128"
    installs = pip_installs(dry_run("setup", f"VENV={tmp_path}/venv", f"TORCH_INDEX={index}"))
    # torch alone comes from that index, before anything that depends on it
    assert installs[1] == f"torch==2.13.0 --index-url {index}"
    assert installs[2] == PROJECT


def test_setup_installs_the_jdk_whose_jcmd_the_leak_test_needs(tmp_path):
    """The JRE alone has java but not jcmd: test_torchserve_async's leak test would skip."""
    [java] = [line for line in dry_run("setup", f"VENV={tmp_path}/venv") if "openjdk" in line]
    assert java.startswith("command -v jcmd ") and "openjdk-17-jdk-headless" in java


def test_image_is_the_production_build_and_the_container_tier_runs_after_test():
    [build] = [line for line in dry_run("image") if line.startswith("docker")]
    # the Dockerfile's defaults: CUDA torch (its own check), Docker Hub's python base
    assert build.split() == ["docker", "build", "-t", "stateful-llava", "."]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci.index("make test-container") > ci.index("make test")


@pytest.mark.thorough
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: gpu-check runs")
def test_gpu_check_without_cuda_says_so_in_one_line_and_succeeds():
    done = subprocess.run(
        ["make", "-s", "gpu-check"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()]
    assert "no CUDA device" in done.stdout
