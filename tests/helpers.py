"""Shared builders for the tests: small configs, the methods and their quick settings, runs to
compare, exact state comparison, small data files. Test modules import from here, never from each
other."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

FMNIST = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


# ---- configs -------------------------------------------------------------------------------------

def _dotted(overrides: dict) -> dict:
    return {k.replace("__", "."): v for k, v in overrides.items()}


def small_config(**overrides):
    """A fast digits experiment; keyword overrides use dotted keys with '__' for '.'."""
    from pfl.resolver import load

    base = {
        "data.source": "digits", "data.num_clients": 10, "data.partition.kind": "dirichlet",
        "data.partition.alpha": 0.5, "federation.rounds": 3, "federation.clients_per_round": 5,
        "federation.batch_size": 32, "federation.lr": 0.1, "federation.local_epochs": 1,
        "tracking.enabled": False,
    }
    base.update(_dotted(overrides))
    return load(None, base)


def quick_settings(name: str) -> dict:
    """The dotted settings a method declares (``Method.quick``, next to its Hparams) so that a
    few-round run on the small config reaches its stateful paths."""
    from pfl.methods import get_method

    return dict(get_method(name).quick)


def method_config(name: str, **overrides):
    """:func:`small_config` for method ``name`` with its quick settings (``overrides`` win)."""
    return small_config(**{"method.name": name, **quick_settings(name), **_dotted(overrides)})


def synthetic_config(**overrides):
    """A small S1-like federation: clustered softmax regression, full-batch GD, 80/20 split."""
    from pfl.resolver import load

    base = {
        "data.source": "fpfc_synthetic", "data.num_clients": 20, "data.val_fraction": 0.0,
        "data.test_fraction": 0.2, "data.params.size_scale": 0.1, "method.name": "fpfc",
        "federation.rounds": 3, "federation.clients_per_round": 6, "federation.batch_size": 0,
        "federation.local_steps": 10, "federation.lr": 0.1, "federation.eval_every": 1000,
        "tracking.enabled": False, "seed": 1,
    }
    base.update(_dotted(overrides))
    return load(None, base)


def clustered(kind, clusters, clients, **kw):
    """A small digits federation with true clusters and a linear model (fast, clusters matter)."""
    base = dict(data__partition__kind=kind, data__partition__num_clusters=clusters, data__num_clients=clients,
                data__partition__alpha=0.0, model__name="softmax_regression", federation__lr=0.5,
                federation__local_epochs=3, federation__clients_per_round=0, federation__threads=1)
    base.update(kw)
    return small_config(**base)


# ---- the methods ---------------------------------------------------------------------------------

def method_names(composed: bool = False, cohort: str | None = None) -> list[str]:
    """Every registered method (sorted); with ``composed``, also every ``base+ala`` that composes;
    with ``cohort``, only the methods that declare it."""
    from pfl.methods import get_method, list_methods
    from pfl.schema import ConfigError

    bases = sorted(m.name for m in list_methods() if "+" not in m.name)
    names = list(bases)
    if composed:
        for base in bases:
            try:
                names.append(get_method(f"{base}+ala").name)
            except (ConfigError, ValueError):
                pass  # no start hook, or already ALA (fedala)
    return [n for n in names if cohort is None or get_method(n).cohort == cohort]


def matrix(names, fast=("fedavg",)) -> list:
    """``names`` as pytest parameters, all but ``fast`` marked slow: an every-method test keeps a
    few representatives in the quick loop and runs the whole matrix in the full suite."""
    return [pytest.param(n, marks=() if n in fast else pytest.mark.slow) for n in names]


# ---- runs ----------------------------------------------------------------------------------------

def straight_and_resumed(cfg, ckpt_dir, stop_at: int = 2, simulator=None):
    """Two finished simulators of ``cfg``: one run straight through, one stopped after round
    ``stop_at``, checkpointed, loaded into a fresh simulator and run to the end."""
    from pfl.callbacks.divergence import run_rounds
    from pfl.federation.checkpoint import load_checkpoint, save_checkpoint

    if simulator is None:
        from pfl.federation.simulator import Simulator as simulator

    straight = simulator(cfg)
    run_rounds(straight)
    first = simulator(cfg)
    run_rounds(first, until=stop_at)
    save_checkpoint(first, ckpt_dir / "ckpt.pt")
    resumed = simulator(cfg)
    load_checkpoint(resumed, ckpt_dir / "ckpt.pt")
    assert resumed.round == stop_at
    run_rounds(resumed)
    return straight, resumed


def downlink(sim, cid: int, rnd: int = 0):
    """Client ``cid``'s training downlink of round ``rnd`` as delivered (the first half of a trip)."""
    from pfl.federation.wire import Phase

    return sim.exchange.send(Phase("train", rnd), cid, sim.method.broadcast(rnd, cid))


def uplink(sim, cid: int, down, rnd: int = 0):
    """Client ``cid``'s delivered training reply to the delivered ``down`` (the second half)."""
    from pfl.federation.wire import Phase

    return sim.exchange.complete(Phase("train", rnd), {cid: down}, sim.training_side(rnd))[cid].reply


def untimed(history):
    """A run's metrics without the measured durations."""
    return [{k: v for k, v in row.items() if "time" not in k} for row in history]


def same(a, b, where="state") -> None:
    """Exact equality of two encoded states (tensors bit for bit; measured durations skipped)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        equal = torch.equal(a, b) if not a.is_floating_point() else bool(((a == b) | (a.isnan() & b.isnan())).all())
        assert equal, where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            if "time" not in str(k) and "seconds" not in str(k):  # measured durations differ between runs
                same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, (where, a, b)


# ---- data files ----------------------------------------------------------------------------------

def write_mnist_like(folder: Path, n_train: int, n_test: int, rng, gz: bool = True) -> np.ndarray:
    """Random 28×28 images in the four IDX files of MNIST's layout; returns every image."""
    from pfl.data.idx import write_idx

    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    images = []
    for part, n in (("train", n_train), ("t10k", n_test)):
        x = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        y = (np.arange(n) % 10).astype(np.uint8)
        write_idx(folder / f"{part}-images-idx3-ubyte{suffix}", x)
        write_idx(folder / f"{part}-labels-idx1-ubyte{suffix}", y)
        images.append(x)
    return np.concatenate(images)


def models_equal(a, b, atol: float = 0.0) -> bool:
    """Two parameter dicts equal tensor by tensor (bit for bit, or within ``atol``)."""
    return all((torch.equal(a[k], b[k]) if atol == 0 else torch.allclose(a[k], b[k], atol=atol)) for k in a)


def client_gradients(sim, params, batch_size: int = 0) -> dict:
    """Every client's gradient of its mean training loss at ``params`` (its whole split by default)."""
    from pfl.training import batch_gradient

    out = {}
    for cid in range(sim.num_clients):
        client = sim.client(cid)
        d = client.data
        out[cid], _ = batch_gradient(client.model, params, d.x_train, d.y_train, task=sim.ctx.meta.task,
                                     batch_size=batch_size)
    return out
