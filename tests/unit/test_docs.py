"""The docs (README.md and docs/**/*.md) hold together, and the code's citations of them resolve.

A citation is ``docs/<file>.md §<heading>``: the file must exist and have that ``## `` (or
``### ``) heading. Every test a page names as proof exists; every relative link and ``#anchor``
resolves (GitHub's heading slugs); no page is too long; no page speaks of issue numbers.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import REPO

DOCS = REPO / "docs"
README = REPO / "README.md"
THIS_FILE = Path(__file__).resolve()
RETIRED = "docs/" + "design.md"  # the single design document the docs replaced
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".properties", ".cfg", ".toml", ".sh", ""}
MAX_README_LINES = 250
MAX_DOC_LINES = 800

# docs/<file>.md, then § (a line break, with a comment's "#", may come between them)
CITATION = re.compile(r"docs/([\w./-]+\.md)(?:\s|#)*§")
# a line break inside a cited heading, with the next line's indentation and comment marker
BREAK = re.compile(r"[ \t]*\n[ \t]*(?:#[ \t]*)?")
# more sections of the same file cited right after one: "§Step runner, §Decode graphs"
AND_ALSO = re.compile(r"(?:,|;| and) ?§")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PROOF = re.compile(r"`(tests/[\w/]+\.py)?::(\w+)`")
ISSUE_NUMBER = re.compile(r"\b(?:issues?|items?)\s+#?\d", re.IGNORECASE)


def repo_text_files() -> dict[str, str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    texts = {}
    for name in listed:
        path = REPO / name
        if path.resolve() == THIS_FILE:  # it spells out what it looks for
            continue
        if path.is_file() and path.suffix in TEXT_SUFFIXES:
            texts[name] = path.read_text(errors="replace")
    return texts


def doc_pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def without_code(text: str) -> str:
    """The page with its fenced code blocks emptied (their lines kept, for line counts)."""
    return FENCE.sub(lambda block: "\n" * block.group(0).count("\n"), text)


def headings(path: Path, levels: str = "#{1,6}") -> list[str]:
    return re.findall(rf"^{levels} (.+?)[ \t]*$", without_code(path.read_text()), re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but - and _ dropped, spaces → -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(path):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def unresolved_citations(name: str, text: str) -> list[str]:
    problems = []
    for match in CITATION.finditer(text):
        target = DOCS / match.group(1)
        cited = BREAK.sub(" ", text[match.end() : match.end() + 400])
        if not target.is_file():
            problems.append(f"{name}: docs/{match.group(1)} does not exist")
            continue
        sections = sorted(headings(target, "#{2,3}"), key=len, reverse=True)
        while True:
            section = next((s for s in sections if cited.startswith(s)), None)
            if section is None:
                problems.append(f"{name}: docs/{match.group(1)} has no section {cited[:50]!r}")
                break
            more = AND_ALSO.match(cited, len(section))
            if more is None:
                break
            cited = cited[more.end() :]
    return problems


def test_nothing_cites_a_design_file_outside_the_repo():
    citing = [name for name, text in repo_text_files().items() if "DESIGN.md" in text]
    assert citing == []


def test_nothing_cites_the_retired_design_document():
    citing = [name for name, text in repo_text_files().items() if RETIRED in text]
    assert citing == []


def test_every_citation_names_a_section_of_a_docs_file():
    unresolved = []
    for name, text in repo_text_files().items():
        unresolved += unresolved_citations(name, text)
    assert unresolved == []


def test_every_test_named_as_proof_exists():
    missing = []
    for page in doc_pages():
        file = None  # `::name` continues the file named before it on the same page
        for match in PROOF.finditer(page.read_text()):
            file = match.group(1) or file
            where = f"{page.relative_to(REPO)}: {file}::{match.group(2)}"
            if (
                file is None
                or not (REPO / file).is_file()
                or f"def {match.group(2)}(" not in (REPO / file).read_text()
            ):
                missing.append(where)
    assert missing == []


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in doc_pages():
        text = INLINE_CODE.sub("", without_code(page.read_text()))
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(REPO)}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
                broken.append(f"{where} (no such heading)")
    assert broken == []


def test_the_pages_stay_short():
    too_long = {
        str(page.relative_to(REPO)): lines
        for page in doc_pages()
        if (lines := len(page.read_text().splitlines()))
        > (MAX_README_LINES if page == README else MAX_DOC_LINES)
    }
    assert too_long == {}


def test_no_page_speaks_of_issue_numbers():
    found = [
        f"{page.relative_to(REPO)}: {match.group(0)!r}"
        for page in doc_pages()
        for match in ISSUE_NUMBER.finditer(page.read_text())
    ]
    assert found == []
