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
    # pfl's own methods: plugins registered by other tests in this process (own-code tests) are not pfl's
    registered = {cls.name for cls in list_methods()
                  if "+" not in cls.name and cls.__module__.startswith("pfl.methods.")}
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


def test_mutation_sample_is_seeded_its_interval_is_wilsons_and_direct_results_count_for_their_file(tmp_path):
    """pipelines/mutation_score.py: the same sample for the same seed; the 95 % Wilson interval of
    50 / 100 is 0.4038–0.5962 (the textbook value); mutmut's exit codes are read from .meta files and
    the direct runner's override them only for the mutated file as it is now (its hash)."""
    import hashlib
    import json
    import sys

    sys.path.insert(0, str(ROOT / "pipelines"))
    import mutation_score as ms

    names = [f"pfl.m.x_f__mutmut_{i}" for i in range(50)]
    assert ms.sample(names, 10, 32) == ms.sample(reversed(names), 10, 32) != ms.sample(names, 10, 33)
    lo, hi = ms.wilson(50, 100)
    assert round(lo, 4) == 0.4038 and round(hi, 4) == 0.5962
    source = tmp_path / "mutants" / "pfl" / "m.py"
    source.parent.mkdir(parents=True)
    source.write_text("x = 1\n")
    (source.parent / "m.py.meta").write_text(json.dumps({"exit_code_by_key": {
        "pfl.m.x_f__mutmut_1": 1, "pfl.m.x_f__mutmut_2": 0, "pfl.m.x_f__mutmut_3": 33, "pfl.m.x_f__mutmut_4": None,
        "pfl.m.x_f__mutmut_5": None}}))
    now = hashlib.sha256(b"x = 1\n").hexdigest()[:16]
    untested = ms._tests_digest(())  # no stats file here: no covering tests
    rows = [{"name": "pfl.m.x_f__mutmut_4", "code": 1, "file": "pfl.m", "hash": now},
            {"name": "pfl.m.x_f__mutmut_2", "code": 1, "file": "pfl.m", "hash": "stale"},
            # a survivor counts only when the tests sharing its tests' fixtures ran too
            {"name": "pfl.m.x_f__mutmut_1", "code": 0, "file": "pfl.m", "hash": now, "tests": untested},
            {"name": "pfl.m.x_f__mutmut_5", "code": 0, "file": "pfl.m", "hash": now, "tests": untested,
             "scope": "fixtures"}]
    (tmp_path / "mutants" / ms.DIRECT).write_text("".join(json.dumps(r) + "\n" for r in rows))
    codes = ms.results(tmp_path)
    # mutant 2: mutmut's survivor verdict, its direct kill on another version of the file: not run
    assert codes == {"pfl.m.x_f__mutmut_1": 1, "pfl.m.x_f__mutmut_2": None, "pfl.m.x_f__mutmut_3": 33,
                     "pfl.m.x_f__mutmut_4": 1, "pfl.m.x_f__mutmut_5": 0}
    assert ms._direct_results(tmp_path) == {"pfl.m.x_f__mutmut_4", "pfl.m.x_f__mutmut_5"}
    text = ms.score(codes, sorted(codes), {})
    assert "= 2 / 4 = 50.0 %" in text and "not run 1" in text
    assert "survived  pfl.m.x_f__mutmut_5" in text and "no tests  pfl.m.x_f__mutmut_3" in text


def test_mutation_score_leaves_the_equivalents_out_and_each_is_argued_in_the_doc(tmp_path):
    """pipelines/mutation_score.py: killed / (run − equivalent) with an equivalent survivor left out of
    the denominator, a stale equivalent named; every name of pipelines/mutation_equivalents.txt has a
    row in docs/verification.md."""
    import sys

    sys.path.insert(0, str(ROOT / "pipelines"))
    import mutation_score as ms

    codes = {"pfl.m.x_f__mutmut_1": 1, "pfl.m.x_f__mutmut_2": 0, "pfl.m.x_f__mutmut_3": 0,
             "pfl.m.xǁCǁg__mutmut_1": 36, "pfl.m.x_f__mutmut_5": None}
    eq = tmp_path / "eq.txt"
    eq.write_text("# comment\npfl.m.x_f__mutmut_3  # same value\npfl.m.x_gone__mutmut_9  # renamed\n")
    equivalents = ms.read_equivalents(eq)
    assert equivalents["pfl.m.x_f__mutmut_3"] == "same value"
    text = ms.score(codes, sorted(codes), equivalents)
    assert "killed / (run − equivalent) = 1 / 3 = 33.3 %" in text  # killed 1; survived 2 and timeout count
    assert "survived  pfl.m.x_f__mutmut_2" in text and "timeout   pfl.m.xǁCǁg__mutmut_1" in text
    assert "pfl.m.x_f__mutmut_3" not in text.split("not killed")[1].split("equivalents that")[0]
    assert "pfl.m.x_gone__mutmut_9" in text and "not run yet: 1" in text
    assert "survivors without a row in docs/verification.md: 2" in text  # the survivor and the timeout
    wrong = ms.score(codes, sorted(codes), {"pfl.m.x_f__mutmut_1": "claimed"})
    assert "a test kills them (take them off the list):\n  pfl.m.x_f__mutmut_1" in wrong
    assert ms.file_of("pfl.m.xǁCǁg__mutmut_1") == ms.file_of("pfl.m.x_f__mutmut_1") == "pfl.m"
    doc = (ROOT / "docs" / "verification.md").read_text()
    missing = [n for n in ms.read_equivalents() if f"`{n}`" not in doc]
    assert not missing, f"equivalent mutants without a row in docs/verification.md: {missing}"


def test_every_truth_test_file_is_in_the_mutation_selection():
    """pyproject's [tool.mutmut] selection names every tests/test_truth_*.py (whole or test by test):
    a truth file left out leaves its method's mutants without a test that could kill them."""
    import tomllib

    selection = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"][
        "pytest_add_cli_args_test_selection"]
    named = {s.split("::")[0] for s in selection}
    missing = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_truth_*.py")
                     if p.relative_to(ROOT).as_posix() not in named)
    assert missing == []
