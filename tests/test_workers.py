"""A run's clients in worker processes (``federation.workers``, pfl/federation/workers.py) compute
what the same run computes in one process, bit for bit.

The truth is the in-process run (``federation.workers: 1``, the code path every other test checks):
every method, and the paths that put state or randomness on the client side of the wire
(compression both ways with error feedback, half precision's counters, an attack before or after
the codec, newcomers, the disk store, the asynchronous driver, the evaluation modes), run with 1
and with N workers and are compared on their metrics, model states (every client's included),
ledgers and last client tables. The quick tests run the workers' code in this process
(``PFL_WORKER_BACKEND=local``: the same objects built apart from the run's, the same byte strings);
the slow ones start Ray actors from a subprocess driver on the session's Ray head, kill one in the
middle of a round, and ask for resources no node has.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import matrix, method_config, method_names, same, small_config, untimed
from pfl.callbacks.divergence import run_rounds
from pfl.federation.checkpoint import load_checkpoint, save_checkpoint
from pfl.federation.drivers import simulator_for
from pfl.federation.newcomers import join_newcomers
from pfl.federation.state import encode
from pfl.federation.workers import WorkerLost, workers_that_fit
from pfl.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
METHODS = method_names(composed=True)
#: in the quick loop: a personal model (Ditto), a control variate (SCAFFOLD), a composed method whose
#: hyperparameter class is made at run time (ALA), FedPD's three models from the first step
FAST = ("ditto", "scaffold", "fedavg+ala", "fedpd")

#: the paths beyond a plain round (each run with 1 and with 3 workers)
PATHS = {
    "compression both ways, error feedback": dict(
        method__name="fedavg", compression__uplink={"name": "topk", "ratio": 0.2}, compression__error_feedback=True,
        compression__downlink={"name": "qsgd", "s": 3}, compression__min_numel=32),
    "half precision (its counter kept client-side)": dict(
        method__name="ditto", compression__uplink={"name": "fp16"}, compression__downlink={"name": "fp16"}),
    "an attack": dict(method__name="fedavg", attack__kind="sign_flip", attack__fraction=0.3),
    "an attack behind the codec, on the head": dict(
        method__name="fpfc", attack__kind="gaussian", attack__fraction=0.2, attack__scope="head",
        federation__stages=["compression", "attack"], compression__uplink={"name": "qsgd", "s": 4}),
    "the asynchronous driver": dict(method__name="fpfc", federation__driver="async", federation__rounds=4),
    "newcomers (fine-tuning)": dict(method__name="ditto", newcomers__fraction=0.2, newcomers__finetune_rounds=2,
                                    evaluation__untrained_model="global"),
    "the disk store": dict(method__name="ditto", federation__client_store="disk"),
    "evaluation modes": dict(
        method__name="fedavg", evaluation__when=["before", "after"], evaluation__local_model=True,
        evaluation__untrained_model="global", evaluation__trained_apart=True, evaluation__server_test=True,
        federation__eval_clients=0.5, data__num_clients=12, federation__clients_per_round=3),
}


@pytest.fixture
def local_workers(monkeypatch):
    monkeypatch.setenv("PFL_WORKER_BACKEND", "local")


def finished(cfg):
    sim = simulator_for(cfg)(cfg)
    run_rounds(sim)
    if cfg.newcomers.fraction:
        sim.history.append(join_newcomers(sim))
    return sim


def without_workers(history):
    return [{k: v for k, v in row.items() if not k.startswith("workers/")} for row in untimed(history)]


def assert_same_run(pooled, alone) -> None:
    assert without_workers(pooled.history) == untimed(alone.history)
    same(encode(pooled.model_state()), encode(alone.model_state()))
    assert pooled.ledger.state_dict() == alone.ledger.state_dict()
    assert pooled.last_client_table == alone.last_client_table


def shipped(sim) -> float:
    return sum(row.get("workers/sent_bytes", 0.0) for row in sim.history)


# ---- bit for bit, in this process ---------------------------------------------------------------

@pytest.mark.parametrize("name", matrix(METHODS, FAST))
def test_workers_compute_what_one_process_computes(local_workers, name):
    def cfg(workers):
        return method_config(name, federation__rounds=3, federation__momentum=0.5, federation__workers=workers)
    pooled = finished(cfg(2))
    assert shipped(pooled) > 0  # its clients did go through the workers
    assert_same_run(pooled, finished(cfg(1)))


@pytest.mark.parametrize("settings", PATHS.values(), ids=PATHS.keys())
def test_workers_equal_one_process_on_the_other_paths(local_workers, settings):
    pooled = finished(small_config(**settings, federation__workers=3))
    assert shipped(pooled) > 0
    assert_same_run(pooled, finished(small_config(**settings)))


def test_half_precision_counts_what_the_workers_clients_flushed(local_workers):
    settings = dict(method__name="fedavg", compression__uplink={"name": "fp16"}, federation__lr=0.001)
    alone = finished(small_config(**settings))
    assert any(row["comm/fp16_flushed"] > 0 for row in alone.history)  # only the uplink flushes: client-side
    assert_same_run(finished(small_config(**settings, federation__workers=2)), alone)


def test_a_vectorized_cohort_in_workers_agrees_up_to_float_rounding(local_workers):
    """A batched cohort's results depend on its groups at the level of float rounding (as batched
    against sequential does): workers batch their own share of the clients."""
    settings = dict(method__name="scaffold", federation__cohort="vectorized")
    pooled, alone = finished(small_config(**settings, federation__workers=2)), finished(small_config(**settings))
    a, b = encode(pooled.model_state()), encode(alone.model_state())
    for k in b["server"]:
        if isinstance(b["server"][k], dict):
            for name, t in b["server"][k].items():
                assert torch.allclose(a["server"][k][name], t, rtol=1e-4, atol=1e-6), (k, name)
    assert pooled.history[-1]["test/acc_mean"] == pytest.approx(alone.history[-1]["test/acc_mean"], abs=0.02)


def test_a_run_resumed_with_other_workers_equals_the_uninterrupted_one(local_workers, tmp_path):
    def cfg(workers):
        return method_config("ditto", federation__rounds=4, federation__workers=workers)
    straight = finished(cfg(1))
    first = finished_until(cfg(2), 2)
    save_checkpoint(first, tmp_path / "ckpt.pt")
    for workers in (3, 1):  # another N does not change what is computed
        resumed = simulator_for(cfg(workers))(cfg(workers))
        load_checkpoint(resumed, tmp_path / "ckpt.pt")
        run_rounds(resumed)
        same(encode(resumed.model_state()), encode(straight.model_state()))
        assert without_workers(resumed.history) == untimed(straight.history)


def finished_until(cfg, rounds):
    sim = simulator_for(cfg)(cfg)
    run_rounds(sim, until=rounds)
    return sim


def test_a_lost_worker_is_replaced_and_its_clients_run_again(local_workers, monkeypatch):
    from pfl.federation import workers

    real_get, lost = workers._LocalWorker.get, []

    def dies_once(self, ref):
        if not lost:
            lost.append(True)
            raise WorkerLost("killed")
        return real_get(self, ref)

    monkeypatch.setattr(workers._LocalWorker, "get", dies_once)
    pooled = finished(method_config("ditto", federation__workers=2))
    assert [row["workers/restarts"] for row in pooled.history] == [1.0, 0.0, 0.0]
    assert_same_run(pooled, finished(method_config("ditto")))


def test_a_worker_that_always_dies_stops_the_run(local_workers, monkeypatch):
    from pfl.federation import workers

    def dies(self, ref):
        raise WorkerLost("out of memory")

    monkeypatch.setattr(workers._LocalWorker, "get", dies)
    sim = simulator_for(small_config(federation__workers=2))(small_config(federation__workers=2))
    with pytest.raises(RuntimeError, match="died 4 times.*out of memory"):
        run_rounds(sim)


# ---- what crosses, and what does not -------------------------------------------------------------

def test_a_round_ships_downlinks_and_states_never_the_data(local_workers):
    """A small model on digits: the clients' data outweighs what a round of them sends and keeps."""
    cfg = small_config(method__name="ditto", federation__workers=2, federation__eval_every=10,
                       model__name="softmax_regression")
    sim = finished(cfg)
    sizes = sim.data.client_nbytes()
    for rnd, row in enumerate(sim.history[:-1]):  # training only: the sampled clients' downlinks and states
        data = float(sum(sizes[c] for c in sim.sample(rnd)))
        assert row["workers/sent_bytes"] < data / 4
        assert row["comm/round_up_bytes"] < row["workers/received_bytes"] < data / 4


def test_clients_of_a_packed_part_share_a_copy_only_of_what_the_server_did_not_change():
    """Downlinks the pool packs share one copy of an unchanged server tensor; one the server edited
    in place between two sends (a new version) is copied again, and the earlier client keeps what it
    was sent; the server's own tensors are never handed out; without ``shared`` every send copies."""
    from pfl.federation.messages import Message

    model = {"w": torch.randn(4, 3), "b": torch.zeros(3)}
    shared: dict = {}
    first = Message.model(model).copy(shared=shared)
    second = Message.model(model).copy(shared=shared)
    sent_w = model["w"].clone()
    model["w"].mul_(2.0)                                  # the server changes its model in place
    third = Message.model(model).copy(shared=shared)
    w = [m["model"].entries["w"] for m in (first, second, third)]
    assert w[0] is w[1] and w[2] is not w[0]
    assert torch.equal(w[0], sent_w) and torch.equal(w[2], 2.0 * sent_w)
    assert all(t.untyped_storage().data_ptr() != model["w"].untyped_storage().data_ptr() for t in w)
    assert first["model"].entries["b"] is third["model"].entries["b"]   # b did not change
    apart = [Message.model(model).copy()["model"].entries["w"] for _ in range(2)]
    assert apart[0] is not apart[1]


def test_packed_messages_keep_bits_dtypes_views_and_aliasing():
    """What crosses between the pool's processes arrives as it left: every dtype's bits (a -0.0, a
    NaN's payload), shapes and strides, two views of one storage as two views of one new storage, a
    tensor named twice as one tensor, a Parameter and a tensor with its graph the default way; the
    bytes counted are the pickle's plus each storage's once. The receiver owns its copy."""
    from pfl.federation.worker_side import dumps, loads

    base = torch.arange(24, dtype=torch.float32)
    base[0] = -0.0
    nan = torch.tensor([float("nan")]).view(torch.int32).add_(5).view(torch.float32)  # a NaN with its own payload
    values = {"row": base.view(4, 6)[1], "col": base.view(4, 6)[:, 2], "t": base.view(4, 6).t(),
              "bf16": torch.randn(7).to(torch.bfloat16), "flags": torch.tensor([True, False, True]),
              "ints": torch.tensor([-(2 ** 62), 3]), "cplx": torch.randn(3, dtype=torch.complex64),
              "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 5), "nan": nan, "half": torch.randn(5).half()}
    param = torch.nn.Parameter(torch.randn(3))
    graph = torch.randn(3, requires_grad=True)
    obj = {"values": values, "again": values["row"], "param": param, "graph": graph, "text": "x", "n": 3}
    packed = dumps(obj)
    # base's storage crosses once although three views name it; a Parameter's data as a tensor
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*values.values(), param]}
    assert sum(b.nbytes for b in packed.buffers) == sum(storages.values())
    assert packed.nbytes == len(packed.header) + sum(storages.values())
    got = loads(packed)
    for name, t in values.items():
        g = got["values"][name]
        assert g.dtype == t.dtype and g.shape == t.shape and g.stride() == t.stride(), name
        assert not t.numel() or g.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), name  # its own
        assert bytes(g.untyped_storage()) == bytes(t.untyped_storage()), name           # every byte
    views = [got["values"][k] for k in ("row", "col", "t")]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    views[0][0] = 100.0                                   # still views of one storage
    assert got["values"]["t"][0, 1] == 100.0 and got["values"]["col"][1] == 8.0
    assert got["again"] is got["values"]["row"]
    assert isinstance(got["param"], torch.nn.Parameter) and torch.equal(got["param"], param)
    assert got["graph"].requires_grad and torch.equal(got["graph"], graph)
    assert (got["text"], got["n"]) == ("x", 3)
    assert torch.signbit(loads(dumps(base))[0]).item()   # -0.0 stays -0.0
    lazy = torch.randn(3, dtype=torch.complex64).conj()   # a conjugate view: its storage holds the other values
    assert lazy.is_conj() and torch.equal(loads(dumps(lazy)), lazy)


def test_share_equal_finds_a_view_at_an_unaligned_offset_equal_to_its_copy():
    from pfl.federation.messages import Message, Model
    from pfl.federation.worker_side import share_equal

    flat = torch.randn(11)
    view = flat[1:9]                                      # offset 4 bytes: not a multiple of 8
    got = share_equal([Message({"model": Model({"w": view})}), Message({"model": Model({"w": view.clone()})})])
    assert got[1]["model"].entries["w"] is view


def test_a_calls_equal_downlinks_cross_once_and_each_client_gets_its_own_copy():
    """share_equal → torch.save → own_copies: two clients sent the same model cost one model's bytes
    (plus the message's bookkeeping), not two; a -0.0 where the other has 0.0 (equal values, other
    bits) crosses apart; on arrival no two clients share a storage and the values are the senders'."""
    from pfl.federation.messages import Message, Model
    from pfl.federation.worker_side import dumps, loads, own_copies, share_equal

    w = torch.randn(256, 64)
    down = lambda t: Message({"model": Model({"w": t.clone(), "b": torch.zeros(64)})})  # noqa: E731
    one = dumps([down(w)]).nbytes
    two_equal = dumps(share_equal([down(w), down(w), None])).nbytes
    signed, w0 = w.clone(), w.clone()
    w0[0, 0], signed[0, 0] = 0.0, -0.0
    two_apart = dumps(share_equal([down(w0), down(signed)])).nbytes
    assert two_equal < one + 4096 < 2 * one - 4096 < two_apart
    got = own_copies(loads(dumps(share_equal([down(w), down(w), down(w)]))))
    ptrs = {m["model"].entries[k].untyped_storage().data_ptr() for m in got for k in ("w", "b")}
    assert len(ptrs) == 6
    assert all(torch.equal(m.tensors("model")["w"], w) for m in got)
    got[0]["model"].entries["w"].add_(1.0)   # a client training in place on its downlink
    assert torch.equal(got[1].tensors("model")["w"], w)


@pytest.mark.parametrize("method", ["fedavg", "ditto"])
def test_with_workers_the_run_process_builds_no_client_data_it_does_not_use(local_workers, method):
    """One process builds every client's data at the start (the memory store's plan); with workers
    the run's process builds only the client its model check samples: the workers build the data of
    the clients they train, and the method's first states (Ditto's personal models) do not need it."""
    from pfl.data.federated import OnDemandClients

    alone = simulator_for(small_config(method__name=method, data__num_clients=20))(
        small_config(method__name=method, data__num_clients=20))
    assert not isinstance(alone.data.clients, OnDemandClients)   # materialized: all 20 built
    cfg = small_config(method__name=method, data__num_clients=20, federation__workers=2)
    sim = simulator_for(cfg)(cfg)
    run_rounds(sim)
    assert isinstance(sim.data.clients, OnDemandClients) and sim.data.clients.built == 1
    same(encode(sim.model_state()), encode(finished(small_config(method__name=method,
                                                                 data__num_clients=20)).model_state()))


def test_a_side_without_a_name_runs_in_the_run_process(local_workers):
    from pfl.federation.wire import Phase

    sim = simulator_for(small_config(federation__workers=2))(small_config(federation__workers=2))
    seen = []
    arrivals = sim.exchange(Phase("eval", 0), [0, 1, 2], lambda cid: None,
                            lambda client, msg: (None, seen.append(client.cid) or client.cid))
    assert seen == [0, 1, 2] and [a.local for a in arrivals.values()] == [0, 1, 2]
    assert sim.exchange.runner.round_metrics()["workers/sent_bytes"] == 0


def test_data_not_made_from_the_config_is_refused(local_workers):
    from pfl.data import load_federated

    other = small_config(data__num_clients=12)
    data = load_federated(other.data, other.seed)
    cfg = small_config(federation__workers=2)
    with pytest.raises(ConfigError) as err:
        simulator_for(cfg)(cfg, data=data)
    assert err.value.field == "federation.workers"


@pytest.mark.parametrize("key, value, words", [
    ("federation.worker_resources.gpu", -1, ["federation.worker_resources.gpu", ">= 0"]),
    ("federation.worker_resources.cpu", 0, ["federation.worker_resources.cpu", "> 0"]),
    ("federation.worker_resources.tpu", 1, ["federation.worker_resources.tpu", "allowed fields: cpu, gpu"]),
    ("federation.workers", 0, ["federation.workers", ">= 1"]),
])
def test_worker_settings_are_checked_naming_the_field(key, value, words):
    with pytest.raises(ConfigError) as err:
        small_config(**{key.replace(".", "__"): value})
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("n, sizes", [(2, [5] * 50), (2, [1, 40, 3, 3, 3, 60, 2, 9]), (3, [7, 1, 1]),
                                       (2, [4]), (4, list(range(1, 30)))])
def test_blocks_cut_a_part_in_its_order_and_give_each_worker_its_share(n, sizes):
    """The pool's blocks: the part's clients in order, cut in at most 3 × n runs dealt to the
    workers in turn, so each worker holds about 1/n of the data (within one block's largest client)."""
    from pfl.federation.workers import BLOCKS_PER_WORKER, WorkerPool

    pool = object.__new__(WorkerPool)
    pool.n, pool.turn, pool.sizes, pool.per_worker = n, 0, sizes, BLOCKS_PER_WORKER
    cids = list(range(len(sizes)))
    blocks = pool.blocks(cids)
    assert [c for _, group in blocks for c in group] == cids and all(group for _, group in blocks)
    assert len(blocks) == min(len(cids), n * BLOCKS_PER_WORKER)
    assert [slot for slot, _ in blocks] == [b % n for b in range(len(blocks))]
    load = [sum(sizes[c] + 1 for slot, group in blocks if slot == w for c in group) for w in range(n)]
    share, biggest = sum(s + 1 for s in sizes) / n, max(sizes) + 1
    assert all(abs(w - share) <= BLOCKS_PER_WORKER * biggest for w in load), load
    if len(cids) == 1:  # one client: the next call goes to the next worker
        assert [pool.blocks(cids)[0][0] for _ in range(n)] == [1 % n, 2 % n, 3 % n, 4 % n][:n]


def test_workers_that_fit_counts_per_node():
    nodes = [{"CPU": 2.0}, {"CPU": 16.0, "GPU": 2.0}]
    assert workers_that_fit(nodes, 1, 0) == 18
    assert workers_that_fit(nodes, 0.5, 0) == 36
    assert workers_that_fit(nodes, 1, 0.25) == 8
    assert workers_that_fit(nodes, 4, 1) == 2
    assert workers_that_fit(nodes, 1, 1) == 2


# ---- Ray actors, from a driver process on the session's Ray head ------------------------------------

DRIVER = '''
import json, os, sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from helpers import small_config
from pfl.callbacks.divergence import run_rounds
from pfl.federation.drivers import simulator_for
from pfl.federation.newcomers import join_newcomers
from pfl.federation.state import encode
out = {{}}
for name, settings in json.loads(sys.argv[1]).items():
    cfg = small_config(**settings)
    sim = simulator_for(cfg)(cfg)
    run_rounds(sim)
    if cfg.newcomers.fraction:
        sim.history.append(join_newcomers(sim))
    out[name] = {{"history": sim.history, "state": encode(sim.model_state()), "ledger": sim.ledger.state_dict(),
                 "table": sim.last_client_table, "pids": sim.exchange.runner.pids, "driver": os.getpid()}}
torch.save(out, sys.argv[2])
print("driver done")
'''

RAY_CASES = {
    "fedavg, compression both ways, an attack": dict(
        method__name="fedavg", compression__uplink={"name": "topk", "ratio": 0.2}, compression__error_feedback=True,
        compression__downlink={"name": "qsgd", "s": 3}, compression__min_numel=32, attack__kind="sign_flip",
        attack__fraction=0.3),
    "fedavg+ala, the disk store": dict(method__name="fedavg+ala", federation__client_store="disk"),
    "fpfc, the asynchronous driver": dict(method__name="fpfc", federation__driver="async", federation__rounds=4),
    "ditto, newcomers": dict(method__name="ditto", newcomers__fraction=0.2, newcomers__finetune_rounds=2),
}


def drive(ray_cluster, tmp_path, cases: dict):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=str(ROOT / "tests")))
    env = {"RAY_ADDRESS": ray_cluster.address, "PFL_CACHE_DIR": str(tmp_path / "cache"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    proc = ray_cluster.popen([sys.executable, str(script), json.dumps(cases), str(tmp_path / "out.pt")], env,
                             cwd=tmp_path)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    return torch.load(tmp_path / "out.pt", weights_only=False)


def assert_same_as(result: dict, alone) -> None:
    assert without_workers(result["history"]) == untimed(alone.history)
    same(result["state"], encode(alone.model_state()))
    assert result["ledger"] == alone.ledger.state_dict()
    assert result["table"] == alone.last_client_table


@pytest.mark.slow
def test_ray_workers_compute_what_one_process_computes(ray_cluster, tmp_path):
    results = drive(ray_cluster, tmp_path, {name: {**s, "federation.workers": 2} for name, s in RAY_CASES.items()})
    for name, settings in RAY_CASES.items():
        result = results[name]
        pids = set(result["pids"].values())
        assert len(pids) == 2 and result["driver"] not in pids, name  # two processes of their own
        assert all(row["workers/sent_bytes"] > 0 for row in result["history"][:-1 if "newcomers" in name else None])
        assert_same_as(result, finished(small_config(**settings)))


DIES = '''
import os
from pfl.methods import register
from pfl.methods.fedavg import FedAvg


@register
class FedAvgDies(FedAvg):
    """FedAvg whose worker 1 dies (once: the marker file) in the middle of round 1."""
    name = "fedavg_dies"

    def local_update(self, rnd, client, msg):
        if os.environ.get("PFL_WORKER") == "1" and rnd == 1:
            try:
                fd = os.open({mark!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                os._exit(9)
        return super().local_update(rnd, client, msg)
'''


@pytest.mark.slow
def test_a_killed_ray_worker_is_replaced_and_the_round_gives_the_same_bits(ray_cluster, tmp_path):
    plugin = tmp_path / "dies.py"
    plugin.write_text(DIES.format(mark=str(tmp_path / "died")))
    settings = dict(method__name="fedavg", federation__rounds=3)
    result = drive(ray_cluster, tmp_path, {"dies": {**settings, "method.name": "fedavg_dies",
                                                    "plugins": [str(plugin)], "federation.workers": 2}})["dies"]
    assert (tmp_path / "died").exists()  # it did die
    assert [row["workers/restarts"] for row in result["history"]] == [0.0, 1.0, 0.0]
    assert_same_as(result, finished(small_config(**settings)))  # fedavg_dies computes fedavg


@pytest.mark.slow
@pytest.mark.parametrize("resources", ["gpu=1", "cpu=3"])
def test_a_worker_that_cannot_start_exits_2_naming_worker_resources(ray_cluster, tmp_path, resources):
    env = {"RAY_ADDRESS": ray_cluster.address, "PFL_CACHE_DIR": str(tmp_path / "cache"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    code, out = ray_cluster.run([sys.executable, "-m", "pfl", "run", "--no-track", "--set", "data.source=digits",
                                 "data.num_clients=6", "federation.rounds=1", "federation.workers=2",
                                 f"federation.worker_resources.{resources}"], env, timeout=300)
    assert code == 2, out[-3000:]
    assert "config error: federation.worker_resources" in out and "do not fit the Ray cluster" in out, out[-3000:]


# ---- inside Tune trials: the workers in the trial's placement group -------------------------------

def test_table_cells_with_workers_ask_for_them_and_run_one_after_another_on_two_cpus(ray_cluster, tmp_path):
    """Two cells of FedAvg with 2 workers of 0.5 CPU, the trial 0.5: 1.5 CPUs a cell on the 2-CPU
    test cluster, so Ray runs them one after another. Without the workers in the trial's resources
    (a placement group of the trial's bundle alone) Tune refuses to launch them: every cell failed."""
    import pandas as pd
    import yaml

    from pfl.runner import run_experiment

    from pfl.resolver import load

    settings = {"data.source": "digits", "data.num_clients": 6, "data.partition.kind": "dirichlet",
                "data.partition.alpha": 0.5, "federation.rounds": 3, "federation.clients_per_round": 4,
                "federation.eval_every": 3, "federation.local_epochs": 1, "federation.batch_size": 32,
                "federation.lr": 0.1}
    table = tmp_path / "pooled.yaml"
    table.write_text(yaml.safe_dump({
        "set": {**settings, "federation.workers": 2, "federation.worker_resources.cpu": 0.5},
        "rows": [{"name": "fedavg", "set": {"method.name": "fedavg"}}], "seeds": [0, 1], "reference": "fedavg"}))
    env = {"RAY_ADDRESS": ray_cluster.address, "PFL_CACHE_DIR": str(tmp_path / "cache"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    code, out = ray_cluster.run([sys.executable, "-m", "pfl", "table", str(table), "--resources", "cpu=0.5",
                                 "--storage", str(tmp_path / "ray_results"), "--out", str(tmp_path / "out")],
                                env, timeout=300)
    assert code == 0, out[-4000:]
    assert "finished: 2 of 2 cells finished" in out
    runs = pd.read_csv(tmp_path / "out" / "pooled_runs.csv")
    for seed in (0, 1):   # the pooled cells computed what one process computes
        alone = run_experiment(load(None, {**settings, "method.name": "fedavg", "seed": seed,
                                            "tracking.enabled": False}), progress=None)
        assert runs[runs["seed"] == seed]["final"].iloc[0] == pytest.approx(alone.final["test/acc_mean"], abs=1e-12)


def test_a_sweeps_trials_with_workers_get_them(ray_cluster, tmp_path):
    """The smoke sweep of FedAvg with 2 workers of 0.5 CPU a trial: every trial finishes (without
    the workers in the trial's placement group Tune refuses to launch them)."""
    env = {"RAY_ADDRESS": ray_cluster.address, "PFL_CACHE_DIR": str(tmp_path / "cache"),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    code, out = ray_cluster.run([sys.executable, str(ROOT / "pipelines" / "sweep.py"), "--space",
                                 str(ROOT / "search_spaces" / "fedavg.yaml"), "--smoke", "--storage",
                                 str(tmp_path / "ray_results"), "--resources", "cpu=0.5", "--set",
                                 "data.source=digits", "data.num_clients=6", "federation.rounds=2",
                                 "federation.clients_per_round=4", "federation.workers=2",
                                 "federation.worker_resources.cpu=0.5"], env, timeout=400)
    assert code == 0, out[-4000:]
    assert "== best ==" in out and "failed" not in out.lower().split("== best ==")[0], out[-3000:]


def test_trial_bundles_are_the_trial_then_one_per_worker():
    from pfl.config import FederationConfig, WorkerResources
    from pfl.federation.workers import trial_bundles

    fed = FederationConfig(workers=3, worker_resources=WorkerResources(cpu=0.5, gpu=0.25))
    assert trial_bundles(fed, 1, 0) == [{"CPU": 1.0}] + [{"CPU": 0.5, "GPU": 0.25}] * 3
    assert trial_bundles(FederationConfig(workers=1), 2, 1) == [{"CPU": 2.0, "GPU": 1.0}]
