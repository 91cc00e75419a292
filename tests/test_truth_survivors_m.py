"""Truth tests for survivors of pfl/methods/ala.py (FedALA as a ``base+ala`` plug-in).

Targets: ``compose`` (called afresh: the registry's classes were built before any mutant), 
``_merged_hparams`` (the merged dataclass: name, field set, defaults, metadata, base class, clash
error, docstring), ``_ALACore.setup/aggregate/extra_metrics`` (the server-side ALA cost log, checked
against sums/means hand-computed from the replies' ``info``), ``ala_sample_indices`` (s% sample:
size ⌊s·n/100⌋, contiguous window or distinct random subset, reproducible from the generator alone)
and ``upper_names`` (the top p units/tensors; p <= 0 means all, as the docstring says). Truths come
from the module docstring, docs/methods/fedala.md and the functions' docstrings.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

from pfl.methods import ala
from pfl.methods.base import Method, NoHparams
from pfl.methods.ditto import Ditto
from pfl.methods.fedavg import FedAvg, FedProx
from pfl.schema import ConfigError

ALA_FIELDS = {f.name: f for f in dataclasses.fields(ala.ALAHparams)}


# ---- compose -------------------------------------------------------------------------------------

def test_compose_of_a_start_params_method_mixes_in_the_start_mixin_with_documented_attributes():
    cls = ala.compose(FedProx)
    assert cls.__name__ == "FedProxALA"
    assert cls.__bases__ == (ala.ALAStartMixin, FedProx)
    assert cls.__module__ == "pfl.methods.ala"
    assert cls.name == f"{FedProx.name}+ala"
    assert cls.description == f"{FedProx.description} + adaptive local aggregation (FedALA)"
    assert cls._ala_base_personal is FedProx.personal_params
    assert tuple(cls.metric_names) == tuple(FedProx.metric_names) + ("ala/*",)
    names = {f.name for f in dataclasses.fields(cls.Hparams)}
    assert names == {f.name for f in dataclasses.fields(FedProx.Hparams)} | set(ALA_FIELDS)
    assert cls.Hparams is not FedProx.Hparams and issubclass(cls.Hparams, FedProx.Hparams)


def test_compose_of_ditto_replaces_personal_start():
    cls = ala.compose(Ditto)
    assert cls.__bases__ == (ala.ALAPersonalMixin, Ditto)
    assert cls.name == f"{Ditto.name}+ala"


def test_compose_description_falls_back_to_the_base_name():
    class Bare(FedAvg):
        name = "bare_m"
        description = ""
    cls = ala.compose(Bare)
    assert cls.description == "bare_m + adaptive local aggregation (FedALA)"


def test_compose_of_a_method_without_a_start_hook_is_a_config_error_on_method_name():
    class NoHook(Method):
        name = "nohook_m"
    assert not hasattr(NoHook, "start_params") and not hasattr(NoHook, "personal_start")
    with pytest.raises(ConfigError) as e:
        ala.compose(NoHook)
    assert e.value.field == "method.name"
    assert "'nohook_m'" in str(e.value) and "start_params" in str(e.value)


# ---- _merged_hparams -----------------------------------------------------------------------------

def test_merged_hparams_keep_base_fields_and_add_ala_fields_with_their_defaults_and_metadata():
    base = FedProx.Hparams
    m = ala._merged_hparams(base)
    assert m.__name__ == f"{base.__name__}ALA"
    assert m.__module__ == "pfl.methods.ala"
    assert issubclass(m, base)
    inst = m()  # every field has a default
    for f in dataclasses.fields(base):
        assert getattr(inst, f.name) == getattr(base(), f.name)
    fields = {f.name: f for f in dataclasses.fields(m)}
    for name, f in ALA_FIELDS.items():
        assert getattr(inst, name) == f.default
        assert fields[name].metadata == f.metadata
    # documented defaults (module docstring / ALAHparams)
    assert (inst.p, inst.p_unit, inst.s, inst.eta, inst.threshold, inst.window, inst.ala_max_epochs,
            inst.ala_sample, inst.eval_model) == (1, "units", 80.0, 1.0, 0.1, 10, 100, "window", "ala")
    assert m.__doc__ == f"{base.__doc__.strip()} + {ala.ALAHparams.__doc__}"


def test_merged_hparams_of_a_plain_class_is_a_fresh_dataclass_not_a_subclass():
    class Plain:
        """  Plain hyperparameters.  """
    m = ala._merged_hparams(Plain)
    assert not issubclass(m, Plain)
    assert {f.name for f in dataclasses.fields(m)} == set(ALA_FIELDS)
    assert m.__doc__ == f"Plain hyperparameters. + {ala.ALAHparams.__doc__}"
    n = ala._merged_hparams(NoHparams)
    assert {f.name for f in dataclasses.fields(n)} >= set(ALA_FIELDS)

    class Undocumented:
        pass
    Undocumented.__doc__ = None
    assert ala._merged_hparams(Undocumented).__doc__ == f" + {ala.ALAHparams.__doc__}"


def test_merged_hparams_refuse_a_base_that_already_has_an_ala_field():
    @dataclasses.dataclass
    class Clashing:
        """x"""
        p: int = 3
        mu: float = 0.0
    with pytest.raises(ValueError) as e:
        ala._merged_hparams(Clashing)
    assert str(e.value) == "Clashing already has fields ['p']; ALA cannot be merged"


# ---- setup / aggregate / extra_metrics ------------------------------------------------------------

class _Base:
    def setup(self):
        self.base_setup = True

    def aggregate(self, rnd, replies):
        self.base_rnd = rnd

    def extra_metrics(self, rnd, final=False):
        return {"base/rnd": rnd, "base/final": final}


class _Core(ala._ALACore, _Base):
    pass


class _Reply:
    def __init__(self, info):
        self.info = info


STAT_KEYS = ("time_s", "time_s_mean", "time_total_s", "time_at_eval_total_s", "passes", "start_passes",
             "start_clients")


def test_setup_starts_every_ala_cost_at_zero():
    c = _Core()
    c.setup()
    assert c.base_setup
    assert c.ala_stats == {"next_round": 0, **{k: 0 for k in STAT_KEYS}}
    assert all(type(c.ala_stats[k]) is float for k in STAT_KEYS[:4])
    out = c.extra_metrics(3)
    assert out == {"base/rnd": 3, "base/final": False, **{f"ala/{k}": 0.0 for k in STAT_KEYS}}


def test_aggregate_logs_sums_means_and_cumulative_counts_of_the_replies_info():
    c = _Core()
    c.setup()
    r1 = {0: _Reply({"ala_time_s": 0.5, "ala_passes": 3, "ala_start": 1, "ala_cached": 0}),
          1: _Reply({"ala_time_s": 1.5, "ala_passes": 2}),                      # no start / cached keys
          2: _Reply({"ala_time_s": 0.25, "ala_passes": 1, "ala_start": 0, "ala_cached": 1}),
          3: _Reply({"other": 1})}                                               # no ALA info
    c.aggregate(4, r1)
    assert c.base_rnd == 4
    s = c.ala_stats
    assert s["next_round"] == 5
    assert s["time_s"] == pytest.approx(2.25) and s["time_s_mean"] == pytest.approx(2.25 / 3)
    assert s["time_total_s"] == pytest.approx(2.25)
    assert s["time_at_eval_total_s"] == pytest.approx(0.25)
    assert (s["passes"], s["start_passes"], s["start_clients"]) == (6, 3, 1)
    r2 = {5: _Reply({"ala_time_s": 1.0, "ala_passes": 4, "ala_start": 1, "ala_cached": 1})}
    c.aggregate(5, r2)
    assert s["next_round"] == 6
    assert s["time_s"] == pytest.approx(1.0) and s["time_s_mean"] == pytest.approx(1.0)
    assert s["time_total_s"] == pytest.approx(3.25)
    assert s["time_at_eval_total_s"] == pytest.approx(1.25)
    assert (s["passes"], s["start_passes"], s["start_clients"]) == (4, 7, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c.aggregate(6, {})
    assert s["time_s"] == 0.0 and s["time_s_mean"] == 0.0 and not math.isnan(s["time_s_mean"])
    assert s["time_total_s"] == pytest.approx(3.25) and s["passes"] == 0
    out = c.extra_metrics(6, True)
    assert out["base/rnd"] == 6 and out["base/final"] is True
    assert "ala/next_round" not in out and set(out) == {"base/rnd", "base/final"} | {f"ala/{k}" for k in STAT_KEYS}


# ---- ala_sample_indices --------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("mode", ["window", "subset"])
def test_sample_has_floor_s_percent_and_depends_only_on_the_generator(mode):
    n, s = 40, 30.0
    torch.manual_seed(0)
    a = ala.ala_sample_indices(n, s, mode, _gen(11))
    torch.manual_seed(12345)
    b = ala.ala_sample_indices(n, s, mode, _gen(11))
    assert torch.equal(a, b)
    assert len(a) == math.floor(s / 100 * n) == 12
    assert len(set(a.tolist())) == 12 and 0 <= int(a.min()) and int(a.max()) < n


def test_window_sample_is_contiguous_and_subset_sample_is_not_always():
    n, s = 50, 40.0
    contiguous = []
    for seed in range(6):
        w = ala.ala_sample_indices(n, s, "window", _gen(seed))
        assert torch.equal(w, torch.arange(int(w[0]), int(w[0]) + 20))
        sub = ala.ala_sample_indices(n, s, "subset", _gen(seed))
        contiguous.append(sorted(sub.tolist()) == list(range(min(sub.tolist()), min(sub.tolist()) + 20)))
    assert not all(contiguous)


# ---- upper_names ---------------------------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4),
                               torch.nn.ReLU(), torch.nn.Linear(4, 2))


ALL = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]


def test_upper_names_default_unit_counts_layers_and_nonpositive_p_means_all():
    m = _mlp()
    assert ala.upper_names(m, ALL, 1) == ["4.weight", "4.bias"]
    assert ala.upper_names(m, ALL, 2) == ALL[2:]
    for p in (0, -1, 3, 7):
        assert ala.upper_names(m, ALL, p) == ALL
        assert ala.upper_names(m, ALL, p, "units") == ALL


def test_upper_names_by_tensors_counts_only_the_given_names_from_the_top():
    m = _mlp()
    part = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert ala.upper_names(m, part, 1, "tensors") == ["2.bias"]
    assert ala.upper_names(m, part, 3, "tensors") == part[1:]
    for p in (0, -1, -2):
        assert ala.upper_names(m, part, p, "tensors") == part
