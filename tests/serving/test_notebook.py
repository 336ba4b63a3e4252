"""The deploy-and-infer notebook runs top to bottom in local mode (nbclient, a real kernel,
real `make endpoint` / `make stop`), sends the image by its URL on a loopback server, answers
right, times both ways of chatting, and cleans up; every path of the machine it printed is
written relative to the repository; the committed copy carries the outputs of such a run;
sagemaker mode refuses missing parameters before anything is built or billed."""

from __future__ import annotations

import urllib.request

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from scripts.run_notebook import (
    NOTEBOOK,
    REPO,
    TTFT_PLOT,
    execute,
    machine_paths,
    problems,
    relative_paths,
    summary,
)
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
    for url in (f"http://127.0.0.1:{port}/ping", result["image_url"]):
        with pytest.raises(OSError):  # cleaned up: neither the endpoint nor the image answers
            urllib.request.urlopen(url, timeout=2)
    relative_paths(notebook, tmp_path / "endpoint")
    assert machine_paths(notebook) == []

    committed = nbformat.read(NOTEBOOK, as_version=4)
    shown = summary(committed)  # a reader sees a run's outputs on the repository page
    assert problems(shown) == [] and pictures(committed) >= 2
    assert (shown["answers"], shown["expected"]) == (result["answers"], result["expected"])
    assert TTFT_PLOT.read_bytes().startswith(b"\x89PNG")


GIVEN = {
    "ROLE_ARN": "arn:aws:iam::123456789012:role/sagemaker",
    "MODEL_DIR": "models/demo-llava",
    "S3_MODEL_URI": "s3://bucket/llava/",
}


@pytest.mark.parametrize(
    "given, refusal",
    [
        ({}, "sagemaker mode needs ROLE_ARN, MODEL_DIR, S3_MODEL_URI, IMAGE_URL"),
        # the container fetches the image: a local file is not something it can reach
        ({**GIVEN, "IMAGE_URL": "cat.png"}, "IMAGE_URL must be https://... or s3://..."),
    ],
)
def test_sagemaker_mode_stops_at_missing_parameters_before_deploying(monkeypatch, given, refusal):
    monkeypatch.setenv("NOTEBOOK_MODE", "sagemaker")
    for name in ("ROLE_ARN", "MODEL_DIR", "S3_MODEL_URI", "IMAGE_URL"):
        monkeypatch.delenv(f"NOTEBOOK_{name}", raising=False)
    for name, value in given.items():
        monkeypatch.setenv(f"NOTEBOOK_{name}", value)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells = notebook.cells[:3]  # the title, the parameters, the helpers
    client = NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": REPO}}
    )
    with pytest.raises(CellExecutionError) as failed:
        client.execute()
    assert refusal in str(failed.value)
