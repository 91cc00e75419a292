"""tables/newcomers.yaml: FPFC's Table 3 — the newcomers' accuracy beside the paper's."""

from ..hooks import TrialColumns, table_hook

NAN = float("nan")

#: the paper's Table 3 (mean local test accuracy of the newcomers in %, std), docs/methods/fpfc.md §8
PAPER = {
    "local": {"s1": (79.00, 0.08), "fmnist_labelswap": (75.29, 0.06)},
    "fedavg": {"s1": (38.73, 0.29), "fmnist_labelswap": (66.26, 0.06)},
    "lg": {"s1": (66.22, 0.11), "fmnist_labelswap": (80.25, 0.07)},
    "perfedavg": {"s1": (43.26, 0.26), "fmnist_labelswap": (77.94, 0.06)},
    "ifca": {"s1": (33.57, 0.28), "fmnist_labelswap": (73.93, 0.10)},
    "cfl": {"s1": (69.43, 0.33), "fmnist_labelswap": (70.66, 0.07)},
    "pacfl": {"s1": (71.88, 0.30), "fmnist_labelswap": (66.42, 0.06)},
    "fpfc_l1": {"s1": (67.72, 0.10), "fmnist_labelswap": (75.54, 0.08)},
    "fpfc": {"s1": (79.31, 0.08), "fmnist_labelswap": (75.73, 0.07)},
}


@table_hook("trial", "newcomer_samples")
class NewcomerSamples(TrialColumns):
    """The test samples behind the newcomers' mean (their test splits), in place of the trained
    devices' count the table shows by default."""

    def columns(self, loop) -> dict:
        rows = getattr(loop.sim, "last_client_table", None) or []
        return {"test_n": float(sum(r.get("n_test", 0) for r in rows if r.get("newcomer", 0)))}


@table_hook("measure")
def newcomers(summary) -> dict:
    f = summary.final
    return {"join_bytes": f.get("comm/join_up_bytes", 0.0) + f.get("comm/join_down_bytes", 0.0)}


@table_hook("records", "newcomers_paper")
def paper_columns(records: list[dict]) -> list[dict]:
    """The paper's number of each row and the difference to it, per run (so both get mean ± std)."""
    for rec in records:
        paper = PAPER.get(rec["row"], {}).get(rec["group"])
        rec["paper_acc"] = paper[0] / 100 if paper else NAN
        rec["paper_delta"] = rec.get("final", NAN) - rec["paper_acc"]
    return records
