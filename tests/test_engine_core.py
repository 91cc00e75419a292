"""The engine core: every method resumes exactly, messages are the receiver's own copies, the two
sides of a method cannot see each other's state, checkpoints are safe and belong to one config,
and the λ path resumes mid-way with honest cumulative counters."""

import math
import subprocess
import sys

import pytest
import torch

from helpers import (downlink, matrix, method_config, method_names, same, small_config, straight_and_resumed,
                     uplink, untimed)
from pfl.callbacks.divergence import run_rounds
from pfl.federation.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pfl.federation.drivers import simulator_for
from pfl.federation.loop import Callback, RoundLoop
from pfl.federation.simulator import Simulator
from pfl.federation.wire import Stage
from pfl.federation.state import encode
from pfl.metric_catalog import metric_known, reported_metrics
from pfl.schema import ConfigError

METHODS = method_names(composed=True)
#: the resume test's representatives in the quick loop (server state, client state, ALA, FPFC's ADMM)
FAST = ("fedavg", "scaffold", "fpfc", "fedavg+ala")


def test_every_method_and_ala_composition_is_covered():
    assert {"fedavg", "scaffold", "fpfc", "perfed_ckt", "fedslr", "ifca", "cfl", "pacfl"} <= set(METHODS)
    assert {"fedavg+ala", "ditto+ala", "fedrep+ala", "fedavg_ft+ala"} <= set(METHODS)


@pytest.mark.parametrize("name", matrix(METHODS, FAST))
def test_resume_from_a_mid_run_checkpoint_equals_the_uninterrupted_run(tmp_path, name):
    cfg = method_config(name, federation__rounds=4, federation__momentum=0.5)
    straight, resumed = straight_and_resumed(cfg, tmp_path)
    assert untimed(resumed.history) == untimed(straight.history)
    same(encode(resumed.model_state()), encode(straight.model_state()))
    assert resumed.ledger.state_dict() == straight.ledger.state_dict()
    # every metric the run logged is one the sweeps' validation knows (pfl.metric_catalog.reported_metrics)
    catalog = reported_metrics(cfg)
    unknown = sorted({k for row in straight.history for k in row
                      if k not in ("round", "step") and not metric_known(k, catalog)})
    assert not unknown, unknown


def test_asynchronous_driver_resumes_exactly(tmp_path):
    cfg = small_config(method__name="fpfc", federation__driver="async", federation__rounds=4)
    straight, resumed = straight_and_resumed(cfg, tmp_path, simulator=simulator_for(cfg))
    assert untimed(resumed.history) == untimed(straight.history)
    same(encode(resumed.model_state()), encode(straight.model_state()))


# ---- the message boundary ----------------------------------------------------------------------

def test_receiver_edits_never_reach_the_sender():
    sim = Simulator(small_config(method__name="ditto", federation__rounds=1))
    glob = {k: v.clone() for k, v in sim.method.global_model.items()}
    down = downlink(sim, 0)
    for t in down.tensors().values():       # the client scribbles on what it received
        t.add_(1.0)
    same(sim.method.global_model, glob)
    reply = uplink(sim, 0, downlink(sim, 0, 0), 0)
    kept = {k: v.clone() for k, v in sim.client_states[0]["personal"].items()}
    trained = {k: v.clone() for k, v in reply.tensors().items()}
    for t in reply.tensors().values():      # the server scribbles on the reply
        t.mul_(-3.0)
    sim.method.aggregate(0, {0: reply})
    same(sim.client_states[0]["personal"], kept)
    assert all(not torch.equal(reply.tensors()[k], trained[k]) for k in trained)


def test_fpfc_server_keeps_its_own_copy_of_the_uploaded_models():
    sim = Simulator(small_config(method__name="fpfc", federation__clients_per_round=0, federation__rounds=1))
    run_rounds(sim)
    w_server = sim.method.W.clone()
    for state in sim.client_states:           # a client editing its kept model in place
        for t in state["w"].values():
            t.zero_()
    assert torch.equal(sim.method.W, w_server)


def test_a_stage_on_the_uplink_cannot_reach_the_clients_kept_state():
    class SignFlip(Stage):
        key = "flip"

        def send_up(self, phase, client, msg, notes):
            for part in msg.parts.values():
                for t in part.entries.values():
                    t.neg_()            # in place, on the sender's side of the wire
            return msg

    cfg = small_config(method__name="fpfc", federation__clients_per_round=0, federation__rounds=2)
    clean, attacked = Simulator(cfg), Simulator(cfg, stages=[SignFlip()])
    clean.run_round()
    attacked.run_round()
    # the clients trained identically and kept what they trained; the server got the flipped models
    same(encode(attacked.client_states), encode(clean.client_states))
    assert torch.equal(attacked.method.W, -clean.method.W)


def test_client_side_cannot_see_server_state_or_keep_state_on_the_method():
    sim = Simulator(small_config(method__name="scaffold"))
    assert hasattr(sim.method, "global_model") and hasattr(sim.method, "c")
    assert not hasattr(sim.client_role, "global_model") and not hasattr(sim.client_role, "c")
    with pytest.raises(AttributeError, match="client.state"):
        sim.client_role.cache = {}
    client = sim.client(3)
    assert client.data is sim.data.clients[3] and not hasattr(client.ctx, "data")


def test_evaluation_transfers_are_counted_apart_from_training():
    sim = Simulator(small_config(method__name="fedavg", federation__rounds=2, federation__eval_every=2))
    run_rounds(sim)
    d_bytes = sum(v.numel() * 4 for v in sim.method.global_model.values())
    last = sim.history[-1]
    assert last["comm/eval_down_bytes"] == sim.num_clients * d_bytes        # one evaluation, every client
    assert last["comm/total_bytes"] == 2 * 5 * 2 * d_bytes                  # training only
    ifca = Simulator(small_config(method__name="ifca", method__k=3, federation__rounds=1))
    run_rounds(ifca)
    assert ifca.history[-1]["comm/eval_up_bytes"] == ifca.num_clients       # one-byte cluster choice each
    assert ifca.history[-1]["comm/eval_down_bytes"] == 3 * ifca.num_clients * d_bytes


# ---- checkpoints -------------------------------------------------------------------------------

class Pickled:
    pass


def test_checkpoint_with_a_pickled_object_is_refused(tmp_path):
    from pfl.federation.durable import seal

    sim = Simulator(small_config())
    path = tmp_path / "evil.pt"
    torch.save({"format": 4, "payload": Pickled()}, path)
    with pytest.raises(CheckpointError, match="names code to run") as err:
        load_checkpoint(sim, path)
    assert str(path) in str(err.value) and err.value.field == "--checkpoint"
    seal(path)   # a checksum that matches does not make it safe
    with pytest.raises(CheckpointError, match="names code to run"):
        load_checkpoint(sim, path)


def test_checkpoint_refuses_another_config_but_accepts_a_longer_budget(tmp_path):
    sim = Simulator(small_config(federation__rounds=2))
    run_rounds(sim)
    save_checkpoint(sim, tmp_path / "c.pt")
    longer = Simulator(small_config(federation__rounds=5, tracking__experiment="elsewhere"))
    load_checkpoint(longer, tmp_path / "c.pt")
    assert longer.round == 2
    other = Simulator(small_config(federation__rounds=2, federation__lr=0.2, method__server_lr=0.5))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(other, tmp_path / "c.pt")
    assert err.value.field == "federation.lr, method.server_lr"


def test_a_run_restored_after_its_last_round_keeps_its_client_table(tmp_path):
    # a trial cut off while it uploaded its artifacts resumes from its final checkpoint and runs no
    # round: its client_metrics.csv comes from the table the checkpoint kept
    finished = Simulator(small_config(federation__rounds=2))
    run_rounds(finished)
    save_checkpoint(finished, tmp_path / "c.pt")
    restored = Simulator(small_config(federation__rounds=2))
    load_checkpoint(restored, tmp_path / "c.pt")
    assert restored.round == 2 and finished.last_client_table
    assert restored.last_client_table == finished.last_client_table


def test_checkpoint_stores_each_client_state_once(tmp_path):
    sim = Simulator(small_config(method__name="ditto", federation__clients_per_round=0, federation__rounds=2))
    run_rounds(sim)
    path = save_checkpoint(sim, tmp_path / "c.pt")
    model = sum(v.numel() * 4 for v in sim.method.global_model.values())
    # the global model, 10 personal models, and small change (history, config, ledger)
    assert path.stat().st_size < (1 + sim.num_clients) * model * 1.1 + 200_000


def test_client_state_can_wait_in_host_memory():
    on_host = Simulator(small_config(method__name="scaffold", federation__client_state_device="cpu"))
    run_rounds(on_host)
    assert on_host.store.where == torch.device("cpu")
    assert all(t.device.type == "cpu" for s in on_host.client_states for t in s.get("c", {}).values())
    with pytest.raises(ConfigError) as err:
        small_config(federation__client_state_device="gpu")
    assert err.value.field == "federation.client_state_device"


@pytest.mark.slow
def test_cli_resume_with_another_method_exits_2_naming_the_key(tmp_path):
    ckpt = tmp_path / "run.pt"
    base = [sys.executable, "-m", "pfl", "run", "--no-track", "--checkpoint", str(ckpt), "--set",
            "data.source=digits", "data.num_clients=6", "federation.rounds=2"]
    first = subprocess.run(base + ["method.name=fedavg"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run(base + ["method.name=scaffold", "--resume"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert "method.name" in again.stderr and "Traceback" not in again.stderr


# ---- the λ path as a loop controller -------------------------------------------------------------

class Interrupt(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_round(self, loop, metrics):
        if loop.sim.executed == self.at:
            raise KeyboardInterrupt


def _path_loop(cfg, settings, tmp_path, extra=()):
    from pfl.callbacks import Checkpointer, MLflowLogger, StopOnDivergence
    from pfl.runner import tracker_opener
    from pfl.tune.lambda_path import LambdaPath

    sim = Simulator(cfg)
    path = LambdaPath(settings)
    logger = MLflowLogger(tracker_opener(cfg))
    loop = RoundLoop(sim, [StopOnDivergence(), path, logger, Checkpointer(tmp_path / "path.pt", every=1), *extra])
    return loop, path, logger


@pytest.mark.slow
def test_lambda_path_interrupted_mid_path_resumes_from_its_checkpoint(tmp_path):
    from pfl.tracking import client
    from pfl.tune.lambda_path import PathSettings

    cfg = small_config(method__name="fpfc", data__val_fraction=0.2, federation__rounds=12,
                       tracking__enabled=True, tracking__experiment="path")
    settings = PathSettings(lambdas=[0.2, 0.4, 0.6], eval_every=2, stage_cap=4, window=1, tolerance=1.0,
                            residual_tol=0.0, patience=5, extend=0, finalists=2, playoff_rounds=2, budget=12)
    straight, straight_path, _ = _path_loop(cfg, settings, tmp_path / "a")
    straight.run(until=math.inf)
    # interrupted in the playoff (after the 12 path rounds, which reach the budget, and one playoff round)
    loop, _, logger = _path_loop(cfg, settings, tmp_path / "b", extra=[Interrupt(at=13)])
    with pytest.raises(KeyboardInterrupt):
        loop.run(until=math.inf)
    resumed, path, resumed_logger = _path_loop(cfg, settings, tmp_path / "b")
    resumed.load(tmp_path / "b" / "path.pt")
    assert resumed.sim.executed == 13 and path.st["phase"] == "playoff"
    assert resumed.run(until=math.inf).status == "FINISHED"
    def timeless(summary):  # times are measured, not replayed
        return {k: v for k, v in summary.items() if k not in ("fpfc/trial_wall_s", "fpfc/compute_s", "fpfc/cpu_s")}

    assert timeless(resumed.summary) == timeless(straight.summary)
    assert untimed(resumed.sim.history) == untimed(straight.sim.history)
    assert resumed_logger.run_id == logger.run_id
    mc = client()
    run = mc.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    history = sorted(mc.get_metric_history(logger.run_id, "comm/total_bytes"), key=lambda m: m.step)
    steps = [m.step for m in history]
    assert steps == list(range(1, int(straight.summary["fpfc/total_rounds"]) + 1))  # each round once
    values = [m.value for m in history]
    assert all(b >= a for a, b in zip(values, values[1:])), "cumulative traffic fell"
    assert "lambda_path.csv" in {a.path for a in mc.list_artifacts(logger.run_id)}


@pytest.mark.slow
def test_every_param_of_a_lambda_path_trial_is_the_value_the_run_used(tmp_path):
    from pfl.callbacks.tracking import config_params
    from pfl.tracking import client
    from pfl.tune.lambda_path import PathSettings

    cfg = small_config(method__name="fpfc", data__val_fraction=0.2, federation__rounds=40,
                       tracking__enabled=True, tracking__experiment="params")
    settings = PathSettings(lambdas=[0.2, 0.4], eval_every=2, stage_cap=4, window=1, tolerance=1.0,
                            residual_tol=0.0, patience=5, extend=0, finalists=1, budget=10)
    loop, path, logger = _path_loop(cfg, settings, tmp_path)
    assert loop.run(until=math.inf).status == "FINISHED"
    params = client().get_run(logger.run_id).data.params
    used = {k: str(v) for k, v in config_params(loop.sim.cfg).items()}   # the config as the run ended
    used["federation.rounds"] = str(loop.sim.executed)       # rounds the trial computed, path included
    assert params["method.lam"] == str(loop.summary["fpfc/selected_lambda"]) == used["method.lam"]
    assert params["federation.rounds"] == used["federation.rounds"] != str(cfg.federation.rounds)
    assert params.pop("path.lambdas_run") == "0.2 0.4"
    assert params.pop("path.end") in ("decline", "extension limit", "budget")
    assert params == used
