"""docs/design.md is the design document the code cites: every citation resolves to one of
its sections, and every test it names as proof exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import REPO

DESIGN = REPO / "docs" / "design.md"
CITATION = "docs/design.md §"
THIS_FILE = Path(__file__).resolve()


def repo_text_files() -> dict[str, str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    texts = {}
    for name in listed:
        path = REPO / name
        if path == THIS_FILE:  # it spells out what it looks for
            continue
        if path.is_file() and path.suffix in {".py", ".md", ".yaml", ".properties", ".cfg", ""}:
            texts[name] = path.read_text(errors="replace")
    return texts


def headings() -> list[str]:
    return re.findall(r"^## (.+)$", DESIGN.read_text(), re.MULTILINE)


def test_nothing_cites_a_design_file_outside_the_repo():
    citing = [name for name, text in repo_text_files().items() if "DESIGN.md" in text]
    assert citing == []


def test_every_citation_names_a_section_of_docs_design():
    sections = headings()
    unresolved = []
    for name, text in repo_text_files().items():
        for cited in text.split(CITATION)[1:]:
            if not any(cited.startswith(section) for section in sections):
                unresolved.append(f"{name}: §{cited[:40]!r}")
    assert unresolved == []


def test_every_test_named_as_proof_exists():
    missing, file = [], None
    for match in re.finditer(r"`(tests/[\w/]+\.py)?::(\w+)`", DESIGN.read_text()):
        file = match.group(1) or file  # `::name` continues the file named before it
        if f"def {match.group(2)}(" not in (REPO / file).read_text():
            missing.append(f"{file}::{match.group(2)}")
    assert missing == []
