"""The wire contract's names are written once, in llava_wire, which imports nothing."""

from __future__ import annotations

import ast
import re

import llava_wire
from llava import errors
from llava.sessions.store import CLOSED, EVICTED, EXPIRED
from llava_wire import CLOSED_SESSION_HEADER, NEW_SESSION_HEADER, SESSION_HEADER
from tests.conftest import REPO

WIRE = REPO / "llava_wire" / "__init__.py"
# Every package that ships or speaks the contract (tests may spell it out on purpose).
SPEAKERS = ("llava", "handlers", "serving", "local_endpoint", "llava_client", "docker", "scripts")
CODE = re.compile(r"""(?:\bcode\s*=\s*|"code":\s*)"([A-Z_]+)\"""")


def source_files():
    for package in SPEAKERS:
        yield from (REPO / package).rglob("*.py")


def test_the_wire_module_imports_nothing():
    tree = ast.parse(WIRE.read_text())
    assert [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)] == []


def test_every_engine_error_code_is_a_wire_code():
    classes = [c for c in vars(errors).values() if isinstance(c, type)]
    codes = {c.code for c in classes if issubclass(c, errors.EngineError)}
    assert codes | {CLOSED, EXPIRED, EVICTED} <= llava_wire.ERROR_CODES


def test_every_error_code_written_in_the_code_is_a_wire_code():
    written = {m for path in source_files() for m in CODE.findall(path.read_text())}
    assert written, "the pattern found no codes at all: it no longer matches the code"
    assert written - llava_wire.ERROR_CODES == set()


def test_outside_the_engine_error_codes_are_llava_wires_constants_never_literals():
    """The engine keeps its codes on its error classes (it imports no wire package); every other
    speaker names a code by its llava_wire constant."""
    spelled = {
        f"{path.relative_to(REPO)}: {code}"
        for path in source_files()
        if path.parts[len(REPO.parts)] not in ("llava", "scripts")
        for code in llava_wire.ERROR_CODES
        if f'"{code}"' in path.read_text()
    }
    assert spelled == set()


def test_the_header_names_are_spelled_only_in_llava_wire():
    spelled = {
        str(path.relative_to(REPO))
        for path in source_files()
        for name in (SESSION_HEADER, NEW_SESSION_HEADER, CLOSED_SESSION_HEADER)
        if f'"{name}"' in path.read_text()
    }
    assert spelled == set()
