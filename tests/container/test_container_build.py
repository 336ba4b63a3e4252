"""The image's build side, without a Docker engine (the container tier builds and runs the
image itself: tests/container/test_container_image.py):

- the files the Dockerfile copies are enough to run the entrypoint (run from a copy of just
  those files, with the image's PYTHONPATH);
- scripts/build_and_push.sh calls ECR login, build, tag and push in order, with `docker` and
  `aws` replaced by stubs that record their arguments (stand-ins because no AWS account, hence
  no ECR to push to, is reachable here), and fails with a readable line when it must.

- the container tier (scripts/container_tier.py) skips with one line only when the Docker engine
  cannot start, and fails when a build fails (docker and dockerd replaced by stubs: the real
  ones are what the tier itself runs).

hadolint and shellcheck run in `make lint`.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

ACCOUNT = "123456789012"


def dockerfile_copies() -> list[str]:
    """The sources of the Dockerfile's COPY instructions."""
    sources = []
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if match := re.match(r"COPY\s+(.+)\s+\S+$", line):
            sources += match.group(1).split()
    return sources


def test_image_files_are_enough_to_run_the_entrypoint(tmp_path):
    image = tmp_path / "opt" / "stateful-llava"
    image.mkdir(parents=True)
    for source in dockerfile_copies():
        path, target = REPO / source, image / source
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(
                path, target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True
            )
        else:
            shutil.copy(path, target)
    (tmp_path / "model").mkdir()
    # The image pip-installs the copied packages; here the copy stands in for its
    # site-packages, ahead of the developer venv's editable install of this checkout.
    env = {
        **os.environ,
        "PYTHONPATH": str(image),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SERVE_MODEL_DIR": str(tmp_path / "model"),
    }
    run = subprocess.run(
        [image / "docker" / "entrypoint.sh", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    # Every import resolved inside the copy; it stopped only because the model dir is empty.
    assert run.returncode == 2 and "serve: no model in" in run.stderr, run.stderr


def imported_packages(*places: str) -> set[str]:
    """This repository's top-level packages that the modules under ``places`` import."""
    ours = {p.parent.name for p in REPO.glob("*/__init__.py")}
    found = set()
    for place in places:
        for path in (REPO / place).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
                elif isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
    return found & ours


def test_the_image_installs_every_package_its_entrypoint_imports():
    """docker/serve.py imports installed packages only (no sys.path edits): each one it, the
    serving runtime (serving/container.py, its start, among it) or the handler imports must be
    copied before the image's pip install."""
    lines = (REPO / "Dockerfile").read_text().splitlines()
    install = next(i for i, line in enumerate(lines) if 'pip install ".[' in line)
    copied = {
        source
        for line in lines[:install]
        if (match := re.match(r"COPY\s+(.+)\s+\S+$", line))
        for source in match.group(1).split()
    }
    needed = imported_packages("docker", "serving", "handlers") | {"serving", "handlers"}
    assert needed - copied == set()


def test_the_build_context_holds_everything_the_dockerfile_copies():
    """.dockerignore lets only what it names into the build context (``*``, then ``!name``)."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines
    allowed = {line[1:] for line in lines if line.startswith("!")}
    assert {source.split("/")[0] for source in dockerfile_copies()} - allowed == set()


STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
case "$(basename "$0") $*" in
  "aws sts get-caller-identity"*) {sts} ;;
  "aws ecr describe-repositories"*) exit 254 ;;
  "aws ecr get-login-password"*) echo secret ;;
  "docker login"*) cat > /dev/null ;;
esac
"""


def stubbed_path(tmp_path: Path, sts: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("docker", "aws"):
        stub = bin_dir / tool
        stub.write_text(STUB.format(log=tmp_path / "calls.log", sts=sts))
        stub.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "AWS_REGION": "eu-west-1"}


def build_and_push(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [REPO / "scripts" / "build_and_push.sh", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_build_and_push_logs_in_builds_tags_and_pushes(tmp_path):
    env = stubbed_path(tmp_path, sts=f"echo {ACCOUNT}")
    run = build_and_push(env, "--repository", "llava-test", "--tag", "v1")
    assert run.returncode == 0, run.stderr
    image = f"{ACCOUNT}.dkr.ecr.eu-west-1.amazonaws.com/llava-test:v1"
    calls = (tmp_path / "calls.log").read_text().splitlines()
    # The login pipe's two ends run at once: their order in the log is either.
    calls[4:6] = sorted(calls[4:6], key=lambda c: c.startswith("docker"))
    assert [c.split()[:2] for c in calls] == [
        ["docker", "info"],
        ["aws", "sts"],
        ["aws", "ecr"],  # describe-repositories: not there ...
        ["aws", "ecr"],  # ... so create-repository
        ["aws", "ecr"],  # get-login-password | docker login
        ["docker", "login"],
        ["docker", "build"],
        ["docker", "push"],
    ]
    assert "create-repository" in calls[3] and "--repository-name llava-test" in calls[3]
    assert "get-login-password" in calls[4]
    assert f"--password-stdin {ACCOUNT}.dkr.ecr.eu-west-1.amazonaws.com" in calls[5]
    assert f"-t {image} " in calls[6] and calls[6].endswith(str(REPO / "scripts" / ".."))
    assert calls[7] == f"docker push {image}"
    assert f"pushed {image}" in run.stdout


@pytest.mark.parametrize(
    "sts, args, message",
    [
        ("exit 255", [], "no AWS credentials"),
        (f"echo {ACCOUNT}", ["--tag"], "--tag needs a value"),
        (f"echo {ACCOUNT}", ["--colour", "red"], "unknown argument: --colour"),
    ],
)
def test_build_and_push_failures_say_what_to_do(tmp_path, sts, args, message):
    run = build_and_push(stubbed_path(tmp_path, sts), *args)
    assert run.returncode != 0
    assert message in run.stderr
    log = tmp_path / "calls.log"
    assert "docker build" not in (log.read_text() if log.exists() else "")


TIER_STUB = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
case "$(basename "$0") $1" in
  "docker info") {info} ;;
  "docker build") echo "Step 10/23 : RUN apt-get update"; echo "E: no network"; exit 1 ;;
  "dockerd "*) echo "failed to start daemon: permission denied"; exit 1 ;;
esac
"""


def container_tier(tmp_path: Path, info: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("docker", "dockerd", "debootstrap"):
        stub = bin_dir / tool
        stub.write_text(TIER_STUB.format(log=tmp_path / "calls.log", info=info))
        stub.chmod(0o755)
    return subprocess.run(
        [sys.executable, REPO / "scripts" / "container_tier.py", "--run-dir", tmp_path / "run"],
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_container_tier_skips_with_one_line_only_when_docker_cannot_start(tmp_path):
    run = container_tier(tmp_path, info="exit 1")  # no engine answers, and dockerd fails
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "container tier: SKIPPED, Docker cannot run here: dockerd exited with 1: "
        "failed to start daemon: permission denied"
    ]
    assert "docker build" not in (tmp_path / "calls.log").read_text()


def test_the_container_tier_fails_when_the_image_does_not_build(tmp_path):
    run = container_tier(tmp_path, info="exit 0")  # an engine answers, the base is "cached"
    assert run.returncode == 1
    assert (
        run.stdout.splitlines()[-1] == "container tier: FAILED: docker build failed: E: no network"
    )
    calls = (tmp_path / "calls.log").read_text()
    assert "--network host" in calls and "--build-arg TORCH_FLAVOUR=cpu" in calls
