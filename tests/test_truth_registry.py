"""The method registry against what it must hold: every method module imported (and only those), a
class registered under its name, a plug-in composed with any base under ``base+plugin``, and the
errors that name the field and the allowed values. The registry runs at import time, so these tests
call its functions again themselves (issue 42: its mutants had no test that ran them)."""

from __future__ import annotations

from pathlib import Path

import pytest

import pfl.methods as methods
from pfl.methods import METHODS, PLUGINS, get_method, register, register_plugin
from pfl.methods.fedavg import FedAvg
from pfl.schema import ConfigError


@pytest.fixture
def restored():
    """The registries as they were after the test (entries it registered forgotten)."""
    before, plugins = METHODS.snapshot(), PLUGINS.snapshot()
    yield
    METHODS.restore(before)
    PLUGINS.restore(plugins)


def test_load_all_imports_every_module_of_the_package_but_base(monkeypatch):
    package = Path(methods.__file__).parent
    expected = {f"pfl.methods.{p.stem}" for p in package.glob("*.py") if p.stem not in ("__init__", "base")}
    expected |= {f"pfl.methods.{p.parent.name}" for p in package.glob("*/__init__.py")}
    imported: list[str] = []

    class Recorder:
        @staticmethod
        def import_module(name):
            imported.append(name)

    monkeypatch.setattr(methods, "importlib", Recorder)
    methods._load_all()
    assert sorted(imported) == sorted(expected) and len(imported) == len(set(imported))


def test_register_keeps_a_class_under_its_name_and_refuses_a_nameless_one(restored):
    class Probe(FedAvg):
        name = "probe_registry_method"

    assert register(Probe) is Probe
    assert get_method("probe_registry_method") is Probe and "probe_registry_method" in METHODS.names()

    class Nameless(FedAvg):
        name = ""

    with pytest.raises(ValueError, match="Nameless has no name"):
        register(Nameless)
    assert "" not in METHODS.names()


def test_a_plugin_composes_with_any_base_under_its_name_and_may_be_registered_again(restored):
    made: list[type] = []

    def compose(base):
        cls = type(f"{base.__name__}Probe", (base,), {})
        made.append(cls)
        return cls

    register_plugin("probe", compose)
    cls = get_method("fedavg+probe")
    assert cls is made[-1] and issubclass(cls, FedAvg) and cls.name == "fedavg+probe"
    assert get_method("ditto+probe").name == "ditto+probe" and issubclass(get_method("ditto+probe"),
                                                                          get_method("ditto"))
    register_plugin("probe", lambda base: type("Again", (base,), {}))   # a plug-in file loaded twice
    assert get_method("fedprox+probe").__name__ == "Again"


def test_composed_names_that_do_not_resolve_name_the_field_and_the_allowed_values(restored):
    register_plugin("probe", lambda base: type("P", (base,), {}))
    with pytest.raises(ConfigError) as err:
        get_method("nosuchbase+probe")
    text = str(err.value)
    assert err.value.field == "method.name" and "unknown base method 'nosuchbase' in 'nosuchbase+probe'" in text
    assert f"allowed: {', '.join(METHODS.names())}" in text
    with pytest.raises(ConfigError) as err:
        get_method("fedavg+nosuchplugin")
    assert err.value.field == "method.name"
    assert f"unknown plugin 'nosuchplugin' in 'fedavg+nosuchplugin'; allowed: {', '.join(PLUGINS.names())}" \
        in str(err.value)
    with pytest.raises(ConfigError) as err:      # the first '+' splits: base fedavg, plug-in 'probe+ala'
        get_method("fedavg+probe+ala")
    assert "unknown plugin 'probe+ala'" in str(err.value)


def test_a_composed_name_without_any_plugin_registered_says_none_are(restored):
    PLUGINS.restore({})
    with pytest.raises(ConfigError) as err:
        get_method("fedavg+probe_unregistered")   # a name no test composed (composed names are kept)
    assert str(err.value).endswith("unknown plugin 'probe_unregistered' in 'fedavg+probe_unregistered'; allowed: (none)")
