"""tables/compression.yaml: the columns that compare a compressed run with its uncompressed one.

Per seed (paired: same data, start and sampling), each row against its group's reference row (the
same method uncompressed; FedAvg's for the seminar's methods): the ratio of its uplink and of its
uplink + downlink bytes, and the bytes at its first evaluation that reached the target accuracy —
95 % of the final accuracy of that seed's uncompressed FedAvg on Fashion-MNIST and FPFC on S1, or one
fixed target (``pipelines/compression_table.py --target ACC``, which sets ``PFL_COMPRESSION_TARGET``).
"""

from __future__ import annotations

import os

from ..hooks import table_hook

NAN = float("nan")
TARGET_ENV = "PFL_COMPRESSION_TARGET"
#: group → its reference row (the table's ``reference``) and the row whose accuracy sets its target
REFERENCE = {"fmnist_dir05": "fedavg/none", "fmnist_dir05 scaffold": "scaffold/none", "fpfc_s1": "fpfc/none"}
TARGET_ROW = {"fmnist_dir05": "fedavg/none", "fmnist_dir05 scaffold": "fedavg/none", "fpfc_s1": "fpfc/none"}


@table_hook("measure", "compression_curve")
def curve(summary) -> dict:
    """(cumulative uplink + downlink bytes, test accuracy) at every evaluation."""
    return {"curve": [[h["comm/total_bytes"], h["test/acc_mean"]] for h in summary.history if "test/acc_mean" in h]}


def bytes_to_target(points, target: float) -> float:
    for total, acc in points:
        if acc >= target:
            return float(total)
    return NAN


def _ratio(a: float, b: float) -> float:
    return a / b if b == b and b else NAN


@table_hook("records", "compression")
def compression(records: list[dict]) -> list[dict]:
    """Each finished record gets ``up_ratio``, ``total_ratio`` and its inverse ``total_factor``,
    ``target`` and ``to_target`` (the curves are dropped: they are in the cells' MLflow runs)."""
    fixed = os.environ.get(TARGET_ENV)
    by = {(r["row"], r["seed"]): r for r in records if r["status"] == "FINISHED"}
    for rec in records:
        points = rec.pop("curve", [])
        if rec["status"] != "FINISHED":
            continue
        base = by.get((REFERENCE.get(rec["group"], ""), rec["seed"]))
        rec["up_ratio"] = _ratio(rec["up_bytes"], base["up_bytes"]) if base else NAN
        rec["total_ratio"] = _ratio(rec["total_bytes"], base["total_bytes"]) if base else NAN
        rec["total_factor"] = 1 / rec["total_ratio"] if rec["total_ratio"] == rec["total_ratio"] and \
            rec["total_ratio"] else NAN
        ref = by.get((TARGET_ROW.get(rec["group"], ""), rec["seed"]))
        rec["target"] = float(fixed) if fixed else 0.95 * ref["final"] if ref else NAN
        rec["to_target"] = bytes_to_target(points, rec["target"])
    return records
