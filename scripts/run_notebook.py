"""Execute notebooks/llava_stateful_deploy_infer.ipynb in local mode and check what it printed.

    python -m scripts.run_notebook [--port 8090] [--run-dir .run/endpoint] [--out build/notebooks]
                                   [--save-to-repo]

The notebook starts the local endpoint itself (``make endpoint``) and stops it in a ``finally``;
should the kernel die, the endpoint is stopped here too. The executed copy (outputs, plots) and
its time-to-first-token plot are written to ``--out``; with ``--save-to-repo`` they replace the
committed notebook (outputs included, so readers see them on the repository page) and
docs/notebook_ttft.png. Paths of this machine in the outputs are written relative to the
repository (the run dir outside it as ``ENDPOINT_DIR``), and a copy that still names one is not
saved to the repository. Exits non-zero when a cell fails or the summary is not what it should be.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from local_endpoint.launcher import LocalEndpoint

REPO = Path(__file__).resolve().parent.parent

NOTEBOOK = REPO / "notebooks" / "llava_stateful_deploy_infer.ipynb"
TTFT_PLOT = REPO / "docs" / "notebook_ttft.png"
RESULT = "NOTEBOOK_RESULT "
# An absolute path of the machine that ran it (/work/..., /tmp/...) in an output; the path of a
# URL (after its host) and a path relative to the repository are not one.
MACHINE_PATH = re.compile(r"(?<![\w.:/~-])/(?:[\w.-]+/)+[\w.-]*")


def execute(
    port: int, run_dir: Path, plot: Path | None = None, timeout_s: int = 300
) -> tuple[nbformat.NotebookNode, dict]:
    """Run every cell in local mode; the executed notebook and its summary line, parsed."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    os.environ.update(
        NOTEBOOK_MODE="local",
        NOTEBOOK_ENDPOINT_PORT=str(port),
        NOTEBOOK_ENDPOINT_DIR=str(run_dir),
        NOTEBOOK_TTFT_PLOT=str(plot or ""),
    )
    client = NotebookClient(
        notebook, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": REPO}}
    )
    try:
        client.execute()
    finally:
        LocalEndpoint(run_dir).stop()  # a no-op when the notebook's own clean-up ran
    return notebook, summary(notebook)


def summary(notebook: nbformat.NotebookNode) -> dict:
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            for line in output.get("text", "").splitlines():
                if line.startswith(RESULT):
                    return json.loads(line.removeprefix(RESULT))
    raise ValueError("the notebook printed no summary line")


def output_texts(notebook: nbformat.NotebookNode) -> list[str]:
    """Every text the outputs show: streams, text data (not images: base64 has slashes), errors."""
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts.append(output.get("text", ""))
            texts += [v for k, v in output.get("data", {}).items() if k.startswith("text/")]
            texts += [output.get("evalue", ""), *output.get("traceback", [])]
    return texts


def machine_paths(notebook: nbformat.NotebookNode) -> list[str]:
    return [path for text in output_texts(notebook) for path in MACHINE_PATH.findall(text)]


def relative_paths(notebook: nbformat.NotebookNode, run_dir: Path) -> None:
    """Rewrite, in place, the outputs' paths of this checkout relative to it (the notebook runs
    from the repository root), and an endpoint run dir outside it as ``ENDPOINT_DIR``."""
    names = [(f"{REPO}/", ""), (str(REPO), ".")]
    if not run_dir.is_relative_to(REPO):
        names.insert(0, (str(run_dir), "ENDPOINT_DIR"))

    def relative(text: str) -> str:
        for path, name in names:
            text = text.replace(path, name)
        return text

    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = relative(output["text"])
            for kind, value in output.get("data", {}).items():
                if kind.startswith("text/"):
                    output["data"][kind] = relative(value)
            if "traceback" in output:
                output["evalue"] = relative(output["evalue"])
                output["traceback"] = [relative(line) for line in output["traceback"]]


def problems(result: dict) -> list[str]:
    """What is wrong with a local-mode run's summary; [] when all is right."""
    found = []
    if not result["image_url"].startswith("http://127.0.0.1:"):
        found.append(f"the image did not go by its loopback URL: {result['image_url']!r}")
    if result["answers"] != result["expected"]:
        found.append(f"answers {result['answers']} != expected {result['expected']}")
    if result.get("openai_answers") != result["expected"]:
        found.append(f"OpenAI SDK answers {result.get('openai_answers')} != {result['expected']}")
    ttft = result["ttft_ms"]
    for kind in ("stateful", "stateless"):
        if len(ttft[kind]) != len(result["expected"]) or not all(ms > 0 for ms in ttft[kind]):
            found.append(f"{kind} TTFT per turn missing: {ttft}")
    second = result.get("second_image") or {}
    if second.get("images") != 2 or not (second.get("image_tokens") or 0) > 0:
        found.append(f"the second image's turn did not add it to the session: {second}")
    if not {"deploy", "clean up"} <= set(result["durations_s"]):
        found.append(f"step durations missing: {result['durations_s']}")
    if not (result["closed"] and result["cleaned_up"]):
        found.append("the session was not closed or the endpoint not stopped")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--run-dir", type=Path, default=REPO / ".run" / "endpoint")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "notebooks")
    parser.add_argument("--save-to-repo", action="store_true", help="commit-ready outputs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plot = args.out.absolute() / TTFT_PLOT.name
    run_dir = args.run_dir.absolute()
    notebook, result = execute(args.port, run_dir, plot)
    relative_paths(notebook, run_dir)
    nbformat.write(notebook, args.out / NOTEBOOK.name)
    print(json.dumps(result, indent=1))
    wrong = problems(result)
    if paths := machine_paths(notebook):
        wrong.append(f"the outputs name paths of this machine: {sorted(set(paths))}")
    if args.save_to_repo and not wrong:
        nbformat.write(notebook, NOTEBOOK)
        shutil.copyfile(plot, TTFT_PLOT)
    print("\n".join(wrong) or f"notebook ran in local mode: {args.out / NOTEBOOK.name}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
