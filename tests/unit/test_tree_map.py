"""docs/architecture.md's map of the tree is the tree: each place's imports of this repository's
packages, read from the code, are exactly the ones the map names, and every place is named; its
module table names every module there is, and nothing that is not."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(\w+)/` \| [^|]+ \| ([^|]+) \|$", re.MULTILINE)
NOT_MAPPED = {"tests", "notebooks", "models", "model-store", "build"}


def mapped() -> dict[str, set[str]]:
    section = ARCHITECTURE.read_text().split("## Map of the tree", 1)[1].split("\n## ", 1)[0]
    return {place: set(re.findall(r"`(\w+)`", imports)) for place, imports in ROW.findall(section)}


def places() -> set[str]:
    return {
        d.name
        for d in REPO.iterdir()
        if d.is_dir() and not d.name.startswith(".") and d.name not in NOT_MAPPED
        if any(d.rglob("*.py"))
    }


def imported(place: str, ours: set[str]) -> set[str]:
    found = set()
    for path in (REPO / place).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found |= {name.split(".")[0] for name in names}
    return found & ours - {place}


def test_every_place_with_code_is_on_the_map():
    assert places() == set(mapped())


def test_the_map_names_exactly_the_imports_of_each_place():
    table = mapped()
    ours = set(table) | {"tests"}
    actual = {place: imported(place, ours) for place in table}
    assert actual == table


def test_every_module_is_in_the_module_table_and_every_row_exists():
    section = ARCHITECTURE.read_text().split("## Every module", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w/]+\.py)`", section))
    modules = {
        str(path.relative_to(REPO))
        for place in mapped()
        if place != "scripts"
        for path in (REPO / place).rglob("*.py")
        if path.name != "__init__.py"
    }
    # scripts/ by path within it: `demo.py`, `bench/turns.py`
    scripts = {
        str(path.relative_to(REPO / "scripts"))
        for path in (REPO / "scripts").rglob("*.py")
        if path.name != "__init__.py"
    }
    assert modules - named == set()
    assert {n for n in named - scripts if "/" in n and not (REPO / n).is_file()} == set()
    assert {name for name in scripts if f"`{name}`" not in section} == set()


# The engine's rooms, top to bottom (llava/__init__.py): a room imports only rooms below it.
ENGINE_LAYERS = (
    ("shards",),
    ("engine",),
    ("sched",),
    ("sessions", "model"),
    ("exec",),
    ("kv", "sampling"),
    ("config",),
    ("intake",),
    ("errors", "counters", "files"),
)


def test_the_engines_imports_run_one_way():
    below: dict[str, set[str]] = {}
    for depth, layer in enumerate(ENGINE_LAYERS):
        lower = {room for deeper in ENGINE_LAYERS[depth + 1 :] for room in deeper}
        below |= {room: lower for room in layer}
    upward = []
    for path in (REPO / "llava").rglob("*.py"):
        relative = path.relative_to(REPO / "llava")
        room = relative.parts[0].removesuffix(".py")
        if room == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                top, _, rest = node.module.partition(".")
                target = rest.split(".")[0]
                if top == "llava" and target not in ("", room) and target not in below[room]:
                    upward.append(f"llava/{relative} imports {node.module}")
    assert upward == []
