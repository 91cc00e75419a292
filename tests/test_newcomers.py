"""Newcomers: held out of training, joining afterwards by each method's rule (docs/methods/fpfc.md §8)."""

import numpy as np
import pytest
import torch

from helpers import clustered, same, small_config, straight_and_resumed, synthetic_config
from pfl.callbacks.divergence import run_rounds
from pfl.federation.checkpoint import load_checkpoint, save_checkpoint
from pfl.federation.loop import RoundLoop
from pfl.federation.messages import Message, Update
from pfl.federation.newcomers import newcomer_clients
from pfl.federation.simulator import Simulator
from pfl.federation.state import encode
from pfl.models.functional import unflatten_params
from pfl.resolver import with_overrides
from pfl.schema import ConfigError


def _cfg(name: str = "fedavg", **extra):
    return small_config(**{"method__name": name, "newcomers__fraction": 0.3, "newcomers__rounds": 3, **extra})


def test_newcomers_are_round_m_fraction_drawn_once_from_the_seed():
    cfg = _cfg()
    ids = newcomer_clients(cfg, 10)
    assert len(ids) == 3 and ids == newcomer_clients(cfg, 10) and list(ids) == sorted(ids)
    assert newcomer_clients(with_overrides(cfg, {"seed": 3}), 10) != ids
    assert newcomer_clients(with_overrides(cfg, {"newcomers.fraction": 0.0}), 10) == ()
    with pytest.raises(ConfigError, match="newcomers.fraction"):
        small_config(newcomers__fraction=0.96)                           # round(9.6) = 10 of 10 clients
    with pytest.raises(ConfigError, match="newcomers.rounds"):
        small_config(newcomers__rounds=-1)


@pytest.mark.parametrize("name", ["fedavg", "fpfc", "cfl", "scaffold"])
def test_newcomers_are_never_sampled_nor_evaluated_during_training(name):
    sim = Simulator(_cfg(name, federation__clients_per_round=0, federation__rounds=3))
    held = set(sim.ctx.newcomers)
    assert sim.ctx.members == [c for c in range(10) if c not in held] and sim.ctx.num_members == 7
    for rnd in range(3):
        assert set(sim.sample(rnd)) == set(sim.ctx.members)
    states = encode([sim.client_states[c] for c in sorted(held)])
    run_rounds(sim, until=2)
    same(encode([sim.client_states[c] for c in sorted(held)]), states)   # nobody touched them
    assert [r["client"] for r in sim.last_client_table] == sim.ctx.members
    assert sim.history[-1]["test/acc_mean"] == pytest.approx(np.mean([r["test_acc"] for r in sim.last_client_table]))


def test_after_the_last_round_the_newcomers_join_and_are_reported_apart():
    sim = Simulator(_cfg("fedavg", federation__rounds=2))
    loop = RoundLoop(sim, [])
    loop.run()
    summary = loop.summary
    rows = sim.last_client_table
    assert [r["client"] for r in rows] == list(range(10))
    assert [r["newcomer"] for r in rows] == [int(c in sim.ctx.newcomers) for c in range(10)]
    newcomer = [r["test_acc"] for r in rows if r["newcomer"]]
    assert summary["newcomer/acc_mean"] == pytest.approx(np.mean(newcomer))
    assert summary["newcomer/acc_std"] == pytest.approx(np.std(newcomer))
    assert summary["newcomer/count"] == 3 and summary["newcomer/join_steps"] == 0
    # FedAvg's rule: the final global model, i.e. the newcomers' accuracy is the global model's
    assert all(r["test_acc"] == r["global_test_acc"] for r in rows if r["newcomer"])
    assert "comm/join_up_bytes" not in summary          # no join traffic for this rule
    trained = [r["test_acc"] for r in rows if not r["newcomer"]]
    assert sim.history[-1]["test/acc_mean"] == pytest.approx(np.mean(trained))


def test_join_traffic_is_counted_apart_from_training():
    sim = Simulator(_cfg("fpfc", federation__rounds=2, newcomers__tol=0.0))
    run_rounds(sim)
    p = sum(t.numel() for t in sim.method.init.values())
    steps = int(sim.join_result["newcomer/join_steps"])
    assert steps == 3
    assert sim.ledger.join_up_bytes == 3 * steps * p * 4                # every step: each newcomer's model
    assert sim.ledger.join_down_bytes == 3 * (steps - 1) * p * 4        # ζ from step 1 (step 0: nothing but ρ)
    assert sim.join_result["comm/join_up_bytes"] == sim.ledger.join_up_bytes
    assert sim.ledger.up_messages == sum(len(sim.sample(r)) for r in range(2))   # training uploads only


@pytest.mark.parametrize("name", ["fpfc", "cfl", "local", "lgfedavg", "ditto", "pacfl"])
def test_the_join_is_deterministic_and_resumes(tmp_path, name):
    extra = {"method__start_round": 1, "method__eps1": 100.0, "method__eps2": 0.0} if name == "cfl" else {}
    cfg = _cfg(name, federation__rounds=3, **extra)
    straight, resumed = straight_and_resumed(cfg, tmp_path)
    assert straight.join_result == resumed.join_result and "newcomer/acc_mean" in straight.join_result
    same(encode(resumed.model_state()), encode(straight.model_state()))
    assert resumed.ledger.state_dict() == straight.ledger.state_dict()
    # a finished run resumed from its final checkpoint reports the join without joining again
    save_checkpoint(straight, tmp_path / "final.pt")
    again = Simulator(cfg)
    load_checkpoint(again, tmp_path / "final.pt")
    loop = RoundLoop(again, [])
    loop.run()
    assert loop.summary == straight.join_result
    assert again.ledger.state_dict() == straight.ledger.state_dict()


def test_local_newcomers_train_alone_and_send_nothing():
    sim = Simulator(_cfg("local", federation__rounds=1))
    run_rounds(sim)
    init = sim.client_role.init
    for c in sim.ctx.newcomers:
        assert any(not torch.equal(sim.client_states[c]["params"][k], init[k]) for k in init)
    assert sim.ledger.join_up_bytes == sim.ledger.join_down_bytes == 0
    assert sim.join_result["newcomer/join_steps"] == 3


def test_ifca_newcomers_pick_the_lowest_loss_model_and_count_in_the_assignment():
    sim = Simulator(clustered("label_swap", 2, 10, method__name="ifca", method__k=2, federation__rounds=3,
                              newcomers__fraction=0.2))
    run_rounds(sim)
    found = sim.method.cluster_assignment()
    assert sorted(found) == list(range(10))
    from pfl.training import evaluate

    for n in sim.ctx.newcomers:
        d = sim.data.clients[n]
        losses = [evaluate(sim.ctx.model, m, d.x_train, d.y_train).loss for m in sim.method.models]
        assert found[n] == int(np.argmin(losses))
    assert sim.join_result["newcomer/ari"] >= 0.9 and sim.join_result["newcomer/in_true_cluster"] == 1.0


def test_cfl_newcomers_descend_the_split_tree():
    sim = Simulator(clustered("label_swap", 2, 10, method__name="cfl", method__start_round=1, method__eps1=100.0,
                              method__eps2=0.0, method__min_size=5, federation__rounds=3, newcomers__fraction=0.2))
    run_rounds(sim, until=3)
    method = sim.method
    assert len(method.clusters) == 2 and list(method.tree) == [0]
    node = method.tree[0]
    assert node["children"] == method.cluster_ids and node["centres"].shape[0] == 2
    # hand the newcomer an update along one side's centre: it must go to that side
    for side in (0, 1):
        method.join_begin(3, [sim.ctx.newcomers[0]])
        names = list(node["model"])
        upd = unflatten_params(node["centres"][side] * 3.0, node["model"], names)
        method.join_aggregate(3, 0, {sim.ctx.newcomers[0]: Message.of({"delta": Update(upd)})})
        assert method.join_node[sim.ctx.newcomers[0]] == node["children"][side]
        assert sim.ctx.newcomers[0] in method.clusters[method.cluster_ids.index(node["children"][side])]
        for members in method.clusters:
            if sim.ctx.newcomers[0] in members:
                members.remove(sim.ctx.newcomers[0])


def test_cfl_newcomers_join_the_true_cluster_end_to_end():
    sim = Simulator(clustered("label_swap", 2, 10, method__name="cfl", method__start_round=1, method__eps1=100.0,
                              method__eps2=0.0, method__min_size=5, federation__rounds=3, newcomers__fraction=0.2))
    run_rounds(sim)
    assert sim.join_result["newcomer/join_steps"] == 1          # one split: one level of the tree
    assert sim.join_result["newcomer/in_true_cluster"] == 1.0 and sim.join_result["newcomer/ari"] >= 0.9


def test_fpfc_join_moves_only_the_newcomers_rows():
    sim = Simulator(_cfg("fpfc", federation__rounds=2, federation__clients_per_round=0))
    run_rounds(sim, until=1)
    sim.run_round()                          # the last round, without the loop's join
    m = sim.method
    mem = sim.ctx.members
    new = list(sim.ctx.newcomers)
    W, theta, v = m.W.clone(), m.theta.clone(), m.v.clone()
    assert torch.count_nonzero(theta[new]) == 0 and torch.count_nonzero(theta[:, new]) == 0   # no pairs yet
    RoundLoop(sim, []).run()                 # nothing left to train: the newcomers join
    assert sim.newcomers_joined
    assert torch.equal(m.W[mem], W[mem])
    assert torch.equal(m.theta[np.ix_(mem, mem)], theta[np.ix_(mem, mem)])
    assert torch.equal(m.v[np.ix_(mem, mem)], v[np.ix_(mem, mem)])
    assert torch.count_nonzero(m.theta[np.ix_(new, new)]) == 0                # newcomers never pair up
    assert torch.count_nonzero(m.theta[np.ix_(new, mem)]) > 0
    assert torch.allclose(m.theta, -m.theta.transpose(0, 1))
    assert sorted(m.cluster_assignment()) == list(range(10))


@pytest.mark.slow
def test_fpfc_newcomers_join_their_true_clusters():
    # 20 devices of S1's generator at 30 % of the sizes, 4 of them newcomers
    cfg = synthetic_config(**{"data.num_clients": 20, "data.params.size_scale": 0.3, "federation.rounds": 150,
                              "federation.clients_per_round": 8, "federation.eval_every": 150, "method.lam": 0.8,
                              "newcomers.fraction": 0.2, "newcomers.rounds": 100})
    sim = Simulator(cfg)
    run_rounds(sim)
    result = sim.join_result
    assert result["newcomer/in_true_cluster"] == 1.0 and result["newcomer/ari"] >= 0.95
    assert result["newcomer/join_steps"] < 100                        # every newcomer settled (newcomers.tol)
    fedavg = Simulator(with_overrides(cfg, {"method.name": "fedavg"}))       # FedAvg's rule: the global model
    run_rounds(fedavg)
    assert result["newcomer/acc_mean"] > fedavg.join_result["newcomer/acc_mean"] + 0.1


def test_asynchronous_fpfc_dispatches_only_the_members():
    from pfl.federation.drivers import simulator_for

    cfg = _cfg("fpfc", federation__driver="async", federation__rounds=2)
    sim = simulator_for(cfg)(cfg)
    run_rounds(sim)
    assert {entry[2] for entry in sim.queue} == set(sim.ctx.members)
    assert sim.join_result["newcomer/count"] == 3
