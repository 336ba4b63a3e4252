"""The deploy-and-infer notebook runs top to bottom in local mode (nbclient, a real kernel,
real `make endpoint` / `make stop`), answers right, times both ways of chatting, and cleans up;
the committed copy carries the outputs of such a run; sagemaker mode refuses missing
parameters before anything is built or billed."""

from __future__ import annotations

import urllib.request

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from scripts.run_notebook import NOTEBOOK, REPO, TTFT_PLOT, execute, problems, summary
from serving.torchserve import free_ports

pytestmark = pytest.mark.torchserve


def pictures(notebook) -> int:
    outputs = [o for c in notebook.cells for o in c.get("outputs", []) if "data" in o]
    return sum("image/png" in o["data"] for o in outputs)


def test_the_notebook_runs_in_local_mode_like_its_committed_outputs(tmp_path):
    port = free_ports(1)[0]
    notebook, result = execute(port, tmp_path / "endpoint", tmp_path / "ttft.png")
    assert result["mode"] == "local"
    assert problems(result) == []
    assert pictures(notebook) >= 2  # the image and the TTFT plot
    assert (tmp_path / "ttft.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(OSError):  # cleaned up: nothing answers on the port any more
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)

    committed = nbformat.read(NOTEBOOK, as_version=4)
    shown = summary(committed)  # a reader sees a run's outputs on the repository page
    assert problems(shown) == [] and pictures(committed) >= 2
    assert (shown["answers"], shown["expected"]) == (result["answers"], result["expected"])
    assert TTFT_PLOT.read_bytes().startswith(b"\x89PNG")


def test_sagemaker_mode_stops_at_missing_parameters_before_deploying(monkeypatch):
    monkeypatch.setenv("NOTEBOOK_MODE", "sagemaker")
    for name in ("ROLE_ARN", "MODEL_DIR", "S3_MODEL_URI", "IMAGE_URL"):
        monkeypatch.delenv(f"NOTEBOOK_{name}", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells = notebook.cells[:3]  # the title, the parameters, the helpers
    client = NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": REPO}}
    )
    with pytest.raises(CellExecutionError) as failed:
        client.execute()
    assert "sagemaker mode needs ROLE_ARN, MODEL_DIR, S3_MODEL_URI, IMAGE_URL" in str(failed.value)
