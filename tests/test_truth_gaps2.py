"""Truth tests for survivors of the seed-3 mutation sample (docs/verification.md, "Mutation score").

Each compares with something written another way: numpy's sort-and-trim, LAG's threshold formula,
LAG's skip rule with a top-k uplink by hand, gradient descent with weight decay for MARINA with
exact differences, a lossless uplink against the uncompressed run, PACFL's and FedSLR's server memory
against the bytes their state holds, an MLP's parameter count, pair-count ARIs of hand-made groups;
and properties the code must keep: a seeded run is the same whatever the global torch stream holds,
the batched cohort gives the sequential loop's models, ALA's first round is its base's, CFL's split
tree never reuses an id, a stage chain never lets two stages share their state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from truth import close, least_squares, run_rounds, simulator, vec

LR, K = 0.2, 3


@pytest.fixture(scope="module")
def problem():
    return least_squares(d=4, sizes=(20, 30, 24, 27), clusters=[0, 1, 2, 3])


# ---- trimmed mean ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n, fraction", [(4, 0.5), (5, 0.5), (6, 0.45), (7, 0.2)])
def test_trimmed_mean_at_large_fractions_keeps_at_least_one_value_per_side(n, fraction):
    """⌊fraction·n⌋ cut from each end, at most (n − 1)//2: numpy sorts each coordinate and trims."""
    from pfl.aggregation import trimmed_mean

    rng = np.random.default_rng(n)
    values = rng.normal(size=(n, 3, 2))
    models = [{"w": torch.tensor(v)} for v in values]
    cut = min(int(np.floor(fraction * n)), (n - 1) // 2)
    expected = np.sort(values, axis=0)[cut:n - cut].mean(0)
    np.testing.assert_allclose(trimmed_mean(models, fraction)["w"].numpy(), expected, rtol=1e-12)


# ---- LAG --------------------------------------------------------------------------------------------

def test_lag_threshold_is_xi_over_d_times_the_last_d_movements():
    from pfl.methods.lag import lag_threshold

    m = [0.5, 0.25, 2.0, 1.0]
    assert lag_threshold(m, xi=0.6, D=1) == pytest.approx(0.6 * 1.0)
    assert lag_threshold(m, xi=0.6, D=1, server_lr=0.5) == pytest.approx(0.6 * 1.0 / 0.25)
    assert lag_threshold(m, xi=0.9, D=3) == pytest.approx(0.3 * (0.25 + 2.0 + 1.0))
    assert lag_threshold(m, xi=0.9, D=8) == pytest.approx(0.9 / 8 * 3.75)    # missing terms are 0
    assert lag_threshold([], xi=0.9, D=2) == 0.0


def test_lag_skip_rate_is_zero_before_any_upload(problem):
    sim = simulator(problem, "lag", steps=K, lr=0.05)
    assert sim.method.extra_metrics(0) == {"lag/skip_rate": 0.0}


def _topk(v, k):
    out = np.zeros_like(v)
    order = sorted(range(len(v)), key=lambda j: (-abs(v[j]), j))[:k]
    out[order] = v[order]
    return out


def test_lag_with_a_top_k_uplink_by_hand(problem):
    """LAG's upload is the update of x^t encoded by the uplink compressor, and both sides store the
    decoded update Δ̂_i = C(Δ_i): top-k (ρ = 0.5) per tensor keeps 2 of the 4 weights and the bias."""
    p, xi, D = problem, 0.6, 2
    sim = simulator(p, "lag", steps=K, lr=0.05, method__xi=xi, method__history=D,
                    compression__uplink={"name": "topk", "ratio": 0.5}, compression__min_numel=1)
    weights = np.array([p.n(i) for i in range(p.m)], dtype=float)
    weights /= weights.sum()
    x = vec(sim.method.global_model)
    stored: dict[int, np.ndarray] = {}
    movements: list[float] = []
    skips = 0
    for _ in range(6):
        thr = xi / D * sum(movements[-D:])
        used = []
        for i in range(p.m):
            delta = p.gd(i, x, K, 0.05) - x
            if i in stored and np.sum((delta - stored[i]) ** 2) <= thr:
                skips += 1
            else:
                stored[i] = np.concatenate([_topk(delta[:-1], 2), delta[-1:]])
            used.append(x + stored[i])
        new = sum(w * u for w, u in zip(weights, used))
        movements.append(float(np.sum((new - x) ** 2)))
        x = new
    run_rounds(sim, 6)
    assert sim.method.skips == skips
    assert close(vec(sim.method.global_model), x, 1e-4)
    plain = simulator(p, "lag", steps=K, lr=0.05, method__xi=xi, method__history=D)
    run_rounds(plain, 6)
    assert not close(vec(plain.method.global_model), x, 1e-3)    # dense uploads differ: the compressor acts


# ---- MARINA -------------------------------------------------------------------------------------------

def test_marina_with_the_identity_and_weight_decay_is_gradient_descent_on_the_regularised_loss(problem):
    """With weight decay λ every gradient is of f + (λ/2)‖x‖² (bias included, as the local loop does)."""
    p, wd = problem, 0.3
    sim = simulator(p, "marina", lr=LR, compression__uplink__name="identity", method__p=0.3,
                    federation__weight_decay=wd)
    grad = lambda x: sum(p.grad(i, x) for i in range(p.m)) / p.m + wd * x  # noqa: E731
    x = vec(sim.method.x)
    run_rounds(sim, 6)
    for _ in range(5):  # round 0 only collects g⁰
        x = x - LR * grad(x)
    assert close(vec(sim.method.x), x)


# ---- a lossless uplink is no uplink -----------------------------------------------------------------

@pytest.mark.parametrize("method, kw", [
    ("pfedme", {"method__lam": 2.0, "method__personal_lr": 0.05, "method__local_iters": 3}),
    ("perfedavg", {"method__alpha": 0.05}),
    ("fedavg", {}),
])
def test_a_lossless_uplink_gives_the_uncompressed_run(problem, method, kw):
    """The identity compressor sends each model as its exact change of the part it was trained from
    (its ``base``): the server's models are the uncompressed run's (to float32 rounding)."""
    runs = []
    for extra in ({}, {"compression__uplink__name": "identity", "compression__min_numel": 1}):
        sim = simulator(problem, method, steps=K, lr=0.05, rounds=2, **kw, **extra)
        run_rounds(sim, 2)
        runs.append(vec(sim.method.global_model))
    assert close(runs[1], runs[0], 1e-5)
    assert not close(runs[0], vec(simulator(problem, method, steps=K, lr=0.05, **kw).method.global_model), 1e-3)


# ---- PACFL's server memory ---------------------------------------------------------------------------

def test_pacfl_server_bytes_are_the_bytes_its_state_holds(problem):
    """The (m, m) float32 angles and one float32 basis (features × min(n_basis, features)) per client."""
    from pfl.methods.base import ModelSize
    from pfl.methods.pacfl import PACFL

    sim = simulator(problem, "pacfl", steps=K, lr=0.05, method__n_basis=3)
    run_rounds(sim, 1)
    meth = sim.method
    held = meth.prox.numel() * meth.prox.element_size() + sum(b.numel() * b.element_size() for b in meth.bases.values())
    assert len(meth.bases) == problem.m and all(b.shape == (4, 3) for b in meth.bases.values())
    size = ModelSize(params=5, head=5, features=4, classes=0)
    assert PACFL.server_bytes(problem.m, size, sim.cfg) == held


# ---- the wire's boundaries and its randomness ---------------------------------------------------------

def test_a_tensor_of_exactly_min_numel_entries_is_encoded():
    """``compression.min_numel``: tensors with *fewer* entries are sent dense."""
    from pfl.compression.codec import compressible

    assert compressible(torch.zeros(4), 4) and not compressible(torch.zeros(3), 4)
    assert compressible(torch.zeros(1), 0) and compressible(torch.zeros(1), 1)
    assert not compressible(torch.zeros(4, dtype=torch.int64), 1)
    assert not compressible(torch.zeros(8), 1, "model/bn.running_mean", dense=("bn.running_mean",))


def _with_global_seed(seed, make, rounds):
    sim = make()
    for _ in range(rounds):
        torch.manual_seed(seed)          # the process's global stream: no draw of the run may read it
        sim.run_round(evaluate=False)
    return sim


def test_downlink_compression_draws_from_the_runs_keyed_streams_not_the_global_one(problem):
    """A seeded run is the same whatever the process's global torch stream holds (randomness is
    keyed by seed, round, client and tensor): here rand-k on the downlink, of a model (a part the
    client keeps: FedAvg) and of values (MARINA's gradient estimate g, an Update)."""
    for method, attr in (("fedavg", "global_model"),):
        make = lambda: simulator(problem, method, steps=K, lr=0.05, rounds=3, compression__min_numel=1,  # noqa: E731,B023
                                 compression__downlink={"name": "randk", "ratio": 0.5})
        a, b = (vec(getattr(_with_global_seed(s, make, 3).method, attr)) for s in (0, 1))
        assert np.array_equal(a, b), method
        plain = simulator(problem, method, steps=K, lr=0.05, rounds=3)
        run_rounds(plain, 3)
        assert not close(vec(getattr(plain.method, attr)), a, 1e-4), method   # the compressor does act


def test_perfed_ckt_public_minibatches_draw_from_the_clients_keyed_stream():
    from helpers import small_config
    from pfl.federation.simulator import Simulator

    cfg = dict(method__name="perfed_ckt", method__architectures=["mlp"], method__public_size=40,
               method__public_batch=8, method__lam=1.0, data__num_clients=4, federation__clients_per_round=0,
               federation__rounds=2)
    a, b = (_with_global_seed(s, lambda: Simulator(small_config(**cfg)), 2).method.logits for s in (0, 1))
    assert torch.isfinite(a).all() and torch.equal(a, b)
    # the centroids are values the client does not keep: rand-k on the downlink compresses them as values
    down = dict(cfg, federation__rounds=3, compression__min_numel=1,
                compression__downlink={"name": "randk", "ratio": 0.5})
    a, b = (_with_global_seed(s, lambda: Simulator(small_config(**down)), 3).method.logits for s in (0, 1))
    assert torch.isfinite(a).all() and torch.equal(a, b)


# ---- ALA's first round ---------------------------------------------------------------------------------

@pytest.mark.parametrize("base, kw", [("lag", {"method__xi": 0.6}), ("perfedavg", {"method__alpha": 0.05})])
def test_ala_without_a_local_model_starts_from_the_received_one(problem, base, kw):
    """ALA mixes the received model into the client's local one; in a client's first round there is
    none, so training starts from the received model and ``base+ala`` is ``base``."""
    runs = []
    for name in (base, base + "+ala"):
        sim = simulator(problem, name, steps=K, lr=0.05, **kw)
        run_rounds(sim, 1)
        runs.append(vec(sim.method.global_model))
    assert np.allclose(runs[0], runs[1], rtol=0, atol=1e-7)


# ---- FedSLR's server memory ----------------------------------------------------------------------------

@pytest.mark.parametrize("server", ["algo2", "algo3"])
def test_fedslr_server_bytes_are_the_per_client_duals_it_holds(problem, server):
    """Algorithm 2 keeps every client's γ_i (m × p values); Algorithm 3 only their mean."""
    from pfl.methods.base import ModelSize
    from pfl.methods.fedslr import FedSLR

    sim = simulator(problem, "fedslr", steps=K, lr=0.05, method__server=server)
    held = sum(t.numel() * t.element_size() for t in (sim.method.gamma_all or {}).values())
    assert (held > 0) == (server == "algo2")
    assert FedSLR.server_bytes(problem.m, ModelSize(params=5, head=5, features=4), sim.cfg) == held


# ---- per-sample custom losses in the batched cohort -------------------------------------------------------

@pytest.mark.parametrize("method, kw", [("fedproto", {"method__lam": 1.0}), ("fedrod", {})])
def test_a_custom_per_sample_loss_averages_only_a_clients_real_samples_in_the_batched_cohort(method, kw):
    """FedProto's and FedRoD's losses are per sample: the batched cohort pads the smaller clients and
    averages each client's losses over its own samples only, so it gives the sequential loop's models."""
    from truth import classification_data, config

    from pfl.federation.simulator import Simulator

    data, _ = classification_data(sizes=(12, 30, 10, 21))
    out = []
    for cohort in ("sequential", "vectorized"):
        cfg = config(method, data.num_clients, steps=K, lr=0.1, source="digits", model="mlp",
                     model__params={"hidden": [6]}, federation__cohort=cohort, **kw)
        sim = Simulator(cfg, data=data)
        run_rounds(sim, 2)
        assert sim.vectorized == (cohort == "vectorized")
        out.append([sim.personal_params(c) for c in range(data.num_clients)])
    for a, b in zip(*out):                      # each client's evaluated model (FedRoD: with its own head)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k], b[k], atol=1e-5), k


# ---- PerFed-CKT's architectures and cluster read-outs --------------------------------------------------

def _ckt(**kw):
    from helpers import small_config
    from pfl.federation.simulator import Simulator

    base = dict(method__name="perfed_ckt", method__architectures=["mlp"], method__public_size=20, method__k=2,
                data__num_clients=7, federation__clients_per_round=0, federation__rounds=2)
    return Simulator(small_config(**{**base, **kw}))


def test_perfed_ckt_builds_each_architecture_with_its_params():
    """An MLP with hidden [7] on d inputs and C classes has d·7 + 7 + 7·C + C parameters."""
    sim = _ckt(method__architectures=[{"name": "mlp", "params": {"hidden": [7]}}, "mlp"])
    d, c = int(np.prod(sim.ctx.meta.input_shape)), sim.ctx.meta.num_classes
    assert sim.method.arch_params[0] == d * 7 + 7 + 7 * c + c
    assert sim.method.arch_params[1] != sim.method.arch_params[0]


def test_perfed_ckt_refuses_an_architecture_entry_with_an_unknown_key():
    from pfl.schema import ConfigError

    with pytest.raises(ConfigError, match="architectures"):
        _ckt(method__architectures=[{"name": "mlp", "size": 3}])


def test_perfed_ckt_cluster_read_outs_by_hand():
    """After one aggregation of hand-made logits in two groups: the stored count, the ARI against the
    architecture assignment (Hubert–Arabie by pair counts) and the cluster sizes."""
    from test_truth_readouts import _ari

    from pfl.federation.messages import Logits, Message

    sim = _ckt(method__architectures=["mlp", "cnn_fpfc"])
    meth = sim.method
    gen = torch.Generator().manual_seed(1)
    groups = [0, 1, 0, 1, 1, 0]
    c = sim.ctx.meta.num_classes
    base = [torch.randn(20, c, generator=gen) * 3 for _ in range(2)]
    z = {cid: base[g] + 0.05 * torch.randn(20, c, generator=gen) for cid, g in enumerate(groups)}
    assert "cluster/ari_arch" not in meth.extra_metrics(0)                 # nothing stored yet
    meth.aggregate(0, {cid: Message.of({"logits": Logits({"logits": z[cid]})}) for cid in z})
    out = meth.extra_metrics(0)
    labels = meth.assign[:6].numpy()
    assert _ari(groups, labels) == pytest.approx(1.0)
    assert out["ckt/stored"] == 6.0 and out["cluster/num"] == 2.0
    assert out["cluster/ari_arch"] == pytest.approx(_ari(np.asarray(meth.arch_of)[:6], labels), abs=1e-12)
    assert (out["cluster/size_max"], out["cluster/size_min"], out["cluster/singletons"]) == (3.0, 3.0, 0.0)


# ---- CFL's split tree --------------------------------------------------------------------------------

def test_cfl_split_tree_gives_every_cluster_a_fresh_id():
    """Two splits in a row (8 clients → 2 → 3 clusters): the tree's node ids, the root's and every
    child's, are all different, so a newcomer walking it from the root never comes back to a node."""
    from helpers import clustered

    from pfl.federation.messages import Message, Update
    from pfl.federation.simulator import Simulator
    from pfl.models.functional import unflatten_params

    sim = Simulator(clustered("label_swap", 2, 8, method__name="cfl", method__start_round=0, method__eps1=10.0,
                              method__eps2=0.5, method__min_size=2, federation__rounds=1))
    meth = sim.method
    names = list(meth.models[0])
    dim = sum(v.numel() for v in meth.models[0].values())
    gen = torch.Generator().manual_seed(0)
    u, w = torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)

    def replies(vectors):
        return {cid: Message.of({"delta": Update(unflatten_params(v.clone(), meth.models[0], names))}, n=5)
                for cid, v in vectors.items()}

    noise = lambda: 0.05 * torch.randn(dim, generator=gen)  # noqa: E731
    meth.aggregate(0, replies({c: (u if c < 4 else -u) + noise() for c in range(8)}))
    assert sorted(map(sorted, meth.clusters)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    meth.aggregate(1, replies({c: (w if c < 2 else -w) + noise() for c in range(4)}))
    assert sorted(map(sorted, meth.clusters)) == [[0, 1], [2, 3], [4, 5, 6, 7]]
    issued = [0] + [child for node in meth.tree.values() for child in node["children"]]
    assert len(issued) == 5 and len(set(issued)) == 5
    assert sorted(meth.cluster_ids) == sorted(set(issued) - set(meth.tree))


# ---- the wire's stage chain ------------------------------------------------------------------------------

def test_a_chain_refuses_stages_that_would_share_their_state():
    """Each stage keeps its state and notes under its key: two stages with one key would overwrite
    each other's, a stage without a key has none."""
    from pfl.federation.wire import Chain, Stage

    def stage(key):
        s = Stage()
        s.key = key
        return s

    assert [s.key for s in Chain([stage("a"), stage("b")]).stages] == ["a", "b"]
    for keys in (["a", "a"], ["a", ""], [""]):
        with pytest.raises(ValueError, match="distinct non-empty keys"):
            Chain([stage(k) for k in keys])
