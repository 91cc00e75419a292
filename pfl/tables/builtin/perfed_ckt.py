"""tables/perfed_ckt.yaml: the headline of PerFed-CKT's table."""

from ..hooks import table_hook

NAN = float("nan")


@table_hook("headline")
def perfed_ckt(summary: list[dict]) -> dict:
    """Its gain over Local on Dir(0.1), FedAvg's bytes over its own, and the clustered scenario's gain
    of k = #clusters over k = 1 (paired over seeds)."""
    def first(group: str, start: str):
        return next((r for r in summary if r["group"] == group and r["row"].startswith(start)), None)

    ckt, fedavg = first("dir01", "PerFed-CKT k=2"), first("dir01", "FedAvg")
    clustered = [r for r in summary if r["group"] != "dir01" and r["row"].startswith("PerFed-CKT")]
    out = {}
    if ckt:
        out.update({"dir01/ckt_minus_local_mean": ckt["delta_mean"], "dir01/ckt_minus_local_std": ckt["delta_std"],
                    "dir01/public_overlap": ckt["public_overlap_mean"]})
    if ckt and fedavg:
        out["comm/fedavg_over_ckt"] = fedavg["bytes_mean"] / ckt["bytes_mean"]
    k_true = next((r for r in clustered if "no clustering" not in r["row"]), None)
    k_one = next((r for r in clustered if "no clustering" in r["row"]), None)
    if k_true and k_one:
        diffs = [k_true["values"][s] - k_one["values"][s] for s in k_true["values"] if s in k_one["values"]]
        out["clustered/k_true_minus_k1_mean"] = sum(diffs) / len(diffs) if diffs else NAN
        out["clustered/k_true_minus_local_mean"] = k_true["delta_mean"]
    return out
