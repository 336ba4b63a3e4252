"""The committed notebook's outputs name no path of the machine that ran it, and the writer
(``scripts/run_notebook.py``) makes such paths relative before it saves a run."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_notebook, new_output

from scripts.run_notebook import NOTEBOOK, REPO, machine_paths, relative_paths


def notebook_printing(*texts: str) -> nbformat.NotebookNode:
    outputs = [new_output("stream", name="stdout", text=text) for text in texts]
    return new_notebook(cells=[new_code_cell("...", outputs=outputs)])


def test_the_committed_outputs_name_no_path_of_the_machine_that_ran_them():
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert any(cell.get("outputs") for cell in committed.cells)  # a run's outputs, not none
    assert machine_paths(committed) == []


def test_paths_are_found_in_every_kind_of_text_output_and_urls_are_not_paths():
    notebook = notebook_printing(
        "WARNING - Overwriting /work/wt-prod28/model-store/llava.mar ...\n"
        "READY at http://127.0.0.1:56389 over http://127.0.0.1:51489/ping; s3://bucket/llava/\n"
        "image at http://127.0.0.1:43555/shape.png, model-store/llava.mar, 1/2 of and/or\n"
    )
    notebook.cells[0].outputs += [
        new_output("display_data", data={"text/plain": "logs in /tmp/prod28/ep"}),
        new_output("error", ename="OSError", evalue="no /home/me/x.png", traceback=["/opt/a/b"]),
        new_output("display_data", data={"image/png": "iVBOR+/w0K/AAA/"}),  # base64, not a path
    ]
    assert machine_paths(notebook) == [
        "/work/wt-prod28/model-store/llava.mar",
        "/tmp/prod28/ep",
        "/home/me/x.png",
        "/opt/a/b",
    ]


def test_the_writer_makes_the_checkouts_paths_relative_and_names_an_outside_run_dir():
    run_dir = "/tmp/pytest-7/endpoint"
    notebook = notebook_printing(
        f"$ make --silent endpoint ENDPOINT_DIR={run_dir}\n",
        f"WARNING - Overwriting {REPO}/model-store/llava.mar ...\n",
        f"logs in {run_dir}; stopped ({REPO}/.run/llava)\n",
    )
    relative_paths(notebook, Path(run_dir))
    assert [output.text for output in notebook.cells[0].outputs] == [
        "$ make --silent endpoint ENDPOINT_DIR=ENDPOINT_DIR\n",
        "WARNING - Overwriting model-store/llava.mar ...\n",
        "logs in ENDPOINT_DIR; stopped (.run/llava)\n",
    ]
    assert machine_paths(notebook) == []

    inside = notebook_printing(f"logs in {REPO}/.run/endpoint\n")
    relative_paths(inside, REPO / ".run" / "endpoint")
    assert inside.cells[0].outputs[0].text == "logs in .run/endpoint\n"
