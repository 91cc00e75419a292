"""Independent truths for the methods' tests (tests/test_truth_*.py).

A method test here runs the method's own class in the simulator and compares what it computed with
something that does not call pfl's training or method code: the closed-form optimum or fixed point
of a small least-squares federation, or the same algorithm written again in numpy (float64). The
only things read from the simulator are its inputs (the data, the seeded initial model); the
expected values are built here.

The federation: ``m`` clients, each with a few samples (x ∈ R^d, y = x·β_c + noise) and the
``linear_regression`` model (weight 1×d, bias), so a parameter vector is [weight, bias] ∈ R^{d+1}
and a client's loss f_i(w) = mean((x̃·w − y)²) with x̃ = [x, 1] is the quadratic ½wᵀA_i w − b_iᵀw + c
with A_i = (2/n_i)X̃ᵀX̃ and b_i = (2/n_i)X̃ᵀy. Full-batch steps (``federation.batch_size: 0``) make
every local step w ← w − η(A_i w − b_i) exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pfl.federation.wire import Stage

WEIGHT, BIAS = "fc.weight", "fc.bias"


# ---- the data -----------------------------------------------------------------------------------

@dataclass
class LeastSquares:
    """Per-client design matrices (with the bias column) and targets, float64."""
    X: list[np.ndarray]   # (n_i, d) inputs without the bias column
    y: list[np.ndarray]   # (n_i,)
    clusters: np.ndarray  # true cluster id per client

    @property
    def m(self) -> int:
        return len(self.X)

    @property
    def dim(self) -> int:
        return self.X[0].shape[1] + 1

    def design(self, i: int) -> np.ndarray:
        return np.hstack([self.X[i], np.ones((len(self.X[i]), 1))])

    def n(self, i: int) -> int:
        return len(self.y[i])

    def A(self, i: int) -> np.ndarray:
        Z = self.design(i)
        return 2.0 / len(Z) * Z.T @ Z

    def b(self, i: int) -> np.ndarray:
        Z = self.design(i)
        return 2.0 / len(Z) * Z.T @ self.y[i]

    def grad(self, i: int, w: np.ndarray) -> np.ndarray:
        return self.A(i) @ w - self.b(i)

    def loss(self, i: int, w: np.ndarray) -> float:
        r = self.design(i) @ w - self.y[i]
        return float(np.mean(r * r))

    def local_opt(self, i: int) -> np.ndarray:
        return np.linalg.solve(self.A(i), self.b(i))

    def joint_opt(self, clients, weights=None) -> np.ndarray:
        """argmin Σ_i p_i f_i (p_i = 1 when ``weights`` is None)."""
        weights = np.ones(len(clients)) if weights is None else np.asarray(weights, dtype=float)
        A = sum(p * self.A(i) for p, i in zip(weights, clients))
        b = sum(p * self.b(i) for p, i in zip(weights, clients))
        return np.linalg.solve(A, b)

    def gd(self, i: int, w: np.ndarray, steps: int, lr: float, pull: tuple[float, np.ndarray] | None = None,
           shift: np.ndarray | None = None) -> np.ndarray:
        """``steps`` full-batch steps on f_i (+ (μ/2)‖w − anchor‖² for ``pull`` = (μ, anchor); + ⟨shift, w⟩)."""
        w = np.array(w, dtype=float)
        for _ in range(steps):
            g = self.grad(i, w)
            if pull is not None:
                g = g + pull[0] * (w - pull[1])
            if shift is not None:
                g = g + shift
            w = w - lr * g
        return w

    def federated(self):
        """The clients as pfl's FederatedData (train = val = test split, float32)."""
        from pfl.data.federated import ClientData, FederatedData

        clients = []
        for X, y, c in zip(self.X, self.y, self.clusters):
            xt, yt = torch.tensor(X, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
            clients.append(ClientData(xt, yt, xt.clone(), yt.clone(), xt.clone(), yt.clone(), cluster=int(c)))
        return FederatedData(clients=clients, num_classes=0, input_shape=(self.X[0].shape[1],),
                             task="regression", source="fpfc_linear", true_clusters=np.asarray(self.clusters),
                             partition_hash="truth", partition_kind="natural")


def least_squares(sizes=(20, 30, 24, 27), d=2, clusters=None, betas=None, noise=0.3, seed=0,
                  scales=None) -> LeastSquares:
    """Clients with ``sizes`` samples; client i's targets follow β of its cluster (default: one
    cluster, β = [1, −2, ...]) plus Gaussian noise; ``scales`` stretches each client's inputs."""
    rs = np.random.RandomState(seed)
    m = len(sizes)
    clusters = np.zeros(m, dtype=int) if clusters is None else np.asarray(clusters)
    if betas is None:
        betas = [np.array([1.0, -2.0, 0.5, 3.0][:d]) + 4.0 * k for k in range(int(clusters.max()) + 1)]
    X, Y = [], []
    for i, n in enumerate(sizes):
        x = rs.normal(0.0, 1.0, (n, d)) * (1.0 if scales is None else scales[i])
        X.append(x)
        Y.append(x @ np.asarray(betas[clusters[i]]) + 0.5 * clusters[i] + noise * rs.normal(size=n))
    return LeastSquares(X, Y, clusters)


# ---- configs and parameter vectors --------------------------------------------------------------

def config(method: str, num_clients: int, *, steps: int = 3, lr: float = 0.05, rounds: int = 1,
           per_round: int = 0, model: str = "linear_regression", source: str = "fpfc_linear", **overrides):
    """A config for the federations here: full-batch steps, every client every round by default."""
    from pfl.resolver import load

    base = {"method.name": method, "data.source": source, "data.num_clients": num_clients,
            "model.name": model, "federation.rounds": rounds, "federation.clients_per_round": per_round,
            "federation.batch_size": 0, "federation.local_steps": steps, "federation.lr": lr,
            "federation.eval_every": 10_000, "tracking.enabled": False, "data.cache": False}
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load(None, base)


def simulator(problem: LeastSquares, method: str, **kw):
    from pfl.federation.simulator import Simulator

    return Simulator(config(method, problem.m, **kw), data=problem.federated())


def vec(params) -> np.ndarray:
    """[weight, bias] of a linear-regression parameter dict as one float64 vector."""
    return np.concatenate([params[WEIGHT].detach().double().cpu().numpy().ravel(),
                           params[BIAS].detach().double().cpu().numpy().ravel()])


def params_of(w: np.ndarray, like) -> dict[str, torch.Tensor]:
    d = like[WEIGHT].numel()
    return {WEIGHT: torch.tensor(w[:d], dtype=torch.float32).reshape(like[WEIGHT].shape),
            BIAS: torch.tensor(w[d:], dtype=torch.float32).reshape(like[BIAS].shape)}


def run_rounds(sim, rounds: int) -> None:
    for _ in range(rounds):
        sim.run_round(evaluate=False)


def affine_fixed_point(step, dim: int) -> np.ndarray:
    """The fixed point of an affine map ``step(θ) = Mθ + c`` given as a function (numpy)."""
    c = step(np.zeros(dim))
    M = np.column_stack([step(e) - c for e in np.eye(dim)])
    return np.linalg.solve(np.eye(dim) - M, c)


def close(a: np.ndarray, b: np.ndarray, tol: float = 1e-5) -> bool:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) <= tol * max(1.0, float(np.max(np.abs(b))))


# ---- clusters: pair norms set by hand, components found by a search ------------------------------

def set_pair_norms(meth, norms, far: float = 2.0) -> np.ndarray:
    """FPFC's θ_ij = (s_ij, 0, …) for i < j and −θ_ji, so ‖θ_ij‖ = s_ij exactly; ``norms`` an (m, m)
    matrix (its upper triangle is read) or {(i, j): s_ij} with every other pair at ``far``. Returns s."""
    m, dim = meth.theta.shape[0], meth.theta.shape[2]
    if isinstance(norms, dict):
        s = np.full((m, m), far)
        np.fill_diagonal(s, 0.0)
        for (i, j), value in norms.items():
            s[i, j] = s[j, i] = value
    else:
        s = np.asarray(norms, dtype=float)
    theta = np.zeros((m, m, dim))
    theta[:, :, 0] = np.triu(s, 1) - np.triu(s, 1).T
    meth.theta.copy_(torch.tensor(theta, dtype=meth.theta.dtype))
    return s


def components(linked) -> np.ndarray:
    """The connected components of the graph with an edge where ``linked[i][j]`` or ``linked[j][i]``,
    by a depth-first search: labels 0, 1, … in order of first appearance."""
    linked = np.asarray(linked, dtype=bool)
    m = len(linked)
    labels, count = np.full(m, -1), 0
    for start in range(m):
        if labels[start] >= 0:
            continue
        labels[start], stack = count, [start]
        while stack:
            i = stack.pop()
            for j in np.flatnonzero((linked[i] | linked[:, i]) & (labels < 0)):
                labels[j] = count
                stack.append(int(j))
        count += 1
    return labels


def same_partition(a, b) -> bool:
    """Two labellings of the same items (sequences, or dicts over the same keys) group them alike."""
    if isinstance(a, dict):
        keys = sorted(a)
        a, b = [a[k] for k in keys], [b[k] for k in keys]
    groups = lambda lab: {frozenset(np.flatnonzero(np.asarray(lab) == k).tolist()) for k in set(lab)}  # noqa: E731
    return groups(list(a)) == groups(list(b))


# ---- CUDA's device rules, checked where no GPU is ------------------------------------------------

class CudaDeviceRules(torch.overrides.TorchFunctionMode):
    """What CUDA refuses and ``meta`` lets through, refused on any device: index_select / index_copy
    with an index on another device, and an indexed assignment of a value tensor (not a 0-d scalar)
    from another device. A server moved to ``meta`` stands in for one on a GPU: an index or value
    made without the server's device lands on the CPU."""

    ops = {torch.index_select, torch.Tensor.index_select, torch.Tensor.index_copy_, torch.Tensor.index_copy}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.ops:
            devices = {a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)}
            assert len(devices) == 1, f"{func.__name__} across devices {devices}"
        if func is torch.Tensor.__setitem__:
            target, value = args[0], args[2]
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.device == target.device, f"assigning a {value.device} value into {target.device}"
        return func(*args, **kwargs)


# ---- a small classifier written out in numpy ----------------------------------------------------

def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def mlp_forward(p: dict[str, np.ndarray], X: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Logits of pfl's ``mlp`` with one hidden ReLU layer (fc1, fc) or none (fc only)."""
    if "fc1.weight" in p:
        h = np.maximum(X @ p["fc1.weight"].T + p["fc1.bias"], 0.0)
        return h @ p["fc.weight"].T + p["fc.bias"], h
    return X @ p["fc.weight"].T + p["fc.bias"], None


def mlp_grads(p: dict[str, np.ndarray], X: np.ndarray, y: np.ndarray,
              dlogits_extra: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Gradients of the mean cross-entropy (plus a given extra gradient w.r.t. the logits), by hand."""
    z, h = mlp_forward(p, X)
    dz = softmax(z)
    dz[np.arange(len(y)), y] -= 1.0
    dz /= len(y)
    if dlogits_extra is not None:
        dz = dz + dlogits_extra
    inp = X if h is None else h
    g = {"fc.weight": dz.T @ inp, "fc.bias": dz.sum(0)}
    if h is not None:
        dh = (dz @ p["fc.weight"]) * (h > 0)
        g["fc1.weight"] = dh.T @ X
        g["fc1.bias"] = dh.sum(0)
    return g


def numpy_params(params) -> dict[str, np.ndarray]:
    return {k: v.detach().double().cpu().numpy().copy() for k, v in params.items()}


def classification_data(sizes=(12, 15, 10, 14), d=4, classes=3, seed=0, missing=None):
    """A pfl FederatedData of Gaussian class blobs (classes shifted per client), and its numpy arrays;
    ``missing``: {client: class} a client does not hold (relabelled to the next class)."""
    from pfl.data.federated import ClientData, FederatedData

    rs = np.random.RandomState(seed)
    means = rs.normal(0.0, 2.0, (classes, d))
    arrays, clients = [], []
    for i, n in enumerate(sizes):
        y = rs.randint(0, classes, n)
        y[:classes] = np.arange(classes)  # every client holds every class
        if missing and i in missing:
            y[y == missing[i]] = (missing[i] + 1) % classes
        x = means[(y + i) % classes] + rs.normal(0.0, 1.0, (n, d))
        arrays.append((x, y))
        xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)
        clients.append(ClientData(xt, yt, xt.clone(), yt.clone(), xt.clone(), yt.clone(), cluster=i % 2))
    data = FederatedData(clients=clients, num_classes=classes, input_shape=(d,), task="classification",
                         source="digits", true_clusters=np.arange(len(sizes)) % 2, partition_hash="truth",
                         partition_kind="natural")
    return data, arrays


class Recorder(Stage):
    """The delivered training uploads, as they came off the wire (as the run's last stage, its
    receiving side runs first: what the client sent)."""
    key = "recorder"

    def __init__(self):
        self.up: dict[tuple[int, int], object] = {}

    def receive_up(self, phase, cid, msg, sent):
        if phase.kind == "train":
            self.up[phase.rnd, cid] = msg.copy()
        return msg
