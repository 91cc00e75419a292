"""Truth tests for surviving mutants of PerFed-CKT's setup (survivor set H of issue 42):
``PerFedCKTHparams.validate``, ``parse_architectures``, ``assign_architectures``, ``PerFedCKT.configure``
and the public set's source read (pfl/methods/perfed_ckt.py, pfl/methods/public_set.py; spec
specs/perfed_ckt.md §5–§6). The truths: a bad setting is refused with a ConfigError on the offending
field (``method.public_per_round``, ``method.architectures[i]``, ``…[i].params[.key]``) whose
message gives the values involved, each check's boundary taken on both sides; a model-zoo error keeps
the zoo's own message (``ConfigError.message``, the text without its field); the grammar the
``architectures`` doc states (``"name"`` or ``{name, params}``, ``[]`` = ``model.name`` with
``model.params``); the architecture assignment of §6 (score n_k·u_k, clients sorted by score with
ties kept in client order, cut into A equal groups, the top group on the last model) counted by hand
from the uniform draws; the models made on the run's device (a ``meta`` device); the task source
read once when the public set is built (``client_pool_rows`` is given the loaded source); and the
clients' pool rows as sorted int64 indices, counted by hand, even from a split of Python lists."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from helpers import small_config
from pfl.schema import ConfigError


def _load(**method):
    from pfl.resolver import load

    return load(None, {"method.name": "perfed_ckt", "tracking.enabled": False,
                       **{f"method.{k}": v for k, v in method.items()}})


def _refused(**method) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        _load(**method)
    return err.value


def _ckt_sim(**kw):
    from pfl.federation.simulator import Simulator

    base = dict(method__name="perfed_ckt", method__architectures=["mlp"], method__public_size=20, method__k=2,
                data__num_clients=6, federation__clients_per_round=0, federation__rounds=1)
    return Simulator(small_config(**{**base, **kw}))


# ---- validate: public_per_round ≤ public_size -----------------------------------------------------------

def test_public_rows_per_round_may_equal_the_public_size_but_not_exceed_it():
    """N_t ≤ N (spec §5): N_t = N = 37 is accepted, N_t = 38 > 37 is refused on the field with both numbers."""
    assert _load(public_size=37, public_per_round=37).method.hparams.public_per_round == 37
    assert _load(public_size=37, public_per_round=36).method.hparams.public_per_round == 36
    err = _refused(public_size=37, public_per_round=38)
    assert err.field == "method.public_per_round"
    assert "38" in err.message and "public_size = 37" in err.message


# ---- validate: the architectures grammar -------------------------------------------------------------------

def test_an_architecture_is_a_name_or_a_mapping_with_a_name_and_optional_params():
    """Accepted: "mlp", {name}, {name, params: None}, {name, params: {...}}; the list is kept as given."""
    archs = ["mlp", {"name": "mlp"}, {"name": "mlp", "params": None}, {"name": "mlp", "params": {"hidden": [3]}}]
    assert _load(architectures=archs).method.hparams.architectures == archs


@pytest.mark.parametrize("entry", [{"nam": "mlp"}, {"params": {}}, {"name": "mlp", "params": {}, "head": "x"}, 3])
def test_an_entry_that_is_neither_a_name_nor_a_name_params_mapping_is_refused_showing_it(entry):
    err = _refused(architectures=["mlp", entry])
    assert err.field == "method.architectures[1]"
    assert err.message.startswith("expected a model name or {name, params}") and repr(entry) in err.message


def test_an_unknown_model_name_is_refused_on_the_entry_with_the_zoos_message_and_allowed_names():
    """The zoo's error (field model.name) is re-raised on the list entry with the zoo's message,
    which lists every registered model."""
    from pfl.models import list_models, model_spec

    with pytest.raises(ConfigError) as zoo:
        model_spec("no_such_net")
    err = _refused(architectures=["mlp", "no_such_net"])
    assert err.field == "method.architectures[1]" and err.message == zoo.value.message
    assert "'no_such_net'" in err.message and all(m.name in err.message for m in list_models())


@pytest.mark.parametrize("file", ["plain.py", " plain.py"])
def test_a_plugin_error_is_kept_whole_colons_and_leading_blanks_included(tmp_path, monkeypatch, file):
    """A plug-in 'file.py:Thing' whose Thing is no nn.Module: the zoo says "<name>: Thing is a class
    but not a torch.nn.Module"; the entry's error keeps that whole text (only the field is replaced),
    its colons and, for a file named with a leading blank (read from the working directory), that blank."""
    from pfl.models import model_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / file).write_text("class Thing:\n    pass\n")
    name = f"{file}:Thing"
    with pytest.raises(ConfigError) as zoo:
        model_spec(name)
    assert zoo.value.field == "model.name" and zoo.value.message.startswith(f"{name}: ")
    err = _refused(architectures=[name])
    assert err.field == "method.architectures[0]" and err.message == zoo.value.message


def test_an_entrys_params_must_be_a_mapping():
    err = _refused(architectures=[{"name": "mlp", "params": [16]}])
    assert err.field == "method.architectures[0].params"
    assert err.message.startswith("expected a mapping") and "[16]" in err.message


@pytest.mark.parametrize("params, key", [({"bogus": 1}, "bogus"), ({"hidden": "wide"}, "hidden")])
def test_an_entrys_params_are_checked_against_its_models_params_naming_the_key(params, key):
    """mlp takes `hidden` (a list): an unknown key and a wrong type are refused on
    method.architectures[i].params.<key>."""
    err = _refused(architectures=["mlp", {"name": "mlp", "params": params}])
    assert err.field == f"method.architectures[1].params.{key}"


# ---- parse_architectures --------------------------------------------------------------------------------

def test_an_empty_architecture_list_is_the_configured_model_with_its_params():
    from pfl.methods.perfed_ckt import Architecture, parse_architectures

    cfg = small_config(**{"method.name": "perfed_ckt", "model.name": "mlp", "model.params": {"hidden": [7]}})
    archs = parse_architectures(cfg.method.hparams, cfg)
    assert archs == [Architecture("mlp", {"hidden": [7]})]
    assert parse_architectures(cfg.method.hparams, small_config(**{"model.name": "softmax_regression"})) == \
        [Architecture("softmax_regression", {})]


def test_names_and_mappings_parse_to_name_and_params_in_order():
    from pfl.methods.perfed_ckt import Architecture, parse_architectures

    cfg = small_config(**{"method.name": "perfed_ckt",
                          "method.architectures": ["cnn_fpfc", {"name": "mlp", "params": {"hidden": [4]}},
                                                   {"name": "mlp", "params": None}]})
    assert parse_architectures(cfg.method.hparams, cfg) == [
        Architecture("cnn_fpfc", {}), Architecture("mlp", {"hidden": [4]}), Architecture("mlp", {})]


def test_with_no_architecture_list_every_client_runs_the_configured_model():
    """architectures = [] : one model, built from model.name / model.params (an MLP 64 → 7 → 10 on digits
    has 64·7 + 7 + 7·10 + 10 parameters), and every client is on it."""
    sim = _ckt_sim(method__architectures=[], model__name="mlp", model__params={"hidden": [7]})
    m = sim.method
    assert len(m.arch_models) == 1 and m.arch_params == [64 * 7 + 7 + 7 * 10 + 10]
    assert set(np.asarray(m.arch_of).tolist()) == {0}


# ---- assign_architectures ------------------------------------------------------------------------------

def _hand_assignment(n, u, a):
    """Clients by score n·u ascending (ties in client order), cut into `a` groups of len(n)/a."""
    scores = [float(n[i]) * float(u[i]) for i in range(len(n))]
    order = sorted(range(len(n)), key=lambda i: scores[i])
    per = len(n) // a
    arch = [0] * len(n)
    for pos, cid in enumerate(order):
        arch[cid] = pos // per
    return arch, scores


def test_architectures_go_by_sample_count_times_a_uniform_draw_top_group_largest():
    from pfl.methods.perfed_ckt import assign_architectures

    n = np.array([30, 5, 12, 80, 44, 7, 19, 60, 3], dtype=float)
    u = np.random.default_rng(11).uniform(size=len(n))
    arch, scores = assign_architectures(n, 3, np.random.default_rng(11))
    want_arch, want_scores = _hand_assignment(n, u, 3)
    assert np.issubdtype(arch.dtype, np.integer)
    assert arch.tolist() == want_arch and np.bincount(arch).tolist() == [3, 3, 3]
    np.testing.assert_array_equal(scores, np.array(want_scores))


def test_clients_with_equal_scores_keep_client_order():
    """Six clients without training samples (ids 3–8) all score 0 and take the first six places:
    with four models of three clients each, ids 3, 4, 5 (the first by id) take model 0 and ids
    6, 7, 8 model 1, the same cut on every machine; the others go by n·u."""
    from pfl.methods.perfed_ckt import assign_architectures

    n = np.array([25, 30, 48, 0, 0, 0, 0, 0, 0, 40, 33, 1], dtype=float)
    arch, _ = assign_architectures(n, 4, np.random.default_rng(2))
    assert arch[3:9].tolist() == [0, 0, 0, 1, 1, 1]
    u = np.random.default_rng(2).uniform(size=len(n))
    assert arch.tolist() == _hand_assignment(n, u, 4)[0]


# ---- configure ---------------------------------------------------------------------------------------

def test_a_regression_task_is_refused_with_a_message_that_starts_with_the_method():
    from pfl.federation.simulator import Simulator

    cfg = small_config(**{"method.name": "perfed_ckt", "data.source": "fpfc_linear", "data.partition.kind": "natural"})
    with pytest.raises(ConfigError) as err:
        Simulator(cfg)
    assert err.value.field == "method.name"
    assert err.value.message.startswith("perfed_ckt needs a classification task")


def test_the_architecture_models_are_made_on_the_runs_device():
    """configure on a ``meta`` device: every architecture's model lives there (a model left where the
    zoo builds it would be on the CPU)."""
    sim = _ckt_sim(method__architectures=["mlp", "softmax_regression"])
    m = sim.method
    m.ctx = dataclasses.replace(m.ctx, device=torch.device("meta"))
    m.configure()
    assert len(m.arch_models) == 2
    for model in m.arch_models:
        assert {p.device.type for p in model.parameters()} == {"meta"}


# ---- the public set reads the task source once ----------------------------------------------------------

def test_building_the_held_out_public_set_reads_the_task_source_once(monkeypatch):
    """build_public_set loads the task's source and hands it to client_pool_rows (its ``src``), so
    the source is read once, not again to find the clients' rows; the rows are still disjoint."""
    from pfl.data.sources import SourceSpec
    from pfl.methods.public_set import build_public_set

    sim = _ckt_sim(data__max_samples=600)
    reads = []
    real = SourceSpec.load

    def counting(self, params, num_clients):
        reads.append(self.name)
        return real(self, params, num_clients)

    monkeypatch.setattr(SourceSpec, "load", counting)
    pub = build_public_set(sim.method.ctx, "same_heldout", 20)
    assert reads == ["digits"]
    assert len(pub) == 20 and pub.overlap == 0


def test_the_clients_pool_rows_are_integer_indices_when_a_split_gives_python_lists(monkeypatch):
    """A source's own ``split`` returns lists (``SourceData.split``: tuple[list, list, list]; a
    plug-in's may hold plain Python lists, an empty one for a client without validation rows): the
    held rows are still the sorted, distinct int64 pool indices of every split, counted by hand."""
    import types

    import pfl.data
    from pfl.data.partition import Partition
    from pfl.methods.public_set import client_pool_rows

    part = Partition(train=[[7, 2], [9]], val=[[], [4]], test=[[2], [11, 0]])
    monkeypatch.setattr(pfl.data, "held_partition", lambda cfg, seed, src=None: (None, part, "key", True))
    ctx = types.SimpleNamespace(cfg=types.SimpleNamespace(data=None), seed=0)
    held = client_pool_rows(ctx)
    assert held.dtype == np.int64 and held.tolist() == [0, 2, 4, 7, 9, 11]
