"""A chatbot backend installs the client without torch: a fresh venv, pip install from this
repository (PyPI for boto3), then the client and the local endpoint import with torch absent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

IMPORTS = """
import importlib.util, sys
import llava_client, local_endpoint.server
assert importlib.util.find_spec("torch") is None, "torch is installed"
assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
print(llava_client.__file__)
"""


@pytest.mark.slow
def test_the_client_installs_and_imports_without_torch(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    listed = subprocess.run(
        [python, "-m", "pip", "list"], capture_output=True, text=True, timeout=120
    )
    names = {line.split()[0].lower() for line in listed.stdout.splitlines()[2:]}
    assert "boto3" in names and "stateful-llava" in names
    assert not names & {"torch", "transformers", "torchserve", "pillow"}
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not the repo's copy
    imported = subprocess.run(
        [python, "-c", IMPORTS], capture_output=True, text=True, cwd="/", env=clean_env, timeout=120
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip().startswith(str(venv))
