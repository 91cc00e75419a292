"""docs/verification.md covers every registered method, and every test it names exists."""

import ast
import re
from pathlib import Path

from pfl.methods import list_methods

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\|\s*`(?P<name>[a-z0-9_+]+)`\s*\|.*\|\s*`(?P<test>tests/[\w/]+\.py::\w+)`\s*\|\s*$")


def _rows() -> dict[str, list[str]]:
    """method name → the test ids its rows name (rows of the first table, 'Registered methods')."""
    text = (ROOT / "docs" / "verification.md").read_text()
    section = text.split("## Registered methods", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        match = ROW.match(line.strip())
        if match:
            rows.setdefault(match["name"], []).append(match["test"])
    return rows


def _test_exists(test_id: str) -> bool:
    path, _, name = test_id.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    tree = ast.parse(file.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def test_every_registered_method_has_a_row():
    rows = _rows()
    registered = {cls.name for cls in list_methods() if "+" not in cls.name}
    assert registered, "no methods registered"
    assert sorted(registered - set(rows)) == []
    assert sorted(set(rows) - registered) == []   # no row for a method that does not exist


def test_every_named_test_exists():
    missing = [t for tests in _rows().values() for t in tests if not _test_exists(t)]
    assert missing == []


def test_the_checks_can_fail():
    """The parser sees a missing row and a missing test (guards against a regex that matches nothing)."""
    assert not _test_exists("tests/test_truth_global.py::test_that_does_not_exist")
    assert _test_exists("tests/test_verification.py::test_every_named_test_exists")
    assert len(_rows()) >= 30
