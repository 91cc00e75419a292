"""Large populations: client data built on demand equals data built at once, the crowd source is
what its docstring says, the memory budget is planned and checked, and a sample of clients is
evaluated until the final evaluation covers everyone."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from helpers import small_config
from pfl.config import DataConfig
from pfl.data import load_federated
from pfl.data.crowd import CrowdParams, load as load_crowd
from pfl.evaluation import summarize
from pfl.federation.simulator import Simulator
from pfl.federation.store import GiB, plan_store
from pfl.schema import ConfigError, from_dict


def data_config(**kw):
    return from_dict(DataConfig, {"cache": False, **kw}, "data")


def crowd_config(m=50, **params):
    return data_config(source="crowd", num_clients=m, params={"num_features": 8, **params})


def write_parquet(tmp_path):
    rng = np.random.default_rng(3)
    n = 300
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"label": rng.integers(0, 4, n), "client": rng.integers(0, 12, n),
                             **{f"f{j}": rng.normal(size=n).astype(np.float32) for j in range(5)}}), path,
                   row_group_size=40)
    return path


@pytest.mark.parametrize("kind", ["dirichlet", "rotation", "fpfc_synthetic", "crowd", "files"])
def test_clients_built_on_demand_are_the_clients_built_at_once(tmp_path, kind):
    cfg = {
        "dirichlet": lambda: data_config(source="digits", num_clients=15),
        "rotation": lambda: data_config(source="digits", num_clients=12, partition={"kind": "rotation", "num_clusters": 3}),
        "fpfc_synthetic": lambda: data_config(source="fpfc_synthetic", num_clients=10, params={"size_scale": 0.1}),
        "crowd": lambda: crowd_config(40),
        "files": lambda: data_config(source="files", num_clients=12, params={"path": str(write_parquet(tmp_path))}),
    }[kind]
    eager = load_federated(cfg(), seed=4)
    lazy = load_federated(cfg(), seed=4, on_demand=True)
    assert lazy.client_sizes() == eager.client_sizes()
    assert lazy.client_nbytes().tolist() == eager.client_nbytes().tolist()
    lazy.keep_at_most(1)                    # keep one client: every access after the next rebuilds
    for i in list(range(len(eager.clients))) + [3, 0, 3]:
        a, b = eager.clients[i], lazy.clients[i]
        for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
            ta, tb = getattr(a, name), getattr(b, name)
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), (i, name)
        assert a.cluster == b.cluster
    assert lazy.clients.built == len(eager.clients) + 3


def test_a_crowd_device_reads_the_same_whichever_rows_are_asked_for():
    p = CrowdParams(num_features=5, samples_per_client=12, size_spread=0.5)
    src = load_crowd(p, 30)
    rows = np.concatenate(src.devices)
    whole = src.read_rows(rows)
    rng = np.random.default_rng(0)
    picked = rng.permutation(len(rows))[:57]
    assert np.array_equal(src.read_rows(rows[picked]), whole[picked])       # any subset, any order
    assert np.array_equal(src.read_rows(src.devices[7][::-1]), whole[src.devices[7]][::-1])
    assert np.array_equal(load_crowd(p, 30).read_rows(rows), whole)         # and again from the seed


def test_a_crowd_sample_is_its_prototype_plus_its_device_shift_plus_noise():
    """The module docstring's construction, computed here device by device in float64 from its
    parts: prototypes μ ~ separation·N(0, I) from the generator seeded (gen_seed, 0), and device
    i's generator (seeded by device_seed) drawing its shift row, then one noise row per sample."""
    from pfl.data.crowd import device_seed

    p = CrowdParams(num_features=6, num_classes=4, samples_per_client=9, size_spread=0.4, separation=2.0,
                    shift=0.7, noise=0.3, gen_seed=5)
    m = 25
    src = load_crowd(p, m)
    protos = p.separation * np.random.default_rng([p.gen_seed, 0]).standard_normal((p.num_classes, p.num_features))
    rows = np.concatenate(src.devices)
    got = src.read_rows(np.random.default_rng(1).permutation(rows))
    order = np.argsort(np.random.default_rng(1).permutation(rows))
    got = got[order]                                                # back in row order
    for dev, own in enumerate(src.devices):
        g = torch.Generator().manual_seed(device_seed(p.gen_seed, dev))
        draws = torch.randn((len(own) + 1, p.num_features), generator=g).double().numpy()
        want = protos[src.y[own]] + p.shift * draws[0] + p.noise * draws[1:]
        assert np.allclose(got[own], want, atol=1e-5), dev
    assert len({device_seed(p.gen_seed, d) for d in range(m)} | {device_seed(p.gen_seed + 1, 0)}) == m + 1


def test_crowd_sizes_splits_and_label_mixes_follow_the_parameters():
    fed = load_federated(crowd_config(200, samples_per_client=40), seed=0, on_demand=True)
    # round(40·0.2) = 8 test, round(40·0.1) = 4 validation, the rest training, for every device
    sizes = {split: fed.clients.sizes(split) for split in ("train", "val", "test")}
    assert (sizes["test"] == 8).all() and (sizes["val"] == 4).all() and (sizes["train"] == 28).all()
    c = fed.clients[17]
    rows = np.concatenate([fed.clients.part.train[17], fed.clients.part.val[17], fed.clients.part.test[17]])
    assert sorted(rows.tolist()) == list(range(17 * 40, 18 * 40))            # a device's own rows, once
    assert torch.equal(torch.cat([c.y_train, c.y_val, c.y_test]), torch.from_numpy(fed.clients.src.y[rows]))

    def classes_per_device(alpha):
        y = load_crowd(CrowdParams(num_features=2, alpha=alpha), 400).y.reshape(400, 40)
        return np.mean([len(np.unique(r)) for r in y])

    def expected(alpha, c=10, n=40):
        # class k appears unless all n draws miss it: p_k ~ Beta(α, (C−1)α), and
        # E[(1 − p_k)^n] = B(α, (C−1)α + n) / B(α, (C−1)α)
        miss = math.exp(math.lgamma((c - 1) * alpha + n) + math.lgamma(c * alpha)
                        - math.lgamma(c * alpha + n) - math.lgamma((c - 1) * alpha))
        return c * (1 - miss)

    for alpha in (0.05, 0.5, 100.0):  # 400 devices: the mean's standard error is below 0.06
        assert abs(classes_per_device(alpha) - expected(alpha)) < 0.25, alpha


def fed(store="auto", gb=None, per_round=10):
    return SimpleNamespace(client_store=store, client_memory_gb=gb, clients_per_round=per_round)


def test_the_budget_plan_follows_the_sizes():
    data = np.full(1000, 10_000)                  # 10 kB of data a client
    state = 100_000                               # 100 kB of state a client
    # everything: 1000 × 110 kB = 110 MB
    assert plan_store(fed(gb=0.2), 1000, 1000, state, data).kind == "memory"
    plan = plan_store(fed(gb=0.1), 1000, 1000, state, data)
    assert plan.kind == "disk" and plan.window == 10
    assert plan.round_bytes == 10 * (state + 10_000)
    assert plan.data_capacity == 0.1 * GiB - 10 * state - plan.flush_bytes
    assert plan_store(fed("memory", gb=0.001), 1000, 1000, state, data).kind == "memory"   # memory: no budget
    with pytest.raises(ConfigError) as err:
        plan_store(fed("disk", gb=0.001), 1000, 1000, state, data)
    # one round: 10 × 110 kB = 1.1 MB, plus an eighth of the budget as write buffer: 0.00115 GiB
    assert err.value.field == "federation.client_memory_gb"
    assert f"need {10 * 110_000 / GiB:.3g} GiB" in str(err.value) and "at least 0.01" in str(err.value)


def test_eval_clients_is_a_fixed_sample_and_the_final_evaluation_covers_everyone():
    def run(eval_clients):
        sim = Simulator(small_config(method__name="ditto", data__num_clients=30, federation__rounds=3,
                                     federation__eval_clients=eval_clients))
        tables = []
        for _ in range(3):
            sim.run_round()
            tables.append(sim.last_client_table)
        return sim, tables

    sampled, tables = run(0.2)
    full, full_tables = run(0)
    seen = [[row["client"] for row in t] for t in tables]
    assert len(seen[0]) == 6 and seen[0] == seen[1] and len(seen[2]) == 30   # 0.2 of 30; everyone at the end
    assert [h["eval/clients"] for h in sampled.history] == [6.0, 6.0, 30.0]
    for t, ft, h in zip(tables[:2], full_tables, sampled.history):
        rows = [r for r in ft if r["client"] in set(seen[0])]
        assert rows == t                                   # the same clients, the same numbers
        assert h["test/acc_mean"] == summarize(rows, "classification")["test/acc_mean"]
    assert sampled.history[2]["test/acc_mean"] == full.history[2]["test/acc_mean"]
    assert "eval/clients" not in full.history[0]
    with pytest.raises(ConfigError) as err:
        small_config(federation__eval_clients=2.5)
    assert err.value.field == "federation.eval_clients"


def test_a_large_population_touches_only_its_sampled_clients(tmp_path):
    """20,000 clients on the disk store: a round builds the data of its 10 clients, keeps the state
    of the trained ones, and an evaluation of a 50-client sample builds 50 more."""
    cfg = small_config(data__source="crowd", data__num_clients=20_000, data__params={"num_features": 8},
                       data__partition__kind="natural", data__cache=False, method__name="ditto",
                       model__params__hidden=[16], federation__rounds=100, federation__clients_per_round=10,
                       federation__client_store="auto", federation__client_memory_gb=0.01,
                       federation__eval_clients=50, federation__client_store_dir=str(tmp_path))
    sim = Simulator(cfg)
    assert sim.store.kind == "disk" and sim.data.clients.built == 1   # client 0: the model's input check
    sim.run_round(evaluate=False)
    sim.run_round(evaluate=True)
    trained = set(sim.sample(0)) | set(sim.sample(1))
    assert sim.data.clients.built <= 1 + len(trained) + 50
    sim.store.flush()
    assert set(np.flatnonzero(sim.store.index["client"] >= 0).tolist()) == trained
    assert sim.history[-1]["eval/clients"] == 50


def test_bad_features_found_when_a_client_is_first_sampled_fail_the_run_naming_the_file(tmp_path):
    from pfl.runner import run_experiment
    from pfl.tracking import client

    rng = np.random.default_rng(5)
    n = 400
    x = rng.normal(size=(n, 4)).astype(np.float32)
    owner = np.repeat(np.arange(20), 20)
    x[owner == 13] = np.nan                   # client 13: never built before it is sampled
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"label": rng.integers(0, 3, n), "client": owner,
                             **{f"f{j}": x[:, j] for j in range(4)}}), path, row_group_size=20)
    cfg = small_config(data__source="files", data__params={"path": str(path)}, data__num_clients=20,
                       data__partition__kind="natural", data__cache=False, federation__clients_per_round=0,
                       federation__client_store="disk", federation__client_memory_gb=0.01, tracking__enabled=True)
    with pytest.raises(ConfigError) as err:
        run_experiment(cfg, progress=None)
    assert err.value.field == "data.params.path" and "bad.parquet" in str(err.value)
    run = client().search_runs(client().search_experiments()[0].experiment_id)[0]
    assert run.info.status == "FAILED"
