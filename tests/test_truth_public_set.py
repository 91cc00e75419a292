"""Truth tests of PerFed-CKT's public set (pfl/methods/public_set.py): which rows it holds, from
which source and which data directory, what it says when it is short or overlaps the clients, and
where it lives, each checked against the data read another way (the IDX files the test wrote, the
clients' own rows, the source's declared shape)."""

from __future__ import annotations

import dataclasses
import logging
import shutil

import numpy as np
import pytest
import torch

from helpers import write_mnist_like
from pfl.federation.simulator import Simulator
from pfl.schema import ConfigError

WARN = "pfl.methods.public_set"


def _ckt(**overrides):
    from pfl.resolver import load

    base = {"method.name": "perfed_ckt", "method.architectures": ["softmax_regression"],
            "model.name": "softmax_regression", "data.num_clients": 4, "federation.batch_size": 0,
            "federation.local_steps": 1, "tracking.enabled": False, "seed": 0}
    base.update(overrides)
    return Simulator(load(None, base))


def _rows(x) -> set[bytes]:
    x = x.double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    return {r.tobytes() for r in x.reshape(len(x), -1)}


def _client_rows(sim) -> set[bytes]:
    return set().union(*(_rows(torch.cat([c.x_train, c.x_val, c.x_test])) for c in sim.data.clients))


def _public_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == WARN and r.levelno == logging.WARNING]


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """A small MNIST under ``task/mnist`` (the task's data.params.data_dir is ``task``) and a small,
    different Fashion-MNIST under ``env/fashion-mnist`` ($PFL_DATA_DIR = ``env``, where a source with
    default params looks). The images as the sources scale them: /255, one row per sample."""
    mnist = write_mnist_like(tmp_path / "task" / "mnist", 120, 30, np.random.default_rng(1))
    fmnist = write_mnist_like(tmp_path / "env" / "fashion-mnist", 40, 10, np.random.default_rng(2))
    monkeypatch.setenv("PFL_DATA_DIR", str(tmp_path / "env"))
    scale = lambda a: a.astype(np.float32) / np.float32(255.0)  # noqa: E731
    return {"task": str(tmp_path / "task"), "mnist": scale(mnist), "fmnist": scale(fmnist)}


def _mnist_task(folders, **overrides):
    return _ckt(**{"data.source": "mnist", "data.params": {"data_dir": folders["task"]}, **overrides})


# ---- same_heldout reads the task's own data with the task's own data.params ------------------------

def test_the_held_out_set_comes_from_the_tasks_own_data_directory(folders):
    """mnist read from data.params.data_dir (the default locations hold no MNIST): 40 distinct rows
    of those 150 images, none a client's (clients hold max_samples = 100 of them), overlap 0."""
    sim = _mnist_task(folders, **{"data.max_samples": 100, "method.public_size": 40})
    pub = sim.method.public
    mine, held = _rows(pub.x), _client_rows(sim)
    assert len(held) == 100 and held <= _rows(folders["mnist"])
    assert len(pub) == len(mine) == 40 and mine <= _rows(folders["mnist"]) - held
    assert pub.overlap == 0 and pub.source == "same_heldout" and pub.requested == 40


def test_a_held_out_set_larger_than_the_unused_images_is_those_images_and_names_the_field(folders, caplog):
    """public_size 80 > the 150 − 100 = 50 images no client holds: the set is exactly those 50, and
    the one warning gives both numbers and names method.public_size."""
    with caplog.at_level("WARNING"):
        sim = _mnist_task(folders, **{"data.max_samples": 100, "method.public_size": 80})
    pub = sim.method.public
    free = _rows(folders["mnist"]) - _client_rows(sim)
    assert len(free) == 50 and _rows(pub.x) == free and len(pub) == 50 and pub.requested == 80
    said = _public_warnings(caplog)
    assert len(said) == 1, said
    assert said[0].startswith("public set: only 50 samples of mnist are held by no client")
    assert "using 50 instead of 80" in said[0] and said[0].endswith("(method.public_size)")


# ---- another source: its own default params, its own name, no overlap --------------------------------

def test_another_source_is_read_with_its_default_params_not_the_tasks(folders, caplog):
    """public_source fmnist for the mnist task: fmnist's default location ($PFL_DATA_DIR) is read,
    not the task's data_dir (which holds no Fashion-MNIST). A public_size of exactly its 50 images
    takes all of them, says nothing, overlaps no client, and is named fmnist."""
    with caplog.at_level("WARNING"):
        sim = _mnist_task(folders, **{"method.public_source": "fmnist", "method.public_size": 50})
    pub = sim.method.public
    assert _rows(pub.x) == _rows(folders["fmnist"]) and len(pub) == 50
    assert not (_rows(pub.x) & _client_rows(sim))
    assert pub.overlap == 0 and pub.source == "fmnist" and pub.requested == 50
    assert _public_warnings(caplog) == []


def test_another_source_smaller_than_asked_is_all_of_it_and_says_both_numbers(folders, caplog):
    with caplog.at_level("WARNING"):
        sim = _mnist_task(folders, **{"method.public_source": "fmnist", "method.public_size": 70})
    pub = sim.method.public
    assert _rows(pub.x) == _rows(folders["fmnist"]) and len(pub) == 50 and pub.requested == 70
    assert pub.overlap == 0 and pub.source == "fmnist"
    said = _public_warnings(caplog)
    assert len(said) == 1, said
    assert said[0].startswith("public set: fmnist has only 50 samples") and said[0].endswith("using 50 instead of 70")


def test_another_source_that_is_not_there_is_refused_on_the_field_with_the_reason(folders):
    """cifar100 with no copy anywhere: ConfigError on method.public_source that says the source is
    not available and why (its files were not found)."""
    with pytest.raises(ConfigError) as err:
        _ckt(**{"data.source": "digits", "method.public_source": "cifar100", "method.public_size": 10})
    assert err.value.field == "method.public_source"
    assert "public source 'cifar100' is not available" in str(err.value) and "files not found" in str(err.value)


def test_a_shape_mismatch_names_the_sources_declared_sample_shape(folders):
    """fmnist's samples for the 8×8 digits task: the error gives fmnist's per-sample shape as the
    source declares it, and the task's."""
    from pfl.data import source_spec

    shape = tuple(source_spec("fmnist").shape()[0])
    assert shape == (1, 28, 28)
    with pytest.raises(ConfigError) as err:
        _ckt(**{"data.source": "digits", "method.public_source": "fmnist", "method.public_size": 10})
    assert err.value.field == "method.public_source"
    assert f"has samples of shape {shape}, the task 'digits' needs (64,)" in str(err.value)


# ---- a per-device source: the rows are client data, counted and said --------------------------------

def test_a_per_device_sources_public_rows_are_client_rows_counted_and_said(caplog):
    """fpfc_synthetic at size_scale 0.1 (its own params): every sample is some client's, so the 30
    public rows are 30 distinct client rows, the overlap is 30, and the warning names the metric and
    the one field that helps."""
    with caplog.at_level("WARNING"):
        sim = _ckt(**{"data.source": "fpfc_synthetic", "data.params": {"size_scale": 0.1}, "data.cache": False,
                      "data.num_clients": 6, "method.public_size": 30})
    pub = sim.method.public
    held = _client_rows(sim)
    assert len(pub) == len(_rows(pub.x)) == 30 and _rows(pub.x) <= held and pub.overlap == 30
    said = _public_warnings(caplog)
    assert len(said) == 1, said
    # generated client by client: no data setting frees a sample, only another source does
    assert said[0] == ("public set: every sample of fpfc_synthetic belongs to a client, so the public rows are "
                       "client data (ckt/public_overlap > 0); set method.public_source to another source for a "
                       "disjoint set")


def _writers_table(path, writers: int, rows_each: int) -> np.ndarray:
    """A Parquet file of ``writers`` clients with 4 features; returns its feature rows in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    n = writers * rows_each
    feats = rng.normal(size=(n, 4))
    who = [f"w{i % writers:02d}" for i in rng.permutation(n)]
    pq.write_table(pa.table({"client": who, "label": rng.integers(0, 3, n),
                             **{f"f{j}": feats[:, j] for j in range(4)}}), path)
    return feats


def test_a_source_with_its_own_clients_gives_the_undrawn_clients_rows(tmp_path, caplog):
    """A file of 12 writers, the run drawing 4 of them: the other 8 writers' rows hold no client's
    data, so the public set comes from those (overlap 0, no warning); with every writer drawn there
    is no free row, and the warning says to draw fewer of its 12 clients."""
    path = tmp_path / "writers.parquet"
    feats = _writers_table(path, 12, 10)
    every = _rows(feats.astype(np.float32))  # the files source reads features as float32
    files = {"data.source": "files", "data.params": {"path": str(path)}, "data.cache": False,
             "method.public_size": 20}
    with caplog.at_level("WARNING"):
        sim = _ckt(**files, **{"data.num_clients": 4})
    pub, held = sim.method.public, _client_rows(sim)
    assert len(held) == 40 and held <= every  # the 4 drawn writers' 10 rows each
    assert len(pub) == 20 and _rows(pub.x) <= every - held and pub.overlap == 0
    assert _public_warnings(caplog) == []
    caplog.clear()
    with caplog.at_level("WARNING"):
        sim = _ckt(**files, **{"data.num_clients": 12})
    assert sim.method.public.overlap == 20 and _rows(sim.method.public.x) <= _client_rows(sim)
    said = _public_warnings(caplog)
    assert len(said) == 1 and "set data.num_clients below its 12 clients or method.public_source" in said[0], said


# ---- the partition the clients really hold (cache), the run's device ---------------------------------

def test_the_held_out_set_avoids_the_rows_of_a_cached_partition(tmp_path):
    """A partition cache that differs from what the seed would recompute (seed 1's partition filed
    under seed 0's key) is what the clients hold; the public set must avoid those rows, not the
    recomputed ones."""
    cfg = {"data.source": "digits", "data.num_clients": 6, "data.max_samples": 600, "data.cache": True,
           "method.public_size": 300}
    cache = tmp_path / "cache"
    _ckt(**cfg, seed=0)
    (mine,) = list(cache.glob("*.parquet"))
    _ckt(**cfg, seed=1)
    (other,) = [p for p in cache.glob("*.parquet") if p != mine]
    shutil.copyfile(other, mine)
    planted = _ckt(**cfg, seed=0)
    held = _client_rows(planted)
    assert held == _client_rows(_ckt(**cfg, seed=1))          # the clients hold seed 1's partition
    assert held != _client_rows(_ckt(**{**cfg, "data.cache": False}, seed=0))
    pub = planted.method.public
    assert len(pub) == 300 and not (_rows(pub.x) & held) and pub.overlap == 0


def test_the_public_set_lives_on_the_runs_device():
    from pfl.methods.public_set import build_public_set

    sim = _ckt(**{"data.source": "digits", "data.max_samples": 600, "method.public_size": 20})
    ctx = dataclasses.replace(sim.method.ctx, device=torch.device("meta"))
    pub = build_public_set(ctx, "same_heldout", 20)
    assert pub.x.device.type == "meta" and tuple(pub.x.shape) == (20, 64)
