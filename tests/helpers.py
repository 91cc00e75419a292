"""Shared helpers for the tests."""


def small_config(**overrides):
    """A fast digits experiment; keyword overrides use dotted keys with '__' for '.'."""
    from pfl.config import load

    base = {
        "data.source": "digits", "data.num_clients": 10, "data.partition.kind": "dirichlet",
        "data.partition.alpha": 0.5, "federation.rounds": 3, "federation.clients_per_round": 5,
        "federation.batch_size": 32, "federation.lr": 0.1, "tracking.enabled": False,
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load(None, base)
