"""pipelines/bench_flower.py (bench_workers' Flower rows) against pfl: the recipe's claims checked.

A Flower client's update is pfl's client update bit for bit, the initial model and each round's clients
are pfl's; the whole Flower run (20 clients, 4 a round, a warm-up and 2 timed rounds on 2 actors) ends
at pfl's model up to the aggregation's rounding, and its numbers are sane. Needs a Python with
``flwr[simulation]``: ``$PFL_FLOWER_PYTHON``, else ``.venv-flower/bin/python`` (bench_workers' docstring
says how to make it); skipped without one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FLOWER_PYTHON = Path(os.environ.get("PFL_FLOWER_PYTHON", ROOT / ".venv-flower" / "bin" / "python"))
SPEC = {"clients": 20, "per_round": 4}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not FLOWER_PYTHON.exists(), reason=f"no Flower Python at {FLOWER_PYTHON}")]

SAME_BITS = """
import copy, json, sys, torch
sys.path.insert(0, "pipelines")
import bench_flower as bf
from pfl.federation.simulator import Simulator

spec = json.dumps(json.loads(sys.argv[1]), sort_keys=True)
s = bf.setup(spec)
init, picks = bf.plan(spec, 3)
sim = Simulator(copy.deepcopy(s.cfg))
start = sim.method.global_params()
assert all(torch.equal(start[k], torch.from_numpy(v)) for k, v in init.items()), "initial model"
assert picks == [sim.sample(r) for r in range(3)], "sampled clients"
for rnd, cid in [(0, picks[0][0]), (1, picks[1][-1])]:
    ref = sim.client(cid).train({k: torch.from_numpy(v) for k, v in init.items()}, rnd).params
    s.model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    d = s.data.clients[cid]
    bf.sgd(s.model, d.x_train, d.y_train, lr=s.ctx.lr(rnd), batch_size=s.cfg.federation.batch_size,
           epochs=s.cfg.federation.local_epochs, generator=s.ctx.generator(rnd, cid, "train"))
    mine = s.model.state_dict()
    assert all(torch.equal(ref[k], mine[k]) for k in ref), f"client {cid}'s update"
print("same bits")
"""


def test_a_flower_client_update_is_pfls_and_so_are_the_start_and_the_clients():
    proc = subprocess.run([str(FLOWER_PYTHON), "-c", SAME_BITS, json.dumps(SPEC)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "same bits"


def test_the_flower_run_ends_at_pfls_model_up_to_rounding(tmp_path):
    from pfl.federation.loop import RoundLoop
    from pfl.federation.simulator import Simulator
    from pfl.resolver import load
    from pfl.training import evaluate
    from pfl.tune.space import load_scenario

    saved = tmp_path / "flower.pt"
    proc = subprocess.run([str(FLOWER_PYTHON), str(ROOT / "pipelines" / "bench_flower.py"),
                           json.dumps({**SPEC, "rounds": 2, "actors": 2, "save": str(saved)})],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["workers_seen"] == 2
    assert 0 < r["s_per_round"] <= r["wall_s"]
    assert 0 < r["driver_cpu_s"] <= r["all_cpu_s"]
    assert r["peak_mib"] > r["driver_peak_mib"] > 0
    overrides = {"method.name": "fedavg", "model.name": "cnn_fedavg", "data.num_clients": SPEC["clients"],
                 "federation.clients_per_round": SPEC["per_round"], "federation.local_epochs": 1,
                 "federation.rounds": 10**6, "federation.eval_every": 10**6, "tracking.enabled": False}
    sim = Simulator(load(None, overrides, load_scenario("fmnist_dir01")))
    RoundLoop(sim, []).run(until=3)
    ours, theirs = sim.method.global_params(), torch.load(saved, weights_only=True)
    assert list(ours) == list(theirs)
    # the same updates, averaged with other roundings (≈ 3e-8 after one round) that training amplifies
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 0.05
    clients = list(sim.data.clients)
    acc = evaluate(sim.ctx.model, ours, torch.cat([c.x_test for c in clients]),
                   torch.cat([c.y_test for c in clients])).acc
    assert acc > 0.2                       # it learnt something (10 classes)
    assert abs(r["test_acc"] - acc) < 0.01
