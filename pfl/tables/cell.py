"""A table's cell as a Ray Tune trainable (:func:`table_trainable`), in a module that imports nothing
heavy at its top.

Why it stands alone: Tune creates a trial's actor by unpickling the trainable, which imports the
function's module. Had that import pulled in torch and pfl (seconds on a small machine), a second
actor would still be starting when the first, reused by Tune for the next cell (``reuse_actors``),
finished its short cell; Tune then gives the waiting cell to the free actor and stops the starting
one, again and again, and a table of short cells runs on one actor while the others only import.
Here the actor is ready as soon as Ray's own modules are, and the heavy imports happen inside its
first cell.
"""

from __future__ import annotations

import json
from typing import Any

_DATA: dict[str, Any] = {}


def table_trainable(config: dict[str, Any], setup: dict[str, Any]) -> None:
    """One cell: the sweeps' trial of the cell's config, then its history reported once more."""
    import ray
    from ray import tune

    from ..callbacks import MLflowLogger
    from ..data import load_federated
    from ..schema import to_dict
    from ..tune.trainable import run_trial, trial_config
    from .hooks import HOOKS

    cell_setup = {**setup, "base": setup["cells"][int(config["cell"])]}
    cfg = trial_config({}, cell_setup)
    # a worker runs cell after cell (Tune reuses it): the rows of one seed share their data, as
    # the serial pipelines shared it; one data set is kept
    key = json.dumps([to_dict(cfg.data), cfg.seed], sort_keys=True, default=str)
    if key not in _DATA:
        _DATA.clear()
        _DATA[key] = load_federated(cfg.data, cfg.seed)
    columns = HOOKS.get(setup["trial_hook"])[1](cfg) if setup.get("trial_hook") else None
    loop = run_trial(cfg, cell_setup, steering=[columns] if columns else (), data=_DATA[key])
    sim = loop.sim
    table = getattr(sim, "last_client_table", None) or []
    record = {"history": sim.history, "summary": loop.summary, "data_load_s": sim.data_load_s,
              "test_n": sum(r.get("n_test", 0) for r in table if not r.get("newcomer", 0)),
              "node": ray.get_runtime_context().get_node_id()}
    if columns is not None:
        record["trial"] = columns.columns(loop)
    run_id = next((cb.run_id for cb in loop.callbacks if isinstance(cb, MLflowLogger)), None)
    tune.report({"round": sim.executed, "table/record": json.dumps(record, default=float),
                 "mlflow_run_id": run_id or ""})


__all__ = ["table_trainable"]
