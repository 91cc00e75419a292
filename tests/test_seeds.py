"""pfl.seeds: mean ± std over seeds, paired differences, the within-spread mark, the runs."""

import math

import pytest

from pfl.schema import ConfigError
from pfl.seeds import MARK, aggregate, check_seeds, last_mean, markdown


def _records():
    # row A: 0.80, 0.84, 0.82; row B: 0.70, 0.75, 0.71; row C (within A's spread): 0.81, 0.83, 0.80
    values = {"A": [0.80, 0.84, 0.82], "B": [0.70, 0.75, 0.71], "C": [0.81, 0.83, 0.80]}
    return [{"group": "g", "row": r, "seed": s, "last_mean": v[s], "bytes": 10.0 * (s + 1)}
            for r, v in values.items() for s in range(3)]


def test_mean_sample_std_and_paired_difference_by_hand():
    rows = {r["row"]: r for r in aggregate(_records(), reference="A")}
    a, b, c = rows["A"], rows["B"], rows["C"]
    assert a["last_mean_mean"] == pytest.approx(0.82)
    assert a["last_mean_std"] == pytest.approx(0.02)                    # sqrt((0.0004 + 0.0004 + 0) / 2)
    assert b["delta_mean"] == pytest.approx((-0.10 - 0.09 - 0.11) / 3)
    assert b["delta_std"] == pytest.approx(0.01)                        # diffs −0.10, −0.09, −0.11
    assert a["mark"] == "ref" and b["mark"] == "" and c["mark"] == MARK  # |0.8133 − 0.82| < 0.02
    assert a["bytes_mean"] == pytest.approx(20.0) and "seed_mean" not in a
    best = {r["row"]: r for r in aggregate(_records(), reference="best")}
    assert best["A"]["mark"] == "ref" and best["C"]["mark"] == MARK


def test_one_seed_never_marks_and_markdown_states_the_rule():
    one = [r for r in _records() if r["seed"] == 0]
    rows = aggregate(one, reference="A")
    assert all(r["mark"] in ("", "ref") for r in rows) and math.isnan(rows[0]["last_mean_std"])
    text = markdown(aggregate(_records(), reference="A"), columns=[("bytes", "bytes", 1.0, 0)])
    assert "| g | C | 3 | 81.33 ± 1.53 | -0.67 ± 1.53 | ≈ |" in text and MARK in text and "paired difference" in text


def test_last_mean_uses_the_last_evaluations_only():
    history = [{"test/acc_mean": 0.1}, {"train/loss": 1.0}, {"test/acc_mean": 0.5}, {"test/acc_mean": 0.7}]
    assert last_mean(history, "test/acc_mean", 2) == pytest.approx(0.6)
    assert last_mean(history, "test/acc_mean", 10) == pytest.approx(1.3 / 3)
    assert math.isnan(last_mean([], "test/acc_mean", 3))


def test_seeds_must_be_given_and_distinct():
    assert check_seeds((2, 0)) == [2, 0]
    for bad in ([], [1, 1]):
        with pytest.raises(ConfigError) as err:
            check_seeds(bad)
        assert err.value.field == "--seeds"


def test_a_failed_run_is_counted_apart_and_never_averaged():
    recs = _records() + [{"group": "g", "row": "A", "seed": 3, "last_mean": 0.0, "bytes": 0.0, "status": "FAILED"}]
    rows = {r["row"]: r for r in aggregate(recs, reference="A")}
    assert rows["A"]["seeds"] == 3 and rows["A"]["failed"] == 1
    assert rows["A"]["last_mean_mean"] == pytest.approx(0.82)
    assert "3 (1 failed)" in markdown(list(rows.values()))
