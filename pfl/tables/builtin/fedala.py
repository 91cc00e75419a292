"""tables/fedala.yaml: the columns of FedALA's measurement table."""

from ..hooks import table_hook

NAN = float("nan")


@table_hook("measure")
def fedala(summary) -> dict:
    """The best evaluated round, the weighted accuracy (the paper's metric), ALA's cost and the
    seconds per round including the ALA work done during the previous evaluation."""
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
