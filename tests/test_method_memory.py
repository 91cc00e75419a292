"""Methods say what their population-bound server state needs, and a run that cannot fit is refused
before any work (pfl/server_memory.py, Method.server_bytes).

The declarations are compared with what a run really holds: every tensor of the method's server
state after a round in which every client reported, counted byte by byte (numel × element size),
less the few models that do not grow with the population, which the test names. A refusal is one
line naming the method, the clients and the bytes, exit status 2, before any data is loaded.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import small_config

from pfl import cli
from pfl.federation.simulator import Simulator
from pfl.methods import get_method, list_methods
from pfl.schema import ConfigError
from pfl.server_memory import (GiB, check_server_memory, config_model_size, declares_memory, human_bytes,
                               model_size)


def tensor_bytes(value) -> int:
    """Bytes of every tensor (and numpy array) in a state, however nested."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(tensor_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


def run(rounds: int = 1, **overrides) -> Simulator:
    """A small digits run, every client sampled (so every client has reported), no evaluation."""
    cfg = small_config(**{"data__partition__kind": "iid", "federation__clients_per_round": 0,
                          "federation__local_steps": 1, "model__name": "softmax_regression", **overrides})
    sim = Simulator(cfg)
    for _ in range(rounds):
        sim.run_round(evaluate=False)
    return sim


def declared(sim: Simulator) -> int:
    size = model_size(sim.ctx.model, sim.data.input_shape, sim.data.num_classes)
    return get_method(sim.cfg.method.name).server_bytes(sim.num_clients, size, sim.cfg)


def held(sim: Simulator, fixed: tuple[str, ...] = ()) -> int:
    """Bytes of the server state's tensors, less the attributes ``fixed`` (models kept whatever m is)."""
    state = sim.method.server_state()
    assert set(fixed) <= set(state)
    return tensor_bytes({k: v for k, v in state.items() if k not in fixed})


# ---- the declarations are what a run allocates --------------------------------------------------------

@pytest.mark.parametrize("layers, stale", [("none", False), ("body", False), ("body", True)])
def test_fpfc_declares_its_pairwise_state(layers, stale):
    # an MLP, so that shared_layers=body clusters the head only (p = 10·(32+1)) and averages the rest
    sim = run(method__name="fpfc", method__shared_layers=layers, method__stale_body=stale, data__num_clients=6,
              model__name="mlp", model__params__hidden=[32])
    p = 10 * 33 if layers == "body" else 64 * 32 + 32 + 10 * 33
    assert sim.method.theta.shape == (6, 6, p)
    assert held(sim, fixed=("body",)) == declared(sim) > 2 * 36 * p * 4


def test_pacfl_declares_its_proximity_matrix_and_bases():
    # β = 90°: one cluster (one model, not counted); every client has ≥ 2 training samples of each
    # digit; 2 of the 8 clients are newcomers: in the matrix, without a basis until they join
    sim = run(method__name="pacfl", method__n_basis=2, method__beta=90.0, data__num_clients=8,
              newcomers__fraction=0.25)
    assert len(sim.method.bases) == 6 and len(sim.method.models) == 1
    assert held(sim, fixed=("models",)) == declared(sim) == 4 * 8 * 8 + 4 * 6 * 64 * 2 * 10


def test_cfl_declares_every_clients_last_update():
    # 2 of the 8 clients are newcomers (no update during training); an MLP: p = 64·32 + 32 + 10·33
    sim = run(method__name="cfl", method__start_round=100, data__num_clients=8, newcomers__fraction=0.25,
              model__name="mlp", model__params__hidden=[32])
    assert len(sim.method.last_update) == 6 and not sim.method.tree
    assert held(sim, fixed=("models", "tree")) == declared(sim) == 4 * 6 * (64 * 32 + 32 + 10 * 33)


#: per declaring method: settings under which every client's state is on the server after the rounds
FULLEST = {
    "fpfc": {}, "fpfc_l1": {}, "cfl": {"method.start_round": 100},
    "pacfl": {"method.n_basis": 2, "method.beta": 90.0},
    "lag": {}, "diana": {"method.shifts": "per_client"}, "fedslr": {"method.server": "algo2"},
    "fedamp": {},
    # client sampling (the per-client models exist only then): 3 of 4 or 7 of 8, until all reported
    "fedsplit": {"federation.clients_per_round": -1, "rounds": 4},
    "l2gd": {"federation.clients_per_round": -1, "rounds": 4},
}


def test_every_declaring_method_is_measured_here():
    # composed methods (base+plugin, built when named) inherit their base's declaration
    assert sorted(c.name for c in list_methods() if declares_memory(c) and "+" not in c.name) == sorted(FULLEST)


@pytest.mark.parametrize("name", sorted(FULLEST))
def test_declared_bytes_are_what_grows_with_the_population(name):
    """At 4 and at 8 clients, the state a run holds less the declared bytes is the same: the
    declaration is exactly what grows with the population (the rest: a few models)."""
    settings = dict(FULLEST[name])
    rounds = settings.pop("rounds", 1)
    rest = []
    for m in (4, 8):
        over = {k.replace(".", "__"): (m - 1 if v == -1 else v) for k, v in settings.items()}
        sim = run(rounds, method__name=name, data__num_clients=m, **over)
        need = declared(sim)
        assert need > 0, f"{name} declares nothing at {m} clients"
        rest.append(held(sim) - need)
    assert rest[0] == rest[1], f"{name}: held − declared {rest}"


@pytest.mark.parametrize("name, settings", [("fedsplit", {}), ("l2gd", {}), ("diana", {"method.shifts": "auto"}),
                                            ("fedslr", {"method.server": "algo3"})])
def test_a_setting_without_per_client_state_declares_none(name, settings):
    over = {k.replace(".", "__"): v for k, v in settings.items()}
    sims = [run(2, method__name=name, data__num_clients=m, **over) for m in (4, 8)]
    assert [declared(s) for s in sims] == [0, 0]
    assert held(sims[0]) == held(sims[1])


# ---- the check --------------------------------------------------------------------------------------

def fpfc_config(m: int, **overrides):
    return small_config(**{"method__name": "fpfc", "data__source": "fpfc_synthetic", "data__num_clients": m,
                           "data__partition__kind": "natural", "data__params__size_scale": 0.1,
                           "data__params__num_clusters": 2, **overrides})


def fpfc_bytes(m: int, p: int = 610) -> int:
    """FPFC's state by hand: W, θ, v, Dᵀθ (float32) and n_i (float64)."""
    return 4 * (2 * m * m * p + 2 * m * p) + 8 * m


def fpfc_need(m: int, sampled: int, p: int = 610) -> int:
    """The state and a round's temporaries: the first residual pass's two (m, m, p) tensors, or a pair
    update's four (|A|, m, p) ones, whichever is more."""
    return fpfc_bytes(m, p) + 4 * max(2 * m * m * p, 4 * min(sampled, m) * m * p)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's peak measures a round's temporaries")
@pytest.mark.parametrize("sampled", [6, 40])
def test_fpfc_round_needs_its_declared_temporaries(sampled):
    """The peak of the server's step beyond what it holds is the declared work: the residuals' first
    pass (6 of 40 devices) or the pair update (all 40). Measured around ``aggregate`` (the pair
    update and the residuals), apart from what the clients' training allocates."""
    cfg = fpfc_config(40, data__params__num_features=784, federation__device="cuda",
                      federation__clients_per_round=sampled, federation__cohort="sequential")
    sim = Simulator(cfg)
    server_step, extra = sim.method.aggregate, []

    def measured(rnd, replies):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        server_step(rnd, replies)
        torch.cuda.synchronize()
        extra.append(torch.cuda.max_memory_allocated() - before)

    sim.method.aggregate = measured
    sim.run_round(evaluate=False)
    extra = extra[0]
    size = model_size(sim.ctx.model, sim.data.input_shape, sim.data.num_classes)
    work = get_method("fpfc").server_work_bytes(40, size, cfg)
    assert work == fpfc_need(40, sampled, 7850) - fpfc_bytes(40, 7850)
    assert 0.95 * work <= extra <= work + 8 * 2**20, (extra, work)


def test_the_check_compares_with_the_memory_given():
    cfg = fpfc_config(50)   # 5 devices a round
    need = fpfc_need(50, 5)
    assert check_server_memory(cfg, available=need) == need   # fits exactly
    with pytest.raises(ConfigError) as err:
        check_server_memory(cfg, available=need - 1)
    text = str(err.value)
    assert err.value.field == "data.num_clients" and "\n" not in text
    assert "fpfc" in text and "50 clients" in text and human_bytes(fpfc_bytes(50)) in text, text
    assert f"({human_bytes(need)} in all)" in text, text
    # the largest population that fits, exactly
    most = max(k for k in range(1, 50) if fpfc_need(k, 5) <= need - 1)
    assert f"at most {most:,} clients (data.num_clients)" in text, text


def test_fpfc_offers_shared_layers_body_with_what_it_needs():
    cfg = fpfc_config(40, model__name="mlp", model__params__hidden=[64])
    size = config_model_size(cfg)
    assert (size.params, size.head) == (60 * 64 + 64 + 10 * 65, 10 * 65)
    whole, body = fpfc_need(40, 5, size.params), fpfc_need(40, 5, size.head)
    with pytest.raises(ConfigError) as err:
        check_server_memory(cfg, available=body)                # the head alone fits: that is the key
    assert err.value.field == "method.shared_layers"
    assert f"method.shared_layers=body (needs {human_bytes(body)})" in str(err.value)
    assert human_bytes(whole) in str(err.value)
    body_cfg = fpfc_config(40, model__name="mlp", model__params__hidden=[64], method__shared_layers="body")
    assert check_server_memory(body_cfg, available=body) == body


def test_pfl_run_refuses_before_loading_anything(capsys, tmp_path):
    """Through the command line, the budget set by federation.server_memory_gb: exit 2, one line,
    nothing trained and no data loaded (the partition cache stays empty)."""
    need = fpfc_need(50, 10)  # 10 devices a round (the default)
    code = cli.main(["run", "--no-track", "--set", "method.name=fpfc", "data.source=fpfc_synthetic",
                     "data.num_clients=50", "federation.rounds=1", f"federation.server_memory_gb={(need - 1) / GiB}"])
    out = capsys.readouterr()
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: data.num_clients: fpfc "), out.err
    assert "50 clients" in lines[0] and f"({human_bytes(need)} in all)" in lines[0]
    assert "federation.server_memory_gb allows" in lines[0]
    assert "round" not in out.out
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.rglob("*"))


def test_pfl_run_refuses_what_no_machine_holds(capsys):
    """The real path, the machine's own memory: FPFC on 3,400 clients with a million-parameter model
    needs 2·3,400²·10⁶·4 bytes ≈ 84 TiB."""
    code = cli.main(["run", "--no-track", "--set", "method.name=fpfc", "data.source=fpfc_synthetic",
                     "data.num_clients=3400", "data.params.num_features=100000", "federation.rounds=1"])
    out = capsys.readouterr()
    need = fpfc_bytes(3400, 100_001 * 10)
    assert code == 2 and len(out.err.strip().splitlines()) == 1, out.err
    assert "3,400 clients" in out.err and f"that is {human_bytes(need)}" in out.err and "TiB" in out.err, out.err
    assert "available" in out.err or "free" in out.err


def test_a_run_that_fits_is_not_refused(capsys):
    need = fpfc_need(10, 10)
    code = cli.main(["run", "--no-track", "--set", "method.name=fpfc", "data.source=fpfc_synthetic",
                     "data.num_clients=10", "data.params.size_scale=0.1", "data.params.num_clusters=2",
                     "federation.rounds=1", f"federation.server_memory_gb={need / GiB}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "config error" not in out.err and "round    1/1" in out.out


def test_the_simulator_refuses_before_the_method_makes_its_state():
    """The last guard, for configs no driver checked (a sweep trial's own settings, a pipeline's runs):
    the data is there, the method's state is not made."""
    cfg = fpfc_config(20, federation__server_memory_gb=fpfc_need(20, 5) / 2 / GiB)
    with pytest.raises(ConfigError) as err:
        Simulator(cfg)
    assert err.value.field == "data.num_clients" and "20 clients" in str(err.value)
    cfg = fpfc_config(20, federation__server_memory_gb=fpfc_need(20, 5) / GiB)
    assert Simulator(cfg).method.theta.shape == (20, 20, 610)


def test_a_sweep_refuses_before_ray_starts(tmp_path):
    """run_sweep checks the base config after its data check and before Ray: with an unreachable Ray
    address, a run_sweep that got past the check would fail another way."""
    from pfl.tune.space import load_space
    from pfl.tune.sweep import run_sweep

    space_file = tmp_path / "space.yaml"
    space_file.write_text(
        "base: {method.name: fpfc, data.source: fpfc_synthetic, data.num_clients: 30, data.params.size_scale: 0.1,\n"
        "       data.params.num_clusters: 2, federation.rounds: 2, tracking.enabled: false,\n"
        f"       federation.server_memory_gb: {fpfc_need(30, 10) / 2 / GiB}}}\n"
        "search: {method.rho: {type: choice, values: [1.0, 1.5]}}\n"
        "metric: val/acc_mean\nmode: max\nnum_samples: 1\nsearcher: random\n")
    with pytest.raises(ConfigError) as err:
        run_sweep(load_space(space_file), address="127.0.0.1:9", storage=tmp_path / "ray", progress=None)
    assert err.value.field == "data.num_clients" and "30 clients" in str(err.value)
