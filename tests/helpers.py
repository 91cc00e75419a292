"""Shared helpers for the tests."""


def small_config(**overrides):
    """A fast digits experiment; keyword overrides use dotted keys with '__' for '.'."""
    from pfl.config import load

    base = {
        "data.source": "digits", "data.num_clients": 10, "data.partition.kind": "dirichlet",
        "data.partition.alpha": 0.5, "federation.rounds": 3, "federation.clients_per_round": 5,
        "federation.batch_size": 32, "federation.lr": 0.1, "federation.local_epochs": 1,
        "tracking.enabled": False,
    }
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load(None, base)


def straight_and_resumed(cfg, ckpt_dir, stop_at: int = 2, simulator=None):
    """Two finished simulators of ``cfg``: one run straight through, one stopped after round
    ``stop_at``, checkpointed, loaded into a fresh simulator and run to the end."""
    if simulator is None:
        from pfl.federation.simulator import Simulator as simulator

    straight = simulator(cfg)
    straight.run()
    first = simulator(cfg)
    first.run(until=stop_at)
    first.save(ckpt_dir / "ckpt.pt")
    resumed = simulator(cfg)
    resumed.load(ckpt_dir / "ckpt.pt")
    assert resumed.round == stop_at
    resumed.run()
    return straight, resumed
