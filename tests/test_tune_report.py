"""What a sweep and the λ-tuning pipeline show a person (issue 28): trial names, the ranked and
rounded trial table, sweep descriptions and params, Markdown summaries, plot titles and files.

The whole pipeline, read back from its tracking store, is tests/test_tune.py's smoke tune_fpfc test.
"""

import math

import pandas as pd
import pytest
from PIL import Image

from pfl.markdown import as_markdown, frame_table, pipe_table
from pfl.tune.progress import trial_label
from pfl.tune.results import display_value, ranked
from pfl.tune.space import SearchSpace, describe_search


def _space(search, searcher="optuna"):
    space = SearchSpace(search=search, searcher=searcher)
    space.validate("")
    return space


def test_trial_names_put_what_tells_trials_apart_first_with_the_method_symbols():
    assert trial_label({"method.lam": 0.6}, "", "separate") == "λ=0.6 separate"
    assert trial_label({"method.rho": 1.5, "federation.lr": 0.2}, "λ-path") == "λ-path ρ=1.5 lr=0.2"
    assert trial_label({"method.mu": 0.0431234, "federation.lr": 0.05}, "fedprox") == "fedprox mu=0.0431 lr=0.05"
    # two keys with the same last part keep their full names
    assert trial_label({"a.lr": 1.0, "b.lr": 2.0}) == "a.lr=1 b.lr=2"


def test_a_sweep_describes_what_it_searches():
    grid = _space({"method.lam": {"type": "grid", "values": [1.0, 0.8, 0.6]}}, searcher="grid")
    assert describe_search(grid) == "method.lam ∈ {1, 0.8, 0.6} (a grid)"
    tpe = _space({"method.rho": {"type": "choice", "values": [1.0, 1.5]},
                  "federation.lr": {"type": "loguniform", "low": 0.01, "high": 0.5}})
    assert describe_search(tpe) == "method.rho ∈ {1, 1.5}, federation.lr ∈ loguniform[0.01, 0.5] (optuna)"


def test_the_trial_table_is_best_first_with_the_metric_and_the_searched_values_first():
    table = pd.DataFrame({"trial": ["a", "b", "c", "d"], "status": ["OK", "OK", "FAILED", "OK"],
                          "round": [10, 10, 3, 10], "method.mu": [0.1, 0.2, 0.3, 0.4],
                          "val/acc_mean": [0.70, 0.90, math.nan, 0.80], "mlflow_run_id": ["1", "2", "3", "4"]})
    best_first = ranked(table, "val/acc_mean", "max", ["method.mu"])
    assert list(best_first["trial"]) == ["b", "d", "a", "c"]          # the failed trial last
    assert list(best_first.columns[:4]) == ["trial", "val/acc_mean", "method.mu", "status"]
    lowest_first = ranked(table.assign(status="OK"), "val/acc_mean", "min")
    assert list(lowest_first["trial"]) == ["a", "d", "b", "c"]        # no value: last either way


@pytest.mark.parametrize("value, shown", [(0.823456789, 0.8235), (600.0, 600), (123456.78, 123457),
                                          (3.14159, 3.142), (1.5e-5, 1.5e-5), ("λ-path", "λ-path")])
def test_table_values_are_rounded_for_reading(value, shown):
    assert display_value(value) == shown and type(display_value(value)) is type(shown)


def test_summaries_are_markdown_that_keeps_tables_and_lines_apart():
    text = "\n== s1 (4 clusters): accuracy ==\n| method | acc |\n|---|---|\n| fpfc | 80.00 |\ns1 fpfc  clean 80 %\nsecond line"
    assert as_markdown(text) == ("## s1 (4 clusters): accuracy\n\n| method | acc |\n|---|---|\n| fpfc | 80.00 |\n\n"
                                 "s1 fpfc  clean 80 %\n\nsecond line")
    table = "| a | b |\n|---|---|\n| 1 | 2 |"
    assert as_markdown(table) == table                                 # a table alone is left as it is
    assert pipe_table(["x", "y|z"], [[1, "a|b"]]) == "| x | y\\|z |\n|---|---|\n| 1 | a\\|b |"
    assert frame_table(pd.DataFrame({"m": ["x"], "v": [math.nan], "w": [0.5]})) == \
        "| m | v | w |\n|---|---|---|\n| x | – | 0.5000 |"


def test_the_curves_plot_names_its_sweep_and_the_selection_plot_is_written(tmp_path):
    from pfl.plots import plot_curves
    from pfl.tune.path_report import plot_selection

    path = plot_curves({"b": ([1, 2], [0.5, 0.9]), "a": ([1, 2], [0.4, 0.6])}, tmp_path / "c.png", "val/acc_mean",
                       title="λ-path sweep: val/acc_mean of every trial", best="b")
    assert Image.open(path).text["Title"] == "λ-path sweep: val/acc_mean of every trial"
    stages = [{"lambda": lam, "val": v, "test": v - 0.01, "clusters": c, "ari": a, "lineage": r}
              for lam, v, c, a, r in [(0.6, 0.7, 9, 0.5, 100), (0.8, 0.8, 4, 1.0, 200), (1.0, 0.75, 2, 0.6, 270)]]
    runs = [{"lambda": lam, "val": v, "test": v, "clusters": 4, "ari": 1.0, "seed": 0}
            for lam, v in [(0.6, 0.72), (0.8, 0.79), (1.0, 0.7)]]
    out = plot_selection([{"selected_lambda": 0.8, "stages": stages}], runs, [0.8], tmp_path / "sel.png",
                         playoff=[{"lambda": 0.8, "val": 0.81, "lineage": 320}], title="λ selection")
    image = Image.open(out)
    assert image.text["Title"] == "λ selection" and image.size == (760, 720)


def test_the_runs_table_view_is_the_envelope_mlflows_ui_reads_and_its_address_keeps_the_key():
    import json

    from pfl.tracking_store import experiment_url, saved_view

    envelope = json.loads(saved_view("a view", [("metrics", "val/acc_mean"), ("tags", "pfl.selected_lambda")]))
    assert envelope["name"] == "a view" and isinstance(envelope["createdAt"], int)
    state = json.loads(envelope["state"])   # a string inside the envelope, as the UI stores it
    assert state["selectedColumns"] == ["metrics.`val/acc_mean`", "tags.`pfl.selected_lambda`"]
    # the bare experiment address redirects to its runs tab and loses the key: the runs tab itself
    assert experiment_url("7", "http://mlflow.example:5000/", "tune_fpfc") == \
        "http://mlflow.example:5000/#/experiments/7/runs?workflowType=machine_learning&viewStateShareKey=tune_fpfc"
    assert experiment_url("7", "sqlite:////tmp/x.db").startswith("http://127.0.0.1:5000/#/experiments/7/runs?")
