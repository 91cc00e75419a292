"""Byzantine attacks (a wire stage): what a malicious client sends, who is malicious, benign-only
metrics, and the robustness and newcomers pipelines."""

import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import same, small_config, straight_and_resumed
from pfl.callbacks.divergence import run_rounds
from pfl.federation.attacks import attack_stage, malicious_clients
from pfl.federation.messages import LowRank, Message, Model, Scalars, Update
from pfl.federation.simulator import Simulator
from pfl.federation.state import encode
from pfl.federation.wire import Masked, Only, Phase, Wrapper
from pfl.resolver import with_overrides
from pfl.schema import ConfigError


class _Client:
    """What the attack stage reads of a client: its id."""

    def __init__(self, cid: int):
        self.cid, self.state = cid, {}


def _attack(kind: str, fraction: float = 0.5, **extra):
    """The run's attack stage (Only(Attack) for the malicious clients) of a 10-client config."""
    cfg = small_config(attack__kind=kind, attack__fraction=fraction, **extra)
    return attack_stage(cfg, types.SimpleNamespace(num_clients=10, model=None), None)


def _send(stage, msg: Message, rnd: int, cid: int, phase: str = "train") -> Message:
    """``msg`` after the sender's side of ``stage`` (an upload of client ``cid``)."""
    return stage.send_up(Phase(phase, rnd), _Client(cid), msg, {})


def _upload(seed: int = 0) -> Message:
    g = torch.Generator().manual_seed(seed)
    return Message.of({"model": Model({"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}),
                       "choice": Scalars({"cluster": torch.tensor([2], dtype=torch.uint8)})}, n=17, train_loss=0.5)


def _w(msg: Message, name: str = "w") -> torch.Tensor:
    return msg.tensors("model")[name]


# ---- the attacks ---------------------------------------------------------------------------------

def test_same_value_sends_one_normal_constant_per_upload():
    att = _attack("same_value")
    b = sorted(att.clients)[0]
    out = _send(att, _upload(), 3, b)
    c = float(_w(out)[0, 0])
    assert torch.all(_w(out) == c) and torch.all(_w(out, "b") == c)
    expected = float(torch.randn((), generator=att.inner.generator(3, b), dtype=torch.float64)) * 100.0
    assert c == pytest.approx(expected, rel=1e-6)
    assert out.tensors("choice")["cluster"].tolist() == [2] and out.info == {"n": 17, "train_loss": 0.5}
    # over many uploads c ~ N(0, 100²)
    cs = np.array([float(_w(_send(att, _upload(), r, b), "b")[0]) for r in range(4000)])
    assert abs(cs.mean()) < 5 and cs.std() == pytest.approx(100, rel=0.05)


def test_sign_flip_scales_the_upload_by_minus_a_half_normal():
    att = _attack("sign_flip")
    b = sorted(att.clients)[0]
    ratios = []
    for r in range(4000):
        clean = _upload(r)
        out = _send(att, clean, r, b)
        s = _w(out) / _w(clean)
        assert torch.allclose(s, s.flatten()[0].expand_as(s), rtol=1e-5)     # one scalar per upload
        assert torch.allclose(_w(out, "b") / _w(clean, "b"), s.flatten()[0].expand(3), rtol=1e-5)
        ratios.append(float(s.flatten()[0]))
    ratios = -np.array(ratios)
    assert (ratios >= 0).all()                                            # −|s|
    assert ratios.mean() == pytest.approx(10 * math.sqrt(2 / math.pi), rel=0.05)   # E|s|, s ~ N(0, 10²)
    assert np.sqrt((ratios ** 2).mean()) == pytest.approx(10, rel=0.05)


def test_gaussian_replaces_every_float_entry_by_iid_noise():
    att = _attack("gaussian")
    b = sorted(att.clients)[0]
    values = torch.cat([_w(_send(att, _upload(r), r, b)).flatten() for r in range(2000)]).numpy()
    assert abs(values.mean()) < 3 and values.std() == pytest.approx(100, rel=0.03)
    assert abs(np.corrcoef(values[:-1], values[1:])[0, 1]) < 0.05
    again = _send(att, _upload(5), 7, b)
    # seeded by (seed, round, client), not by the input
    assert torch.equal(_w(again), _w(_send(att, _upload(9), 7, b)))


def test_the_noise_levels_are_configurable():
    att = _attack("gaussian", attack__gaussian_std=2.0)
    b = sorted(att.clients)[0]
    values = torch.cat([_w(_send(att, _upload(r), r, b)).flatten() for r in range(2000)]).numpy()
    assert values.std() == pytest.approx(2.0, rel=0.03)


def test_only_uploads_of_malicious_clients_are_attacked():
    att = _attack("gaussian")
    benign = next(c for c in range(10) if c not in att.clients)
    bad = sorted(att.clients)[0]
    assert torch.equal(_w(_send(att, _upload(), 0, benign)), _w(_upload()))
    assert torch.equal(_w(_send(att, _upload(), 0, bad, "eval")), _w(_upload()))     # IFCA's choice, say
    for phase in ("train", "eval", "join"):                                       # downlinks: never
        assert torch.equal(_w(att.send_down(Phase(phase, 0), bad, _upload())), _w(_upload()))
        assert torch.equal(_w(att.receive_down(Phase(phase, 0), _Client(bad), _upload(), {})), _w(_upload()))
    for phase in ("train", "join"):
        assert not torch.equal(_w(_send(att, _upload(), 0, bad, phase)), _w(_upload()))


def test_the_attack_writes_new_tensors_and_leaves_integer_entries():
    att = _attack("same_value")
    msg = _upload()
    msg["model"].entries["k"] = torch.tensor([1, 2], dtype=torch.int64)
    kept = msg.tensors("model")["w"].clone()
    out = _send(att, msg, 0, sorted(att.clients)[0])
    assert torch.equal(msg.tensors("model")["w"], kept)                  # the sender's reply is untouched
    assert out.tensors("model")["k"].tolist() == [1, 2]


def test_structured_payloads_are_refused_naming_the_attack():
    att = _attack("sign_flip")
    msg = Message.of({"model": Model({"w": LowRank(torch.ones(3, 1), torch.ones(1, 2))})})
    with pytest.raises(TypeError, match="attack.*LowRank"):
        _send(att, msg, 0, sorted(att.clients)[0])


def test_head_scope_rewrites_only_the_last_layer():
    cfg = small_config(attack__kind="gaussian", attack__fraction=0.5, attack__scope="head")  # MLP: head = fc.*
    sim = Simulator(cfg)
    stage = next(s for s in sim.wire.stages.stages if s.key == "attack")
    assert isinstance(stage, Only) and isinstance(stage.inner, Masked)   # malicious only, head only: wrappers
    b = sorted(sim.malicious)[0]
    model = {k: v.clone() for k, v in sim.method.global_model.items()}
    clean = Message.of({"model": Model(model), "dy": Update({"fc.weight": model["fc.weight"].clone()})})
    out = _send(stage, clean.copy(), 0, b)
    changed = {(p, k) for p in clean for k in clean[p].entries
               if not torch.equal(out.tensors(p)[k], clean.tensors(p)[k])}
    assert changed == {("model", "fc.weight"), ("model", "fc.bias"), ("dy", "fc.weight")}


# ---- the malicious subset ---------------------------------------------------------------------------

def test_malicious_subset_is_round_m_fraction_drawn_once_from_the_seed():
    cfg = small_config(attack__kind="gaussian", attack__fraction=0.25)
    ids = malicious_clients(cfg, 10)
    assert len(ids) == 3 and list(ids) == sorted(set(ids))               # round(2.5) = 3 (halves up)
    assert malicious_clients(cfg, 10) == ids
    assert malicious_clients(with_overrides(cfg, {"attack.kind": "sign_flip"}), 10) == ids  # same for every attack
    assert malicious_clients(with_overrides(cfg, {"seed": 5}), 10) != ids
    assert malicious_clients(with_overrides(cfg, {"attack.kind": "none"}), 10) == ()
    assert len(malicious_clients(with_overrides(cfg, {"attack.fraction": 0.8}), 100)) == 80


def test_the_same_clients_are_attacked_in_every_round_and_after_a_resume(tmp_path):
    cfg = small_config(method__name="fedavg", attack__kind="gaussian", attack__fraction=0.3,
                       federation__rounds=4, federation__clients_per_round=5)
    sim = Simulator(cfg)
    seen: list[tuple[int, int, str]] = []

    class Recording(Wrapper):
        """The run's attack stage, noting which uploads it changed."""

        def send_up(self, phase, client, msg, notes):
            out = self.inner.send_up(phase, client, msg, notes)
            if any(not torch.allclose(msg.tensors(p)[k], t, equal_nan=True)
                   for p in msg for k, t in out.tensors(p).items()):
                seen.append((phase.rnd, client.cid, phase.up))
            return out

    stages = sim.wire.stages.stages
    stages[:] = [Recording(s) if s.key == "attack" else s for s in stages]
    sampled = {}
    for rnd in range(4):
        sampled[rnd] = sim.sample(rnd)
        sim.run_round()
    assert seen == [(r, c, "up") for r in range(4) for c in sampled[r] if c in sim.malicious]
    assert len({c for _, c, _ in seen}) >= 2
    straight, resumed = straight_and_resumed(cfg, tmp_path)
    assert resumed.malicious == straight.malicious == sim.malicious
    assert [h.get("test/acc_mean") for h in resumed.history] == [h.get("test/acc_mean") for h in straight.history]
    same(encode(resumed.model_state()), encode(straight.model_state()))


@pytest.mark.parametrize("name", ["fpfc", "ditto", "ifca"])
def test_an_attack_never_changes_the_attackers_kept_state(name):
    extra = {"method__k": 2} if name == "ifca" else {}
    cfg = small_config(method__name=name, federation__clients_per_round=0, federation__rounds=1, **extra)
    attacked_cfg = with_overrides(cfg, {"attack.kind": "gaussian", "attack.fraction": 0.4})
    clean, attacked = Simulator(cfg), Simulator(attacked_cfg)
    clean.run_round(evaluate=False)
    attacked.run_round(evaluate=False)
    assert len(attacked.malicious) == 4
    # every client trained from the same message and kept what it trained; the server got noise
    same(encode(attacked.client_states), encode(clean.client_states))
    if name == "fpfc":
        bad = sorted(attacked.malicious)
        good = [c for c in range(10) if c not in attacked.malicious]
        assert torch.equal(attacked.method.W[good], clean.method.W[good])
        assert not torch.allclose(attacked.method.W[bad], clean.method.W[bad])
        assert attacked.method.W[bad].std() > 50


def test_metrics_under_attack_are_those_of_the_benign_clients(tmp_path):
    cfg = small_config(method__name="fedavg", attack__kind="sign_flip", attack__fraction=0.3,
                       federation__rounds=2)
    sim = Simulator(cfg)
    run_rounds(sim)
    final = sim.history[-1]
    rows = sim.last_client_table
    assert [r["malicious"] for r in rows] == [int(r["client"] in sim.malicious) for r in rows]
    benign = [r["test_acc"] for r in rows if not r["malicious"]]
    assert final["attack/benign_clients"] == len(benign) == 7
    assert final["test/acc_mean"] == pytest.approx(np.mean(benign))
    benign_global = [r["global_test_acc"] for r in rows if not r["malicious"]]
    assert final["global/test_acc"] == pytest.approx(np.mean(benign_global))
    paths = sim.artifacts(tmp_path)
    assert [p.name for p in paths] == ["attack_malicious.csv"]
    lines = paths[0].read_text().splitlines()
    assert lines[0].startswith("client") and [int(x.split(",")[0]) for x in lines[1:]] == sorted(sim.malicious)


def test_attacked_newcomers_are_left_out_of_the_newcomer_metrics():
    cfg = small_config(method__name="fpfc", attack__kind="gaussian", attack__fraction=0.3, newcomers__fraction=0.3,
                       newcomers__rounds=2, federation__rounds=2)
    sim = Simulator(cfg)
    run_rounds(sim)
    rows = sim.last_client_table
    good_new = [r["test_acc"] for r in rows if r["newcomer"] and not r["malicious"]]
    assert sim.join_result["newcomer/count"] == len(good_new) >= 1
    assert sim.join_result["newcomer/acc_mean"] == pytest.approx(np.mean(good_new))
    bad_new = [c for c in sim.ctx.newcomers if c in sim.malicious]
    assert bad_new and sim.method.W[bad_new].abs().max() > 50          # their join uploads were attacked


def test_an_attack_that_blows_up_the_model_is_an_outcome_not_a_failure():
    cfg = small_config(method__name="fedavg", attack__kind="gaussian", attack__fraction=0.5,
                       attack__gaussian_std=1e30, federation__rounds=3)
    sim = Simulator(cfg)
    run_rounds(sim)                                   # no DivergedError
    assert sim.round == 3 and any(h.get("attack/diverged") == 1.0 for h in sim.history)
    assert 0.0 <= sim.history[-1]["test/acc_mean"] <= 1.0


def test_attack_config_is_validated_before_any_work():
    with pytest.raises(ConfigError, match="attack.kind"):
        small_config(attack__kind="gauss")
    with pytest.raises(ConfigError, match="attack.fraction"):
        small_config(attack__kind="gaussian", attack__fraction=1.0)
    with pytest.raises(ConfigError, match="attack.kind.*logits"):
        small_config(method__name="perfed_ckt", attack__kind="gaussian", attack__fraction=0.2)
    with pytest.raises(ConfigError, match="method.aggregator"):
        small_config(method__aggregator="avg")
    with pytest.raises(ConfigError, match="aggregator"):
        small_config(method__name="scaffold", method__aggregator="median")   # no global-model average to replace


# ---- the pipelines (tables/robustness.yaml, tables/newcomers.yaml) --------------------------------------

TINY_S1 = ["data.num_clients=12", "data.params.size_scale=0.05", "federation.clients_per_round=6"]
ROOT = Path(__file__).resolve().parents[1]


def _pipeline(ray_cluster, tmp_path, script, *args):
    import subprocess  # noqa: F401  (the cluster's driver is a subprocess)
    import sys

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    code, out = ray_cluster.run([sys.executable, str(ROOT / "pipelines" / script), *args, "--out", str(tmp_path / "out"),
                                 "--storage", str(tmp_path / "ray_results"), "--quiet"],
                                {"MLFLOW_TRACKING_URI": uri, "PFL_CACHE_DIR": str(tmp_path / "cache"),
                                 "RAY_ADDRESS": ray_cluster.address})
    return code, out, MlflowClient(tracking_uri=uri)


def _parent_and_children(mc):
    runs = [r for e in mc.search_experiments() for r in mc.search_runs([e.experiment_id])]
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    return parent, {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}


@pytest.mark.slow
def test_robustness_pipeline_logs_parent_table_plots_and_children(ray_cluster, tmp_path):
    import pandas as pd

    code, out, mc = _pipeline(ray_cluster, tmp_path, "robustness.py", "--scenarios", "s1", "--methods", "fpfc",
                              "fedavg", "--attacks", "gaussian", "--fractions", "0", "0.4", "--rounds", "2",
                              "--seeds", "0", "1", "--set", *TINY_S1)
    assert code == 0, out[-4000:]
    runs = pd.read_csv(tmp_path / "out" / "robustness_runs.csv")
    assert sorted(zip(runs["group"], runs["row"], runs["seed"])) == sorted(
        (g, m, s) for g in ("s1|none|0", "s1|gaussian|0.4") for m in ("fpfc", "fedavg") for s in (0, 1))
    assert (runs["status"] == "FINISHED").all()
    by = runs.set_index(["group", "row", "seed"])
    assert by.loc[("s1|none|0", "fpfc", 0), "benign_clients"] == 12
    assert by.loc[("s1|gaussian|0.4", "fpfc", 0), "benign_clients"] == 7          # round(12 · 0.4) = 5 malicious
    # like for like: the drop is the clean run's accuracy on the attacked run's benign devices minus its own
    attacked = by.loc[("s1|gaussian|0.4", "fpfc", 0)]
    assert attacked["drop"] == pytest.approx(attacked["clean_same_devices"] - attacked["benign_acc"])
    assert by.loc[("s1|none|0", "fpfc", 0), "drop"] == pytest.approx(0.0)
    summary = pd.read_csv(tmp_path / "out" / "robustness.csv").set_index(["group", "row"])
    cell = summary.loc[("s1|gaussian|0.4", "fpfc")]
    assert cell["seeds"] == 2 and cell["benign_acc_mean"] == pytest.approx(
        runs[(runs["group"] == "s1|gaussian|0.4") & (runs["row"] == "fpfc")]["benign_acc"].mean())
    assert "| fpfc |" in out and "±" in out and "largest drop" in out
    assert (tmp_path / "out" / "benign_acc_vs_fraction_gaussian.png").is_file()
    parent, children = _parent_and_children(mc)
    top = {a.path for a in mc.list_artifacts(parent.info.run_id)}
    assert {"robustness.csv", "robustness.md", "robustness_runs.csv", "plots"} <= top
    assert {a.path for a in mc.list_artifacts(parent.info.run_id, "plots")} == {"plots/benign_acc_vs_fraction_gaussian.png"}
    assert set(children) == {f"s1|{p}: {m} [seed {s}]" for m in ("fpfc", "fedavg") for p in ("none|0", "gaussian|0.4")
                             for s in (0, 1)}
    hit = children["s1|gaussian|0.4: fpfc [seed 0]"]
    assert hit.data.metrics["attack/benign_clients"] == 7
    assert hit.data.params["attack.kind"] == "gaussian" and hit.data.params["method.lam"] == "0.6"
    assert hit.data.params["seed"] == "0" and children["s1|gaussian|0.4: fpfc [seed 1]"].data.params["seed"] == "1"
    assert "attack_malicious.csv" in {a.path for a in mc.list_artifacts(hit.info.run_id)}
    assert "attack/benign_clients" not in children["s1|none|0: fpfc [seed 0]"].data.metrics


def test_robustness_pipeline_cli_rejects_bad_input(capsys):
    import sys

    sys.path.insert(0, str(ROOT / "pipelines"))
    import robustness
    from pfl.tables.cli import main

    assert main(robustness.translate(["--fractions", "1.0", "--no-track"]), table=robustness.TABLE) == 2
    assert "--only" in capsys.readouterr().err
    assert main(robustness.translate(["--scenarios", "s1", "--methods", "fpfc", "--fractions", "0", "--no-track",
                                      "--set", "attack.gaussian_std=-1"]), table=robustness.TABLE) == 2
    assert "attack.gaussian_std" in capsys.readouterr().err


@pytest.mark.slow
def test_newcomers_pipeline_prints_table_3_beside_the_paper(ray_cluster, tmp_path):
    import pandas as pd

    code, out, mc = _pipeline(ray_cluster, tmp_path, "newcomers.py", "--scenarios", "s1", "--methods", "local", "fpfc",
                              "--rounds", "2", "--join-rounds", "2", "--seeds", "0", "1", "--set", *TINY_S1)
    assert code == 0, out[-4000:]
    runs = pd.read_csv(tmp_path / "out" / "newcomers_runs.csv")
    assert len(runs) == 4 and (runs["status"] == "FINISHED").all()
    rows = pd.read_csv(tmp_path / "out" / "newcomers.csv").set_index("row")
    assert set(rows.index) == {"local", "fpfc"} and rows.loc["fpfc", "seeds"] == 2
    assert rows.loc["fpfc", "final_mean"] == pytest.approx(runs[runs["row"] == "fpfc"]["final"].mean())
    assert (runs[runs["row"] == "fpfc"]["paper_acc"] == 0.7931).all() and 0 <= rows.loc["fpfc", "final_mean"] <= 1
    assert rows.loc["fpfc", "ari_mean"] == rows.loc["fpfc", "ari_mean"]   # a number
    assert rows.loc["local", "join_steps_mean"] == 2 and rows.loc["local", "join_bytes_mean"] == 0
    assert rows.loc["local", "test_n_mean"] > 0
    assert "79.31" in out and "±" in out
    parent, children = _parent_and_children(mc)
    assert {"newcomers.csv", "newcomers.md", "newcomers_runs.csv"} <= {a.path for a in mc.list_artifacts(parent.info.run_id)}
    assert set(children) == {f"s1: {m} [seed {s}]" for m in ("local", "fpfc") for s in (0, 1)}
    fpfc = children["s1: fpfc [seed 0]"]
    assert fpfc.data.params["newcomers.fraction"] == "0.2"
    assert "newcomer/acc_mean" in fpfc.data.metrics and "newcomer/ari" in fpfc.data.metrics
    assert "newcomers.csv" in {a.path for a in mc.list_artifacts(fpfc.info.run_id)}


def test_attack_and_newcomer_metrics_are_in_the_sweep_catalog():
    """A sweep may optimise ``newcomer/acc_mean`` or read ``attack/benign_clients``: both are catalogued,
    and only for configs that report them."""
    from pfl.metric_catalog import metric_known, reported_metrics

    cfg = small_config(method__name="fpfc", attack__kind="gaussian", attack__fraction=0.2, newcomers__fraction=0.2,
                       newcomers__rounds=2, federation__rounds=2)
    sim = Simulator(cfg)
    run_rounds(sim)
    logged = {k for row in sim.history for k in row if k not in ("round", "step")} | set(sim.join_result)
    assert {"attack/benign_clients", "newcomer/acc_mean", "newcomer/clusters", "comm/join_up_bytes"} <= logged
    catalog = reported_metrics(cfg)
    assert [k for k in sorted(logged) if not metric_known(k, catalog)] == []
    plain = reported_metrics(small_config(method__name="fpfc"))
    assert not metric_known("newcomer/acc_mean", plain) and not metric_known("attack/benign_clients", plain)


@pytest.mark.parametrize("name, extra", [("fedavg", {"method__aggregator": "krum"}), ("fpfc", {}),
                                         ("ifca", {"method__k": 2})])
def test_attacks_and_robust_rules_act_alike_on_sequential_and_vectorized_cohorts(name, extra):
    """The attack is a wire stage on each client's side of the trip, which both cohort paths run per client: the
    attacked uploads are the same draws, the benign ones agree up to float rounding, newcomers join alike."""
    kw = dict(method__name=name, attack__kind="gaussian", attack__fraction=0.3, newcomers__fraction=0.2,
              newcomers__rounds=2, federation__rounds=2, **extra)
    seq = Simulator(small_config(federation__cohort="sequential", **kw))
    vec = Simulator(small_config(federation__cohort="vectorized", **kw))
    assert not seq.vectorized and vec.vectorized and seq.malicious == vec.malicious
    run_rounds(seq)
    run_rounds(vec)
    for a, b in zip(seq.history, vec.history):
        for key in ("test/acc_mean", "attack/benign_clients", "comm/up_bytes"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert seq.join_result.keys() == vec.join_result.keys()
    assert vec.join_result["newcomer/acc_mean"] == pytest.approx(seq.join_result["newcomer/acc_mean"], abs=1e-6)
    if name == "fpfc":
        bad = sorted(seq.malicious)
        assert torch.allclose(vec.method.W[bad], seq.method.W[bad], rtol=1e-5, atol=1e-4)
        assert seq.method.W[bad].abs().max() > 50       # noise, not what they trained
