"""Tests of pfl.data: sources, partitioners, stratified splits, transforms, cache, config errors.

Everything runs on scikit-learn's bundled digits, the FPFC generators, or small files in the real
formats written here into tmp_path; nothing is downloaded.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import write_mnist_like
from pfl.config import DataConfig
from pfl.data import (ClientData, FederatedData, list_sources, load_federated, resolve_data_config,
                      source_spec)
from pfl.data import cache as cache_mod
from pfl.data import partition as partition_mod
from pfl.data.idx import read_idx, write_idx
from pfl.data.partition import dirichlet_split, rng_for, stratified_split
from pfl.data.synthetic import FPFCSyntheticParams, generate_fpfc_synthetic
from pfl.data.transforms import rotate_images, rotate_resampled, shift_labels, swap_labels
from pfl.schema import ConfigError, from_dict


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Every test gets its own partition cache and no inherited data directory."""
    monkeypatch.setenv("PFL_CACHE_DIR", str(tmp_path / "partitions"))
    monkeypatch.delenv("PFL_DATA_DIR", raising=False)


def make_cfg(**data) -> DataConfig:
    return from_dict(DataConfig, data, "data")


def sizes_of(fed: FederatedData) -> np.ndarray:
    return np.array([c.n_train + len(c.y_val) + len(c.y_test) for c in fed.clients])


def all_labels(c: ClientData) -> torch.Tensor:
    return torch.cat([c.y_train, c.y_val, c.y_test])


def label_shares(fed: FederatedData) -> np.ndarray:
    counts = np.array([torch.bincount(all_labels(c), minlength=fed.num_classes).numpy() for c in fed.clients])
    return counts / counts.sum(axis=1, keepdims=True)


# ------------------------------------------------------------------------------------------------
# registry and config validation

def test_registry_lists_every_source_with_defaults():
    names = [s.name for s in list_sources()]
    assert names[:7] == ["digits", "fmnist", "mnist", "cifar10", "cifar100", "fpfc_synthetic", "fpfc_linear"]
    assert "files" in names  # a user's own data (tests/test_files_data.py)
    assert source_spec("fpfc_synthetic").default_model == "softmax_regression"
    assert source_spec("fpfc_synthetic").shape({}) == ((60,), 10)
    assert source_spec("fpfc_linear").shape({"num_features": 5}) == ((5,), 0)
    assert source_spec("fpfc_linear").task == "regression"
    assert source_spec("cifar100").shape({}) == ((3, 32, 32), 100)
    assert source_spec("digits").default_model == "mlp"
    assert source_spec("mnist").default_model == "cnn_fpfc"


def test_resolve_fills_params_and_auto_kind():
    cfg = make_cfg(source="fpfc_synthetic", num_clients=8, params={"num_classes": 5})
    resolve_data_config(cfg)
    assert cfg.partition.kind == "natural"
    assert cfg.params == {"num_features": 60, "num_classes": 5, "num_clusters": 4, "noise_std": 0.5,
                          "gen_seed": 0, "size_scale": 1.0}
    cfg = make_cfg(source="digits")
    resolve_data_config(cfg)
    assert cfg.partition.kind == "dirichlet" and cfg.params == {}
    resolve_data_config(cfg)  # idempotent


@pytest.mark.parametrize("data, field, words", [
    ({"source": "digitz"}, "data.source", ["digits", "fpfc_synthetic", "cifar10", "did you mean"]),
    ({"source": "fpfc_synthetic", "params": {"num_feature": 3}}, "data.params.num_feature", ["num_features"]),
    ({"source": "fpfc_synthetic", "params": {"noise_std": -1}}, "data.params.noise_std", ["range"]),
    ({"source": "digits", "partition": {"kind": "natural"}}, "data.partition.kind",
     ["fpfc_synthetic", "dirichlet", "shards"]),
    ({"source": "fpfc_synthetic", "partition": {"kind": "dirichlet"}}, "data.partition.kind", ["natural"]),
    ({"source": "digits", "partition": {"kind": "shards", "classes_per_client": 11}},
     "data.partition.classes_per_client", ["10 classes"]),
    ({"source": "digits", "partition": {"kind": "label_swap", "num_clusters": 6}},
     "data.partition.num_clusters", ["2*num_clusters", "<= 5"]),
    ({"source": "digits", "num_clients": 12, "partition": {"kind": "label_shift", "num_clusters": 11}},
     "data.partition.num_clusters", ["label_shift", "<= 10"]),
    ({"source": "digits", "num_clients": 3, "partition": {"kind": "rotation", "num_clusters": 4}},
     "data.partition.num_clusters", ["data.num_clients"]),
    ({"source": "digits", "partition": {"kind": "dirichlet", "alpha": 0.0}}, "data.partition.alpha", ["> 0"]),
    ({"source": "digits", "num_clients": 50, "max_samples": 100}, "data.max_samples", ["500"]),
    ({"source": "fpfc_synthetic", "max_samples": 100}, "data.max_samples", ["size_scale"]),
    ({"source": "fpfc_linear", "num_clients": 2, "params": {"num_clusters": 3}}, "data.params.num_clusters", []),
])
def test_config_errors_name_the_field(data, field, words):
    with pytest.raises(ConfigError) as info:
        resolve_data_config(make_cfg(**data))
    assert info.value.field == field
    for word in words:
        assert word in str(info.value)


def test_load_rejects_too_many_clients_for_the_pool():
    with pytest.raises(ConfigError) as info:
        load_federated(make_cfg(source="digits", num_clients=200), seed=0)
    assert info.value.field == "data.num_clients"


# ------------------------------------------------------------------------------------------------
# FPFC generators

def test_fpfc_synthetic_reproduces_paper_sizes():
    start = time.perf_counter()
    fed = load_federated(make_cfg(source="fpfc_synthetic", num_clients=100, cache=False), seed=0)
    elapsed = time.perf_counter() - start
    sizes = sizes_of(fed)
    assert sizes.min() == 250 and sizes.max() == 25810 and sizes.sum() == 205795
    assert np.median(sizes) == 577.5
    assert elapsed < 10, f"generating the synthetic data took {elapsed:.1f}s"
    clusters = fed.true_clusters
    assert clusters.tolist() == [i // 25 for i in range(100)]
    assert [int(sizes[clusters == k].sum()) for k in range(4)] == [99000, 40990, 15520, 50285]
    assert [c.cluster for c in fed.clients] == clusters.tolist()
    assert fed.input_shape == (60,) and fed.num_classes == 10 and fed.task == "classification"
    c = fed.clients[0]
    assert c.x_train.dtype == torch.float32 and c.y_train.dtype == torch.int64
    assert float(c.x_train.min()) >= 0 and float(c.x_train.max()) < 1


def test_fpfc_synthetic_matches_a_per_sample_reference():
    """The vectorised generator consumes the legacy RNG stream exactly like a per-sample loop."""
    m, k, d, classes = 4, 2, 7, 5
    p = FPFCSyntheticParams(num_features=d, num_classes=classes, num_clusters=k, size_scale=0.05)
    gen = generate_fpfc_synthetic(p, m)
    rs = np.random.RandomState(0)
    sizes = np.maximum(10, np.round((rs.lognormal(4, 2, m).astype(int) + 50) * 5 * 0.05).astype(int))
    centres = rs.normal(0, 1, k)
    params = [(rs.normal(centres[j], 1, (classes, d)).astype(np.float32),
               rs.normal(centres[j], 1, (1, classes)).astype(np.float32)) for j in range(k)]
    ys = []
    for i in range(m):
        w, b = params[i * k // m]
        xs = rs.random_sample((sizes[i], d))
        for j in range(sizes[i]):
            score = xs[j] @ w.T + b + rs.normal(0, 0.5, classes).astype(np.float32)
            ys.append(int(np.argmax(score)))
    assert gen.sizes.tolist() == sizes.tolist()
    assert gen.y.tolist() == ys


def test_fpfc_linear_is_clustered_regression():
    cfg = make_cfg(source="fpfc_linear", num_clients=8, val_fraction=0.0, test_fraction=0.25,
                   params={"num_features": 3, "num_clusters": 2, "noise_std": 0.1, "samples_per_device": 100})
    fed = load_federated(cfg, seed=0)
    assert fed.task == "regression" and fed.num_classes == 0 and fed.input_shape == (3,)
    assert fed.true_clusters.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    betas = []
    for c in fed.clients:
        assert c.y_train.dtype == torch.float32 and c.n_train == 75 and len(c.y_test) == 25
        beta = torch.linalg.lstsq(c.x_train.double(), c.y_train.double()[:, None]).solution[:, 0]
        residual = c.y_train.double() - c.x_train.double() @ beta
        assert float(residual.std()) < 0.15
        betas.append(beta)
    assert torch.allclose(betas[0], betas[3], atol=0.1)
    assert float((betas[0] - betas[4]).norm()) > 0.5


# ------------------------------------------------------------------------------------------------
# partitioners

def test_dirichlet_smaller_alpha_concentrates_labels():
    def mean_max_share(alpha):
        fed = load_federated(make_cfg(source="digits", num_clients=20, partition={"alpha": alpha}), seed=1)
        return label_shares(fed).max(axis=1).mean()
    concentrated, spread = mean_max_share(0.1), mean_max_share(10.0)
    assert concentrated > spread + 0.3, (concentrated, spread)
    assert spread < 0.25


def test_dirichlet_tiny_alpha_many_clients_is_fast_and_repaired():
    start = time.perf_counter()
    cfg = make_cfg(source="digits", num_clients=100,
                   partition={"kind": "dirichlet", "alpha": 0.01, "min_samples": 10})
    fed = load_federated(cfg, seed=0)
    assert time.perf_counter() - start < 5
    assert sizes_of(fed).min() >= 10 and sizes_of(fed).sum() == 1797


def test_dirichlet_split_unit():
    labels = np.repeat(np.arange(10), 100)
    parts = dirichlet_split(labels, 100, 0.01, 10, rng_for(0, "t"))
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    assert all(len(p) == 10 for p in parts)  # exactly the minimum: the pool is just large enough


def test_shards_limit_labels_per_client():
    for clients, per_client in ((20, 2), (50, 3), (3, 2)):
        cfg = make_cfg(source="digits", num_clients=clients,
                       partition={"kind": "shards", "classes_per_client": per_client})
        fed = load_federated(cfg, seed=2)
        present = (label_shares(fed) > 0).sum(axis=1)
        assert present.max() <= per_client and present.min() >= 1
        # fewer shards than classes: the classes no client can hold are left out
        used_classes = min(10, clients * per_client)
        assert len(np.unique(torch.cat([all_labels(c) for c in fed.clients]))) == used_classes


def test_iid_has_near_uniform_labels_and_equal_sizes():
    fed = load_federated(make_cfg(source="digits", num_clients=5, partition={"kind": "iid"}), seed=0)
    sizes = sizes_of(fed)
    assert sizes.max() - sizes.min() <= 1
    assert np.abs(label_shares(fed) - 0.1).max() < 0.06


def test_power_law_sizes_are_skewed():
    fed = load_federated(make_cfg(source="digits", num_clients=50,
                                  partition={"kind": "iid", "sizes": "power_law", "power": 1.5}), seed=0)
    sizes = sizes_of(fed)
    assert sizes.min() >= 10 and sizes.sum() == 1797
    assert sizes.max() >= 3 * sizes.min()
    assert sizes.std() / sizes.mean() > 0.3


def test_max_samples_takes_a_stratified_subset():
    fed = load_federated(make_cfg(source="digits", num_clients=5, max_samples=500, partition={"kind": "iid"}),
                         seed=0)
    counts = sum(torch.bincount(all_labels(c), minlength=10) for c in fed.clients)
    assert int(counts.sum()) == 500
    assert counts.min() >= 48 and counts.max() <= 52


def test_same_seed_same_partition_other_seed_differs():
    a = load_federated(make_cfg(source="digits", num_clients=10, cache=False), seed=3)
    torch.manual_seed(123)  # the partition must not depend on torch's global RNG
    b = load_federated(make_cfg(source="digits", num_clients=10, cache=False), seed=3)
    c = load_federated(make_cfg(source="digits", num_clients=10, cache=False), seed=4)
    assert all(torch.equal(x.x_train, y.x_train) for x, y in zip(a.clients, b.clients))
    assert [x.y_train.tolist() for x in a.clients] != [x.y_train.tolist() for x in c.clients]


# ------------------------------------------------------------------------------------------------
# cluster transforms

def test_label_swap_mapping_and_contiguous_clusters():
    base = load_federated(make_cfg(source="digits", num_clients=8, partition={"kind": "dirichlet", "alpha": 1.0}),
                          seed=5)
    swap = load_federated(make_cfg(source="digits", num_clients=8,
                                   partition={"kind": "label_swap", "alpha": 1.0, "num_clusters": 4}), seed=5)
    assert swap.true_clusters.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert base.true_clusters is None and base.clients[0].cluster is None
    pairs = {0: (0, 8), 1: (1, 7), 2: (2, 6), 3: (3, 5)}
    for b, s in zip(base.clients, swap.clients):
        lo, hi = pairs[s.cluster]
        for split in ("train", "val", "test"):
            yb, ys = getattr(b, f"y_{split}"), getattr(s, f"y_{split}")
            expected = yb.clone()
            expected[yb == lo], expected[yb == hi] = hi, lo
            assert torch.equal(ys, expected)
            assert torch.equal(getattr(b, f"x_{split}"), getattr(s, f"x_{split}"))


def test_label_shift_moves_every_label_by_the_cluster_id():
    base = load_federated(make_cfg(source="digits", num_clients=6, partition={"kind": "iid"}), seed=2)
    shift = load_federated(make_cfg(source="digits", num_clients=6,
                                    partition={"kind": "label_shift", "alpha": 0.0, "num_clusters": 3}), seed=2)
    assert shift.true_clusters.tolist() == [0, 0, 1, 1, 2, 2]
    for b, s in zip(base.clients, shift.clients):
        for split in ("train", "val", "test"):
            yb, ys = getattr(b, f"y_{split}"), getattr(s, f"y_{split}")
            assert torch.equal(ys, (yb + s.cluster) % 10)
            assert torch.equal(getattr(b, f"x_{split}"), getattr(s, f"x_{split}"))
    assert shift_labels(np.arange(10), 3, 10).tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2]


def test_swap_labels_unit():
    y = np.arange(10)
    assert swap_labels(y, 0, 10).tolist() == [8, 1, 2, 3, 4, 5, 6, 7, 0, 9]
    assert swap_labels(y, 3, 10).tolist() == [0, 1, 2, 5, 4, 3, 6, 7, 8, 9]


def test_rotation_rotates_images_per_cluster():
    base = load_federated(make_cfg(source="digits", num_clients=8, partition={"kind": "iid"}), seed=6)
    rot = load_federated(make_cfg(source="digits", num_clients=8,
                                  partition={"kind": "rotation", "alpha": 0.0, "num_clusters": 4}), seed=6)
    assert rot.true_clusters.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    for b, r in zip(base.clients, rot.clients):
        assert torch.equal(b.y_train, r.y_train)
        expected = torch.rot90(b.x_test.view(-1, 8, 8), r.cluster, dims=(-2, -1)).reshape(-1, 64)
        assert torch.equal(r.x_test, expected)
    assert not torch.equal(base.clients[2].x_train, rot.clients[2].x_train)


def test_general_rotation_agrees_with_rot90_and_runs_for_three_clusters():
    img = torch.rand(2, 3, 10, 10)
    assert torch.allclose(rotate_resampled(img, 90.0), torch.rot90(img, 1, dims=(-2, -1)), atol=1e-5)
    assert torch.equal(rotate_images(img, 180.0), torch.rot90(img, 2, dims=(-2, -1)))
    fed = load_federated(make_cfg(source="digits", num_clients=6,
                                  partition={"kind": "rotation", "num_clusters": 3}), seed=0)
    assert fed.clients[5].x_train.shape[1:] == (64,)
    assert fed.true_clusters.tolist() == [0, 0, 1, 1, 2, 2]


# ------------------------------------------------------------------------------------------------
# stratified splits

def test_client_splits_share_label_ratios():
    fed = load_federated(make_cfg(source="digits", num_clients=10, val_fraction=0.1, test_fraction=0.2,
                                  partition={"kind": "dirichlet", "alpha": 1.0}), seed=7)
    for c in fed.clients:
        n = c.n_train + len(c.y_val) + len(c.y_test)
        assert len(c.y_test) == round(0.2 * n) and len(c.y_val) == round(0.1 * n)
        p_train = torch.bincount(c.y_train, minlength=10).numpy() / c.n_train
        for split in (c.y_val, c.y_test):
            p = torch.bincount(split, minlength=10).numpy() / len(split)
            assert np.all(np.abs(p_train - p) <= 1.0 / len(split) + 2.0 / c.n_train + 1e-9)


def test_stratified_split_keeps_rare_classes_in_train():
    labels = np.array([0] * 20 + [1] + [2, 2])
    train, val, test = stratified_split(labels, len(labels), 0.2, 0.1, rng_for(0, "s"))
    assert sorted(np.concatenate([train, val, test]).tolist()) == list(range(len(labels)))
    assert 20 in train  # the only sample of class 1 is used for training
    assert set(labels[train]) == {0, 1, 2}
    assert len(test) == round(0.2 * len(labels)) and len(val) == round(0.1 * len(labels))
    tiny_train, _, tiny_test = stratified_split(np.array([0, 1]), 2, 0.2, 0.0, rng_for(0, "s"))
    assert len(tiny_train) == 1 and len(tiny_test) == 1


# ------------------------------------------------------------------------------------------------
# cache

def test_cache_round_trip(tmp_path, monkeypatch):
    cfg = make_cfg(source="digits", num_clients=6, partition={"kind": "label_swap", "num_clusters": 3})
    first = load_federated(cfg, seed=9)
    path = tmp_path / "partitions" / f"{first.partition_hash}.parquet"
    assert path.is_file()

    def no_partitioning(*args, **kwargs):
        raise AssertionError("the cached partition should have been used")
    monkeypatch.setattr("pfl.data.federated.make_partition", no_partitioning)
    second = load_federated(make_cfg(source="digits", num_clients=6,
                                     partition={"kind": "label_swap", "num_clusters": 3}), seed=9)
    assert second.partition_hash == first.partition_hash
    assert second.true_clusters.tolist() == first.true_clusters.tolist()
    for a, b in zip(first.clients, second.clients):
        for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
            assert torch.equal(getattr(a, name), getattr(b, name))
        assert a.cluster == b.cluster


def test_cache_key_and_disabled_cache(tmp_path):
    a = make_cfg(source="digits", num_clients=4)
    b = make_cfg(source="digits", num_clients=4, cache=False)
    resolve_data_config(a)
    resolve_data_config(b)
    assert cache_mod.partition_key(a, 0) == cache_mod.partition_key(b, 0)  # `cache` is not part of the key
    assert cache_mod.partition_key(a, 0) != cache_mod.partition_key(a, 1)
    load_federated(b, seed=0)
    assert not (tmp_path / "partitions").exists()


def test_cache_for_generated_devices(tmp_path):
    cfg = dict(source="fpfc_synthetic", num_clients=8, params={"size_scale": 0.05})
    first = load_federated(make_cfg(**cfg), seed=0)
    assert (tmp_path / "partitions" / f"{first.partition_hash}.parquet").is_file()
    second = load_federated(make_cfg(**cfg), seed=0)
    assert all(torch.equal(a.x_test, b.x_test) for a, b in zip(first.clients, second.clients))


def test_stale_cache_is_ignored(tmp_path):
    cfg = make_cfg(source="digits", num_clients=4)
    first = load_federated(cfg, seed=0)
    path = tmp_path / "partitions" / f"{first.partition_hash}.parquet"
    path.write_bytes(b"not parquet")
    again = load_federated(make_cfg(source="digits", num_clients=4), seed=0)
    assert torch.equal(first.clients[0].x_train, again.clients[0].x_train)


# ------------------------------------------------------------------------------------------------
# file formats

def test_idx_round_trip(tmp_path):
    for name, arr in (("a.gz", np.arange(24, dtype=np.uint8).reshape(2, 3, 4)),
                      ("b", np.array([1.5, -2.0], dtype=np.float32)),
                      ("c.gz", np.array([[7, -9]], dtype=np.int32))):
        write_idx(tmp_path / name, arr)
        back = read_idx(tmp_path / name)
        assert back.dtype == arr.dtype and np.array_equal(back, arr)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError):
        read_idx(tmp_path / "bad")


def pooled_pixel_sums(fed: FederatedData) -> np.ndarray:
    x = torch.cat([torch.cat([c.x_train, c.x_val, c.x_test]) for c in fed.clients])
    return np.sort(np.round(x.double().flatten(1).sum(1).numpy() * 255).astype(np.int64))


def test_fmnist_reads_small_idx_files(tmp_path):
    images = write_mnist_like(tmp_path / "data" / "fashion-mnist", 200, 50, np.random.default_rng(0))
    cfg = make_cfg(source="fmnist", num_clients=5, params={"data_dir": str(tmp_path / "data")},
                   partition={"kind": "iid"})
    fed = load_federated(cfg, seed=0)
    assert fed.input_shape == (1, 28, 28) and fed.clients[0].x_train.shape[1:] == (1, 28, 28)
    assert sizes_of(fed).sum() == 250
    x = fed.clients[0].x_train
    assert x.dtype == torch.float32 and float(x.min()) >= 0 and float(x.max()) <= 1
    assert np.array_equal(pooled_pixel_sums(fed), np.sort(images.reshape(250, -1).sum(1).astype(np.int64)))


def test_mnist_reads_torchvision_layout_via_env(tmp_path, monkeypatch):
    write_mnist_like(tmp_path / "MNIST" / "raw", 100, 20, np.random.default_rng(1), gz=False)
    monkeypatch.setenv("PFL_DATA_DIR", str(tmp_path))
    fed = load_federated(make_cfg(source="mnist", num_clients=4, partition={"kind": "iid"}), seed=0)
    assert sizes_of(fed).sum() == 120


def test_missing_image_files_give_a_helpful_error(tmp_path):
    cfg = make_cfg(source="fmnist", params={"data_dir": str(tmp_path / "nothing")})
    with pytest.raises(ConfigError) as info:
        resolve_data_config(cfg)
    msg = str(info.value)
    assert info.value.field == "data.params.data_dir"
    for word in (str(tmp_path / "nothing"), "train-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
                 "apt-get install dataset-fashion-mnist", "download: true"):
        assert word in msg
    with pytest.raises(ConfigError) as info:
        resolve_data_config(make_cfg(source="cifar10", params={"data_dir": str(tmp_path)}))
    assert "cifar-10-batches-py" in str(info.value) and "data_batch_1" in str(info.value)


def _pickle(path: Path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def test_cifar10_reads_small_pickled_batches(tmp_path):
    rng = np.random.default_rng(2)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (20, 3072), dtype=np.uint8)
        batches[name] = data
        _pickle(folder / name, {"data": data, "labels": [int(v) for v in np.arange(20) % 10],
                                "batch_label": name})
    _pickle(folder / "batches.meta", {"label_names": [f"c{i}" for i in range(10)]})
    cfg = make_cfg(source="cifar10", num_clients=4, params={"data_dir": str(tmp_path)},
                   partition={"kind": "dirichlet", "alpha": 1.0, "min_samples": 5})
    fed = load_federated(cfg, seed=0)
    assert fed.input_shape == (3, 32, 32) and fed.num_classes == 10
    assert sizes_of(fed).sum() == 120
    counts = sum(torch.bincount(all_labels(c), minlength=10) for c in fed.clients)
    assert counts.tolist() == [12] * 10
    # per-channel standardisation with the usual CIFAR-10 statistics
    x = torch.cat([torch.cat([c.x_train, c.x_val, c.x_test]) for c in fed.clients])
    mean, std = torch.tensor([0.4914, 0.4822, 0.4465]), torch.tensor([0.2470, 0.2435, 0.2616])
    raw = (x * std[:, None, None] + mean[:, None, None]) * 255
    expected = np.concatenate(list(batches.values())).reshape(120, 3, 32, 32).astype(np.float64)
    assert np.allclose(np.sort(raw.double().sum((1, 2, 3)).numpy()), np.sort(expected.sum((1, 2, 3))), atol=0.5)
    red = np.sort(raw.double()[:, 0].sum((1, 2)).numpy())  # channel order: the first 1024 values are red
    assert np.allclose(red, np.sort(expected[:, 0].sum((1, 2))), atol=0.5)


def test_cifar100_reads_fine_labels(tmp_path):
    rng = np.random.default_rng(3)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, n in (("train", 200), ("test", 100)):
        _pickle(folder / name, {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                                "fine_labels": [int(v) for v in np.arange(n) % 100],
                                "coarse_labels": [int(v) for v in np.arange(n) % 20]})
    _pickle(folder / "meta", {"fine_label_names": [f"f{i}" for i in range(100)]})
    cfg = make_cfg(source="cifar100", num_clients=3, params={"data_dir": str(folder), "normalize": False},
                   partition={"kind": "iid"})
    fed = load_federated(cfg, seed=0)
    assert fed.num_classes == 100 and sizes_of(fed).sum() == 300
    counts = sum(torch.bincount(all_labels(c), minlength=100) for c in fed.clients)
    assert counts.tolist() == [3] * 100
    assert float(fed.clients[0].x_train.max()) <= 1.0


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").is_file(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_label_swap():
    cfg = make_cfg(source="fmnist", num_clients=20, partition={"kind": "label_swap", "alpha": 1.0})
    fed = load_federated(cfg, seed=0)
    assert sizes_of(fed).sum() == 70000
    assert fed.true_clusters.tolist() == [i // 5 for i in range(20)]


# ------------------------------------------------------------------------------------------------
# containers

def test_summary_and_to():
    fed = load_federated(make_cfg(source="digits", num_clients=5, partition={"kind": "shards"}), seed=0)
    s = fed.summary()
    assert s["num_clients"] == 5 and s["source"] == "digits" and s["partition"] == "shards"
    assert s["samples"]["train"]["total"] + s["samples"]["val"]["total"] + s["samples"]["test"]["total"] == 1797
    assert len(s["label_counts"]) == 5 and s["classes_per_client"]["max"] <= 2
    moved = fed.to("cpu")
    assert moved.clients[0].x_train.device.type == "cpu" and moved.partition_hash == fed.partition_hash
    assert fed.clients[0].n_train == len(fed.clients[0].y_train)


def test_partition_rng_is_stage_specific():
    a = rng_for(0, "pfl.data.partition").integers(1 << 30)
    b = rng_for(0, "pfl.data.split").integers(1 << 30)
    assert a != b and a == rng_for(0, "pfl.data.partition").integers(1 << 30)
    assert partition_mod.largest_remainder(np.array([0.5, 0.5, 2.0]), 3).tolist() == [1, 0, 2]
