"""Every command-line entry point that runs without the engine starts from the installed wheel
alone: a fresh venv, ``pip install '.[runtime,deploy]'`` from this repository (the package index
for the dependencies), then ``python -m <entry> --help`` from ``/`` with no PYTHONPATH, so only
the shipped packages can be imported (the checkout's scripts/ and tests/ cannot).

``python -m capacity`` and ``python -m demo_model.build`` need the engine extra (torch);
the developer venv runs those (tests/unit/test_capacity.py, ``make build-demo-model``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

ENTRY_POINTS = (
    "local_endpoint",
    "local_endpoint.launcher",
    "deploy",
    "serving.torchserve",
    "serving.mar",
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    venv = tmp_path_factory.mktemp("entry-points") / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    done = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        + [f"{REPO}[runtime,deploy]"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return python


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_the_entry_point_starts_from_the_installed_packages(installed, entry):
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    started = subprocess.run(
        [installed, "-m", entry, "--help"],
        capture_output=True,
        text=True,
        cwd="/",
        env=clean_env,
        timeout=120,
    )
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith("usage:")
    where = subprocess.run(
        [installed, "-c", f"import {entry.split('.')[0]} as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        cwd="/",
        env=clean_env,
        timeout=120,
    )
    assert where.stdout.startswith(str(installed).rsplit("/bin/", 1)[0]), where.stdout
