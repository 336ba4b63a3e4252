"""The deploy-and-infer notebook runs top to bottom in local mode (nbclient, a real kernel,
real `make endpoint` / `make stop`), answers right, shows timings, and cleans up."""

from __future__ import annotations

import urllib.request

import pytest

from scripts.run_notebook import execute, problems
from scripts.torchserve_ctl import free_ports

pytestmark = pytest.mark.torchserve


def test_the_notebook_runs_in_local_mode(tmp_path):
    port = free_ports(1)[0]
    notebook, result = execute(port, tmp_path / "endpoint")
    assert result["mode"] == "local"
    assert problems(result) == []
    assert all(ms > 0 for ms in result["timings_ms"].values())
    images = [o for c in notebook.cells for o in c.get("outputs", []) if "data" in o]
    assert sum("image/png" in o["data"] for o in images) >= 2  # the image and the timing plot
    with pytest.raises(OSError):  # cleaned up: nothing answers on the port any more
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
