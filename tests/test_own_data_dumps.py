"""Own data as real dumps come (issue 41, items 2 and 3): LEAF writers without samples or on one
side of the split, an empty per-client file, client ids under another column name, and bad cells
named where the user finds them.

Every file is written here, small and real (LEAF JSON, Parquet with PNG bytes, CSV text); the
runs go through ``pfl run`` (``pfl.cli.main``) so that the exit status and the printed lines are
what a user sees.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pfl import cli
from pfl.config import DataConfig
from pfl.data import load_federated
from pfl.schema import ConfigError, from_dict

D = 4
RUN = ["run", "--no-track", "--set", "data.source=files", "federation.rounds=1", "federation.clients_per_round=2"]


def pfl_run(capsys, *settings: str) -> tuple[int, list[str], list[str]]:
    """(exit status, stdout lines, stderr lines) of ``pfl run --set ...``."""
    code = cli.main(RUN + list(settings))
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err.strip().splitlines()


def write_leaf(root, rng) -> None:
    """LEAF's train/ and test/ with three complete writers, one without samples (listed in both
    files with empty lists), one only in test/, one only in train/; a fourth complete writer has
    a single training sample."""
    plan = {"f0001": (6, 2), "f0002": (5, 3), "f0003": (7, 2), "f0004": (0, 0), "f0005": (0, 3),
            "f0006": (4, 0), "f0007": (1, 2)}
    for split, side in (("train", 0), ("test", 1)):
        (root / split).mkdir(parents=True)
        blob = {"users": [], "num_samples": [], "user_data": {}}
        for user, sizes in plan.items():
            n = sizes[side]
            if n == 0 and user in ("f0005", "f0006"):
                continue  # a one-sided writer is absent from the other side's file
            blob["users"].append(user)
            blob["num_samples"].append(n)
            blob["user_data"][user] = {"x": rng.random((n, D)).tolist(), "y": rng.integers(0, 3, n).tolist()}
        (root / split / f"all_data_0_niid_{split}.json").write_text(json.dumps(blob))


def test_leaf_dump_leaves_out_empty_and_one_sided_writers_with_one_count(tmp_path, capsys):
    root = tmp_path / "leaf"
    write_leaf(root, np.random.default_rng(0))
    code, out, err = pfl_run(capsys, f"data.params.path={root}", "data.num_clients=4", "data.val_fraction=0",
                             "federation.local_epochs=1")
    assert code == 0, err
    notes = [line for line in out if "left out" in line]
    assert notes == [f"note: 3 of 7 clients of {root} left out: 1 with no samples, 1 with samples in test/ only, "
                     "1 with samples in train/ only; data.params.drop_incomplete_clients: false refuses such "
                     "clients instead"]  # said once, though the config is checked twice and the data loaded
    assert any(line.startswith("method fedavg on files: FINISHED") for line in out)
    fed = load_federated(from_dict(DataConfig, {"source": "files", "num_clients": 4, "val_fraction": 0,
                                                "params": {"path": str(root)}}, "data"), seed=0)
    assert fed.client_ids == ["f0001", "f0002", "f0003", "f0007"]
    assert [c.n_test for c in fed.clients] == [2, 3, 2, 2]  # LEAF's own test samples, kept
    assert capsys.readouterr().out == ""  # the same note is not said again in this process


def test_leaf_refusals_name_the_writers_and_their_hints_work(tmp_path, capsys):
    root = tmp_path / "leaf"
    write_leaf(root, np.random.default_rng(1))
    train, test = "train/all_data_0_niid_train.json", "test/all_data_0_niid_test.json"
    code, out, err = pfl_run(capsys, f"data.params.path={root}", "data.num_clients=4",
                             "data.params.drop_incomplete_clients=false")
    assert code == 2 and err == [
        f"config error: data.params.drop_incomplete_clients: 3 of 7 clients of {root} cannot be used: 'f0004' has "
        f"no samples ({train}, {test}); 'f0005' has samples in test/ only ({test}); 'f0006' has samples in "
        f"train/ only ({train}); set data.params.drop_incomplete_clients: true to leave them out"]
    # f0007 has 1 training sample and validation needs a second: the hint counts training samples
    code, _, err = pfl_run(capsys, f"data.params.path={root}", "data.num_clients=4", "data.val_fraction=0.2")
    assert code == 2 and err == [
        "config error: data.params.path: client 'f0007' has 1 training samples, fewer than the 2 training samples "
        "(one for training, one for validation); set data.params.min_client_samples: 2 to leave such clients out"]
    code, out, err = pfl_run(capsys, f"data.params.path={root}", "data.num_clients=3", "data.val_fraction=0.2",
                             "data.params.min_client_samples=2")
    assert code == 0, err
    assert [line for line in out if "left out" in line] == [
        f"note: 4 of 7 clients of {root} left out: 1 with no samples, 1 with samples in test/ only, 1 with "
        "samples in train/ only, 1 with fewer than 2 training samples (data.params.min_client_samples); "
        "data.params.drop_incomplete_clients: false refuses such clients instead"]
    code, _, err = pfl_run(capsys, f"data.params.path={root}", "data.num_clients=5", "data.val_fraction=0")
    assert code == 2 and err == [
        f"config error: data.num_clients: {root} has 4 clients (3 left out: 1 with no samples, 1 with samples in "
        "test/ only, 1 with samples in train/ only); allowed range [1, 4], or all"]


def test_an_empty_client_file_is_a_client_without_samples(tmp_path, capsys):
    rng = np.random.default_rng(2)
    folder = tmp_path / "sites"
    folder.mkdir()
    for site, n in (("3", 12), ("10", 9), ("7", 0), ("21", 11)):
        pq.write_table(pa.table({"label": rng.integers(0, 2, n), **{f"f{j}": rng.normal(size=n) for j in range(D)}}),
                       folder / f"{site}.parquet")
    code, out, err = pfl_run(capsys, f"data.params.path={folder}", "data.num_clients=3")
    assert code == 0, err
    assert [line for line in out if "left out" in line] == [
        f"note: 1 of 4 clients of {folder} left out: 1 with no samples; data.params.drop_incomplete_clients: "
        "false refuses such clients instead"]
    fed = load_federated(from_dict(DataConfig, {"source": "files", "num_clients": 3,
                                                "params": {"path": str(folder)}}, "data"), seed=0)
    assert fed.client_ids == ["3", "10", "21"] and fed.input_shape == (D,)
    code, _, err = pfl_run(capsys, f"data.params.path={folder}", "data.num_clients=3",
                           "data.params.drop_incomplete_clients=false")
    assert code == 2 and err == [
        f"config error: data.params.drop_incomplete_clients: 1 of 4 clients of {folder} cannot be used: '7' has no "
        "samples (7.parquet); set data.params.drop_incomplete_clients: true to leave them out"]


def png(rng) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (6, 6), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_client_ids_under_another_name_are_found_not_blamed_on_the_image(tmp_path, capsys):
    rng = np.random.default_rng(3)
    n = 48
    image = pa.array([{"bytes": png(rng), "path": None} for _ in range(n)],
                     type=pa.struct([("bytes", pa.binary()), ("path", pa.null())]))  # as Hugging Face writes it
    path = tmp_path / "hf_style.parquet"
    pq.write_table(pa.table({"image": image, "label": rng.integers(0, 3, n),
                             "writer": [f"f{i % 6:04d}_{i % 6}" for i in range(n)]}), path)
    code, _, err = pfl_run(capsys, f"data.params.path={path}", "data.num_clients=3")
    assert code == 2 and err == [
        f"config error: data.params.client_column: no column 'client' in {path}; candidates: 'writer' (6 distinct "
        "values over 48 rows) — set data.params.client_column: writer"]
    code, out, err = pfl_run(capsys, f"data.params.path={path}", "data.params.client_column=writer",
                             "data.num_clients=6")
    assert code == 0, err
    # number features beside an integer id column: a pooled partition by default (the id is a
    # feature then), but asking for natural clients names the column, most distinct values first
    path = tmp_path / "sites.parquet"
    pq.write_table(pa.table({"label": np.arange(40) % 2, "site": np.arange(40) % 8, "batch": np.arange(40) % 4,
                             "row_id": np.arange(40), "f0": rng.normal(size=40)}), path)
    with pytest.raises(ConfigError) as caught:
        load_federated(from_dict(DataConfig, {"source": "files", "num_clients": 4, "partition": {"kind": "natural"},
                                              "params": {"path": str(path)}}, "data"), seed=0)
    assert str(caught.value) == (
        f"data.params.client_column: no column 'client' in {path}; candidates: 'site' (8 distinct values over 40 "
        "rows), 'batch' (4 distinct values over 40 rows) — set data.params.client_column: site")
    # a client column present: a text column is never a feature, and the message names it
    path = tmp_path / "notes.parquet"
    pq.write_table(pa.table({"label": np.arange(8) % 2, "client": np.arange(8) % 2, "f0": np.arange(8.0),
                             "note": ["ok"] * 8}), path)
    with pytest.raises(ConfigError) as caught:
        load_federated(from_dict(DataConfig, {"source": "files", "num_clients": 2,
                                              "params": {"path": str(path)}}, "data"), seed=0)
    assert caught.value.field == "data.params.feature_columns" and "column 'note' holds string" in str(caught.value)


CSV_ROWS = 30


@pytest.mark.parametrize("cell, line, said", [
    ("NaN", 13, "line 13, column 'f2' is NaN (not a number); features must be finite"),
    ("", 7, "line 7, column 'f2' is empty; fill or drop missing features first"),
    ("NA", 30, "line 30, column 'f2' holds 'NA', not a number, where the column's other cells are numbers"),
])
def test_a_bad_csv_cell_is_named_by_its_line_in_the_file(tmp_path, capsys, cell, line, said):
    rng = np.random.default_rng(4)
    lines = ["label,client,f0,f1,f2"]
    for r in range(CSV_ROWS):
        values = [str(v) for v in rng.normal(size=3).round(3)]
        lines.append(",".join([str(r % 2), f"c{r % 3}"] + values))
    fields = lines[line - 1].split(",")  # the file's line `line`, counted from 1 (the header is line 1)
    fields[-1] = cell
    lines[line - 1] = ",".join(fields)
    path = tmp_path / "cells.csv"
    path.write_text("\n".join(lines) + "\n")
    code, _, err = pfl_run(capsys, f"data.params.path={path}", "data.num_clients=3")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"config error: data.params.path: {path}: {said}"), err[0]
