"""Data with its own clients uses every client by default (issue 41, item 1).

A Parquet table and a LEAF folder of 30 writers are written here. Without ``data.num_clients`` a
run has all 30 and says so in its first line; ``data.num_clients: N`` draws N of them with the
experiment seed (not the first N), the same N every time for a seed; ``all`` says every client;
anything else is one line, exit 2. The generated sources keep their 20 clients.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pfl import cli
from pfl.config import DataConfig
from pfl.data import load_federated
from pfl.schema import ConfigError, from_dict

WRITERS = [f"w{i:02d}" for i in range(30)]
RUN = ["run", "--no-track", "--set", "data.source=files", "federation.rounds=1", "federation.local_epochs=1",
       "federation.clients_per_round=2"]
# what rng_for(seed, "pfl.data.clients") draws from 30 clients, kept in id order
DRAWN = {0: ["w01", "w03", "w10", "w12", "w19", "w20", "w21", "w22", "w28", "w29"],
         1: ["w02", "w03", "w07", "w08", "w12", "w23", "w24", "w25", "w27", "w28"]}


def write_parquet(path) -> None:
    rng = np.random.default_rng(0)
    n = 12 * len(WRITERS)
    order = rng.permutation(n)  # the writers' rows interleaved, as a real dump has them
    pq.write_table(pa.table({"client": [WRITERS[i % len(WRITERS)] for i in order], "label": rng.integers(0, 3, n),
                             **{f"f{j}": rng.normal(size=n) for j in range(4)}}), path)


def write_leaf(root) -> None:
    rng = np.random.default_rng(1)
    for split, n in (("train", 8), ("test", 3)):
        (root / split).mkdir(parents=True)
        blob = {"users": WRITERS, "num_samples": [n] * len(WRITERS),
                "user_data": {u: {"x": rng.random((n, 4)).tolist(), "y": rng.integers(0, 3, n).tolist()}
                              for u in WRITERS}}
        (root / split / f"all_data_{split}.json").write_text(json.dumps(blob))


@pytest.fixture(params=["parquet", "leaf"])
def data_path(request, tmp_path):
    if request.param == "parquet":
        path = tmp_path / "writers.parquet"
        write_parquet(path)
    else:
        path = tmp_path / "leaf"
        write_leaf(path)
    return path


def loaded(path, seed: int = 0, **data):
    data = {"source": "files", "params": {"path": str(path)}, **data}
    return load_federated(from_dict(DataConfig, data, "data"), seed=seed)


def pfl_run(capsys, *settings: str) -> tuple[int, list[str], list[str]]:
    code = cli.main(RUN + list(settings))
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err.strip().splitlines()


def test_by_default_a_run_has_every_client_and_says_so_first(data_path, capsys):
    code, out, err = pfl_run(capsys, f"data.params.path={data_path}")
    assert code == 0, err
    assert out[0] == f"note: 30 clients from {data_path} (every client of the data; data.num_clients selects fewer)"
    assert loaded(data_path).client_ids == WRITERS
    # resolved before the config's own notes and its printed form
    code, out, _ = pfl_run(capsys, f"data.params.path={data_path}", "federation.clients_per_round=40")
    assert out[0] == ("note: federation.clients_per_round=40 is more than data.num_clients=30: every round "
                      "samples all 30 clients")
    code, out, _ = pfl_run(capsys, f"data.params.path={data_path}", "--print-config")
    assert code == 0 and "  num_clients: 30" in out


def test_num_clients_draws_that_many_with_the_seed_not_the_first(tmp_path, capsys):
    path = tmp_path / "writers.parquet"
    write_parquet(path)
    code, out, err = pfl_run(capsys, f"data.params.path={path}", "data.num_clients=10", "seed=1")
    assert code == 0, err
    assert out[0] == f"note: 10 of 30 clients of {path}, drawn with seed 1 (data.num_clients; all = every one)"
    first = loaded(path, seed=0, num_clients=10)
    assert first.client_ids == DRAWN[0] != WRITERS[:10]
    again = loaded(path, seed=0, num_clients=10)  # the same ten, from the partition cache
    assert again.client_ids == DRAWN[0] and again.partition_hash == first.partition_hash
    assert [c.n_train for c in again.clients] == [c.n_train for c in first.clients]
    assert loaded(path, seed=1, num_clients=10).client_ids == DRAWN[1]


def test_a_draw_uses_the_clients_left_after_the_dropped_ones(tmp_path):
    root = tmp_path / "leaf"
    write_leaf(root)
    blob_path = root / "train" / "all_data_train.json"
    blob = json.loads(blob_path.read_text())
    blob["user_data"]["w00"] = {"x": [], "y": []}  # a writer without training samples is left out first
    blob["num_samples"][0] = 0
    blob_path.write_text(json.dumps(blob))
    fed = loaded(root, num_clients=10)
    assert "w00" not in fed.client_ids and len(fed.client_ids) == 10
    assert loaded(root).client_ids == WRITERS[1:]
    with pytest.raises(ConfigError) as caught:  # none left: one line, not a federation of no one
        loaded(root, params={"path": str(root), "min_client_samples": 100})
    assert str(caught.value) == (
        f"data.params.path: {root} has no client a natural partition can use (30 left out: 1 with samples in test/ "
        "only, 29 with fewer than 100 training samples (data.params.min_client_samples))")


def test_all_is_every_client_and_the_same_partition_as_the_default(tmp_path, capsys):
    path = tmp_path / "writers.parquet"
    write_parquet(path)
    every = loaded(path, num_clients="all")
    assert every.client_ids == WRITERS
    assert every.partition_hash == loaded(path).partition_hash == loaded(path, num_clients=30).partition_hash
    code, out, _ = pfl_run(capsys, f"data.params.path={path}", "data.num_clients=all", "--print-config")
    assert code == 0 and "  num_clients: 30" in out


ALLOWED = ("allowed: a whole number >= 1, or all (every client of data with its own clients: files or hf with a "
           "natural partition); null = the default (all for such data, else 20)")


@pytest.mark.parametrize("value, shown", [("0", "0"), ("-3", "-3"), ("every", "'every'"), ("2.5", "'2.5'")])
def test_a_bad_num_clients_is_one_line_with_the_allowed_values(tmp_path, capsys, value, shown):
    path = tmp_path / "writers.parquet"
    write_parquet(path)
    code, out, err = pfl_run(capsys, f"data.params.path={path}", f"data.num_clients={value}")
    assert code == 2 and out == [] and err == [f"config error: data.num_clients: {shown} is not allowed; {ALLOWED}"]


def test_generated_sources_keep_20_clients_and_refuse_all(tmp_path, capsys):
    from pfl.resolver import load

    assert load(None, {}).data.num_clients == 20
    assert load(None, {"data.source": "fpfc_synthetic"}).data.num_clients == 20
    assert loaded_digits().num_clients == 20
    code = cli.main(["run", "--no-track", "--set", "data.num_clients=all"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "config error: data.num_clients: all means every client of data with its own clients (files or hf, "
        "partition kind natural); digits with partition kind dirichlet makes as many clients as data.num_clients "
        "says; allowed: a whole number >= 1 (default 20)"]
    with pytest.raises(ConfigError) as caught:  # a generator makes as many devices as asked
        load_federated(from_dict(DataConfig, {"source": "fpfc_synthetic", "num_clients": "all"}, "data"), seed=0)
    assert caught.value.field == "data.num_clients"
    path = tmp_path / "writers.parquet"  # a client column that a pooled partition ignores: a pool of 20 clients
    write_parquet(path)
    assert loaded(path, partition={"kind": "iid"}).num_clients == 20
    with pytest.raises(ConfigError) as caught:
        loaded(path, partition={"kind": "iid"}, num_clients="all")
    assert caught.value.field == "data.num_clients" and "files with partition kind iid" in str(caught.value)


def loaded_digits():
    return load_federated(from_dict(DataConfig, {"source": "digits"}, "data"), seed=0)
