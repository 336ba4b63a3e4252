"""The README's Python example runs as written and answers about the image."""

from __future__ import annotations

import re

from tests.conftest import REPO


def readme_python_snippet(heading: str) -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split(f"## {heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_engine_from_python_snippet_runs(tmp_path, sample, monkeypatch, capsys):
    # The snippet reads shape.png and models/demo-llava from the current directory.
    sample.image.save(tmp_path / "shape.png")
    (tmp_path / "models").symlink_to(REPO / "models")
    monkeypatch.chdir(tmp_path)
    code = readme_python_snippet("The engine from Python, without TorchServe")
    exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"What shape is it? {sample.shape} (")
    assert lines[1].startswith(f"And its color? {sample.color} (")
