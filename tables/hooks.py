"""What the tables' YAML cannot say: per-run measures and headlines, named by the table files
(``measure: hooks.py:fedala_measure``). A measure maps a run's summary (``final``: the run's last
values, ``history``: every round) to extra columns of its record; a headline maps the summary
rows (mean ± std over seeds, Δ to the reference) to numbers printed and logged on the parent run."""

NAN = float("nan")


def fedala_measure(summary) -> dict:
    """FedALA: the best evaluated round, the weighted accuracy (the paper's metric), ALA's cost and
    the seconds per round including the ALA work done during the previous evaluation."""
    history = summary.history
    evals = [h for h in history if "test/acc_mean" in h]
    last, rounds = history[-1], max(len(history), 1)
    best = max(evals, key=lambda h: h["test/acc_mean"]) if evals else {}
    return {
        "acc_best": best.get("test/acc_mean", NAN),
        "best_round": float(int(best["round"]) + 1) if best else NAN,
        "acc_weighted_last": evals[-1].get("test/acc_weighted", NAN) if evals else NAN,
        "global_acc_last": evals[-1].get("global/test_acc", NAN) if evals else NAN,
        "ala_time_per_round_s": last["ala/time_total_s"] / rounds if "ala/time_total_s" in last else NAN,
        "ala_start_passes": last.get("ala/start_passes", NAN),
        "s_per_round": (sum(h["time/round_s"] for h in history) + last.get("ala/time_at_eval_total_s", 0.0)) / rounds,
        "comm_total_MiB": last.get("comm/total_bytes", 0.0) / 2**20,
    }


def perfed_ckt_headline(summary: list[dict]) -> dict:
    """PerFed-CKT: its gain over Local on Dir(0.1), FedAvg's bytes over its own, and the clustered
    scenario's gain of k = #clusters over k = 1 (paired over seeds)."""
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
