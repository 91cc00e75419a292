"""Truths of the cluster read-outs and the low-rank views (pfl/clusters.py, pfl/lowrank.py; issue 42).

Each read-out is compared with a computation written another way here: components by a breadth-first
search, the silhouette by its definition (a(i), b(i) from the distance rows), the best threshold by
a brute-force scan of every cut between sorted pairwise distances with the single-linkage merge
heights from Prim's minimum spanning tree, the adjusted Rand index by Hubert & Arabie's pair-count
formula, the matrix view of a conv weight by its index map M[o·k_h + i, c·k_w + j] = W[o, c, i, j]
(and by the two-conv factorization it stands for), the singular-value threshold by numpy's SVD.
"""

from __future__ import annotations

import csv
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pfl import clusters, lowrank
from pfl.federation.messages import LowRank, Message, Model
from truth import components


# ---- clusters ----------------------------------------------------------------------------------

def _silhouette(dist, labels):
    labels = np.asarray(labels)
    s = []
    for i in range(len(dist)):
        own = [j for j in range(len(dist)) if labels[j] == labels[i] and j != i]
        if not own:
            s.append(0.0)
            continue
        a = sum(dist[i][j] for j in own) / len(own)
        b = min(np.mean([dist[i][j] for j in range(len(dist)) if labels[j] == c])
                for c in set(labels.tolist()) if c != labels[i])
        s.append((b - a) / max(a, b))
    return float(np.mean(s))


def _mst_heights(dist):
    """Prim's minimum spanning tree: its edge weights are the single-linkage merge heights."""
    m = len(dist)
    inside, best, heights = {0}, {j: dist[0][j] for j in range(1, m)}, []
    while len(inside) < m:
        j = min(best, key=best.get)
        heights.append(best.pop(j))
        inside.add(j)
        for k in best:
            best[k] = min(best[k], dist[j][k])
    return sorted(set(heights))


def _brute_threshold(dist, min_score=0.25):
    m = len(dist)
    heights = _mst_heights(dist)
    best, best_labels, best_nu = min_score, None, None
    for low, high in zip(heights[:-1], heights[1:]):
        nu = (low + high) / 2
        labels = components([[dist[i][j] < nu for j in range(m)] for i in range(m)]).tolist()
        k = max(labels) + 1
        if 2 <= k <= m - 1:
            score = _silhouette(dist, labels)
            if score > best:
                best, best_labels, best_nu = score, labels, nu
    return best_nu, best_labels, best


def _dist(points):
    p = np.asarray(points, dtype=float).reshape(len(points), -1)
    return np.sqrt(((p[:, None, :] - p[None, :, :]) ** 2).sum(-1))


def test_connected_components_are_a_breadth_first_search_labelled_by_first_appearance():
    rng = np.random.default_rng(0)
    for _ in range(5):
        w = rng.random((9, 9)) * (rng.random((9, 9)) < 0.15)   # weighted, asymmetric: any nonzero is an edge
        truth = components(w != 0).tolist()
        assert clusters.connected_components(w).tolist() == truth
        assert clusters.connected_components(torch.tensor(w != 0)).tolist() == truth
    assert clusters.connected_components(np.eye(3, dtype=bool)).tolist() == [0, 1, 2]


def test_relabel_numbers_labels_by_first_appearance():
    assert clusters.relabel([7, 7, 3, 9, 3, 7]).tolist() == [0, 0, 1, 2, 1, 0]
    assert clusters.relabel(np.array([2, 1, 0])).dtype.kind == "i"


@pytest.mark.parametrize("points", [
    [0.0, 0.1, 5.0],                                   # m = 3: the best cut has m − 1 = 2 components
    [0.0, 0.2, 0.3, 4.0, 4.1, 9.0, 9.4],               # three groups
    [0.0, 0.3, 0.5, 6.0, 6.2, 6.3, 6.9],               # two groups
    [[0, 0], [0, 1], [5, 5], [5, 6], [6, 5], [20, 0], [20, 1.5], [21, 0]],
])
def test_silhouette_threshold_is_the_best_cut_of_a_brute_force_scan(points):
    dist = _dist(points)
    nu_truth, labels_truth, _ = _brute_threshold(dist)
    nu = clusters.silhouette_threshold(dist)
    assert nu is not None and nu_truth is not None
    assert nu == pytest.approx(nu_truth, rel=1e-12)          # halfway between the two merge heights
    assert clusters.connected_components(dist < nu).tolist() == labels_truth


def test_silhouette_threshold_symmetrises_and_ignores_the_diagonal():
    dist = _dist([0.0, 0.2, 0.3, 4.0, 4.1, 9.0, 9.4])
    rng = np.random.default_rng(1)
    noise = np.triu(rng.random(dist.shape) * 0.05, 1)
    skew = dist + noise - noise.T                      # (skew + skewᵀ)/2 = dist
    np.fill_diagonal(skew, 3.0)
    assert clusters.silhouette_threshold(skew) == pytest.approx(_brute_threshold(dist)[0], rel=1e-12)


def test_silhouette_threshold_returns_none_without_structure():
    assert clusters.silhouette_threshold(_dist([0.0, 5.0])) is None          # m < 3
    assert clusters.silhouette_threshold(np.ones((4, 4)) - np.eye(4)) is None  # one merge height: no cut
    dist = _dist([0.0, 1.0, 2.1, 3.3, 4.6])          # a chain: weak structure
    _, _, best = _brute_threshold(dist, min_score=-1.0)
    assert clusters.silhouette_threshold(dist, min_score=best + 1e-9) is None
    assert clusters.silhouette_threshold(dist, min_score=best - 1e-9) is not None


def _ari(a, b):
    a, b = np.asarray(a), np.asarray(b)
    n = len(a)
    table = np.array([[np.sum((a == x) & (b == y)) for y in np.unique(b)] for x in np.unique(a)])
    c2 = lambda v: v * (v - 1) / 2  # noqa: E731
    index = c2(table).sum()
    rows, cols = c2(table.sum(1)).sum(), c2(table.sum(0)).sum()
    expected = rows * cols / c2(n)
    return (index - expected) / ((rows + cols) / 2 - expected)


def test_cluster_metrics_count_and_adjusted_rand_index_by_pair_counts():
    found, true = [0, 0, 1, 1, 2, 2, 2, 0], [1, 1, 1, 0, 0, 0, 2, 2]
    out = clusters.cluster_metrics(found, true)
    assert out["cluster/num"] == 3.0
    assert out["cluster/ari"] == pytest.approx(_ari(found, true), abs=1e-12)
    assert clusters.cluster_metrics([4, 4, 9], None) == {"cluster/num": 2.0}


def test_assignment_metrics_compare_with_the_listed_clients_true_clusters():
    meta = SimpleNamespace(true_clusters=[0, 0, 1, 1, 2, 2], client_sizes=[5, 6, 7, 8, 9, 10])
    out = clusters.assignment_metrics([3, 3, 1, 1, 0, 0], meta)
    assert out == {"cluster/num": 3.0, "cluster/ari": pytest.approx(1.0)}
    sub = clusters.assignment_metrics([1, 1, 0], meta, clients=[4, 5, 0])   # true: 2, 2, 0
    assert sub["cluster/ari"] == pytest.approx(1.0)
    wrong = clusters.assignment_metrics([1, 1, 0], meta, clients=[0, 2, 4])  # true: 0, 1, 2
    assert wrong["cluster/ari"] == pytest.approx(_ari([1, 1, 0], [0, 1, 2]))
    assert "cluster/ari" not in clusters.assignment_metrics([0, 1], SimpleNamespace(true_clusters=None))


def test_assignment_table_rows_are_client_true_found_and_size(tmp_path):
    meta = SimpleNamespace(true_clusters=[0, 0, 1, 1], client_sizes=[5, 6, 7, 8])
    path = clusters.write_assignment_table(str(tmp_path), "a.csv", [1, 0], meta, clients=[3, 0])
    assert path == str(tmp_path / "a.csv")
    rows = list(csv.reader(open(path)))
    assert rows == [["client", "true_cluster", "found_cluster", "n_train"], ["3", "1", "1", "8"], ["0", "0", "0", "5"]]
    meta.true_clusters = None
    rows = list(csv.reader(open(clusters.write_assignment_table(str(tmp_path), "b.csv", [2, 2], meta))))
    assert rows[1:] == [["0", "-1", "2", "5"], ["1", "-1", "2", "6"]]


# ---- low-rank views ----------------------------------------------------------------------------

def test_matrix_shapes_and_the_conv_index_map():
    assert lowrank.matrix_shape((5, 3)) == (5, 3)
    assert lowrank.matrix_shape(torch.Size([4, 3, 2, 5])) == (8, 15)
    assert lowrank.matrix_shape((4, 3, 7)) == (4, 21)
    assert lowrank.matrix_shape((2, 3, 4, 5, 6)) == (2, 360)
    with pytest.raises(ValueError, match="2 dims"):
        lowrank.matrix_shape((6,))
    w = torch.randn(4, 3, 2, 5, dtype=torch.float64)
    m = lowrank.to_matrix(w)
    for o, c, i, j in np.ndindex(4, 3, 2, 5):
        assert m[o * 2 + i, c * 5 + j] == w[o, c, i, j]
    assert torch.equal(lowrank.from_matrix(m, w.shape), w)
    assert lowrank.from_matrix(m, w.shape).is_contiguous()
    v = torch.randn(4, 3, 7)
    assert torch.equal(lowrank.to_matrix(v), v.reshape(4, 21))
    assert torch.equal(lowrank.from_matrix(v.reshape(4, 21), (4, 3, 7)), v)


def test_a_rank_r_conv_matrix_is_a_row_conv_then_a_column_conv():
    """The docstring's reading: factors A (out·k_h × r), B (r × in·k_w) of the matrix view are a (1×k_w)
    conv in→r followed by a (k_h×1) conv r→out; their composition is the conv with from_matrix(A B)."""
    out, cin, kh, kw, r = 3, 2, 3, 2, 2
    a, b = torch.randn(out * kh, r, dtype=torch.float64), torch.randn(r, cin * kw, dtype=torch.float64)
    w = lowrank.from_matrix(a @ b, (out, cin, kh, kw))
    first = b.reshape(r, cin, 1, kw)                               # B[s, c·kw + j]
    second = a.reshape(out, kh, r).permute(0, 2, 1).reshape(out, r, kh, 1)   # A[o·kh + i, s]
    x = torch.randn(1, cin, 6, 5, dtype=torch.float64)
    two = torch.nn.functional.conv2d(torch.nn.functional.conv2d(x, first), second)
    assert torch.allclose(torch.nn.functional.conv2d(x, w), two, atol=1e-10)


def test_factorized_count_is_the_smaller_encoding():
    assert lowrank.factorized_count(10, 8, 2) == 36
    assert lowrank.factorized_count(10, 8, 5) == 80
    assert lowrank.factorized_count(10, 8, 0) == 0


@pytest.mark.parametrize("shape,tau", [((6, 5), 0.8), ((4, 3, 2, 2), 1.0), ((5, 4), 0.0), ((3, 3), 100.0)])
def test_threshold_is_numpys_singular_value_soft_threshold_with_balanced_factors(shape, tau):
    torch.manual_seed(3)
    t = torch.randn(*shape, dtype=torch.float64)
    mat = lowrank.to_matrix(t).numpy()
    u, s, vh = np.linalg.svd(mat, full_matrices=False)
    kept = np.maximum(s - tau, 0)
    expected = (u * kept) @ vh
    x, layer = lowrank.threshold(t, tau)
    assert x.shape == t.shape
    np.testing.assert_allclose(lowrank.to_matrix(x).numpy(), expected, atol=1e-10)
    r = int((kept > 0).sum())
    assert layer.rank == r and layer.max_rank == min(mat.shape) and layer.shape == tuple(shape)
    np.testing.assert_allclose(layer.kept.numpy(), kept[:r], atol=1e-10)
    assert (layer.rows, layer.cols) == mat.shape
    np.testing.assert_allclose((layer.left @ layer.right).numpy(), expected, atol=1e-10)
    # balanced: AᵀA = B Bᵀ = diag(σ − τ)
    np.testing.assert_allclose((layer.left.T @ layer.left).numpy(), np.diag(kept[:r]), atol=1e-10)
    np.testing.assert_allclose((layer.right @ layer.right.T).numpy(), np.diag(kept[:r]), atol=1e-10)
    rows, cols = mat.shape
    assert layer.factorized() == ((rows + cols) * r < rows * cols)
    assert layer.count() == min((rows + cols) * r, rows * cols)


def test_threshold_falls_back_to_float64_when_the_svd_fails(monkeypatch):
    calls = []
    real = lowrank.svt

    def flaky(m, tau):
        calls.append(m.dtype)
        if m.dtype == torch.float32:
            raise RuntimeError("svd did not converge")
        return real(m, tau)

    monkeypatch.setattr(lowrank, "svt", flaky)
    t = torch.randn(5, 4)
    x, layer = lowrank.threshold(t, 0.5)
    assert calls == [torch.float32, torch.float64]
    assert x.dtype == torch.float32 and layer.left.dtype == torch.float32 and layer.kept.dtype == torch.float32
    u, s, vh = np.linalg.svd(t.double().numpy(), full_matrices=False)
    np.testing.assert_allclose(x.numpy(), (u * np.maximum(s - 0.5, 0)) @ vh, atol=1e-5)


def test_encode_sends_factors_only_where_smaller_and_decode_rebuilds_every_tensor():
    torch.manual_seed(4)
    low = torch.randn(8, 1) @ torch.randn(1, 2 * 3)                # rank 1 matrix view
    conv = lowrank.from_matrix(low, (4, 2, 2, 3)) + 0.0
    dense = torch.randn(3, 3)
    params = {"conv": conv, "fc": dense, "bias": torch.randn(3)}
    layers = {}
    thresholded = {}
    for name in ("conv", "fc"):
        thresholded[name], layers[name] = lowrank.threshold(params[name], 1e-3)
    entries = lowrank.encode({**params, **thresholded}, layers)
    assert isinstance(entries["conv"], LowRank) and entries["conv"].rank == 1
    assert entries["conv"].shape == (4, 2, 2, 3)
    assert isinstance(entries["fc"], torch.Tensor)                      # full rank 3: (3+3)·3 ≥ 9
    assert entries["bias"] is params["bias"]
    for source in (entries, Message(parts={"model": Model(entries=entries)})):
        out = lowrank.decode(source)
        assert set(out) == {"conv", "fc", "bias"}
        assert torch.allclose(out["conv"], thresholded["conv"], atol=1e-5)
        assert torch.allclose(out["conv"], conv, atol=1e-3)
        assert torch.equal(out["fc"], thresholded["fc"]) and torch.equal(out["bias"], params["bias"])
    flat = lowrank.decode({"m": LowRank(torch.ones(2, 1), torch.ones(1, 3))})
    assert torch.equal(flat["m"], torch.ones(2, 3))
