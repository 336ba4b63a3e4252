"""Shared fixtures: the committed demo model, loaded once per test run."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL_DIR = REPO / "models" / "demo-llava"


@pytest.fixture(scope="session")
def demo_model():
    from llava.model import load_model

    return load_model(str(DEMO_MODEL_DIR))
