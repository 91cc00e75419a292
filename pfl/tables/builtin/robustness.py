"""tables/robustness.yaml: FPFC's robustness experiment (paper §6.4.1, Fig. 7, App. E.2).

A row's group is ``SCENARIO|ATTACK|FRACTION`` (``SCENARIO|none|0``: the clean run). The number
compared is the benign devices' test accuracy averaged over the evaluations of the last quarter of
the rounds (a poisoned global model is a new random model every round, so one evaluation is one
draw), and the drop from the clean run is like for like: the clean run's accuracy on the same benign
devices, since which devices are left out changes the mean by itself.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...seeds import MARK, fmt
from ..hooks import TrialColumns, table_hook

TAIL = 0.25
NAN = float("nan")


@table_hook("trial", "tail_accuracy")
class TailAccuracy(TrialColumns):
    """Every client's test accuracy at each evaluation in the last quarter of the rounds, and which
    clients are benign."""

    key = "tail_accuracy"

    def __init__(self, cfg):
        super().__init__(cfg)
        rounds = cfg.federation.rounds
        self.first_step = rounds - max(1, round(TAIL * rounds))  # the last evaluation at least
        self.tables: list[dict[int, float]] = []

    def on_round(self, loop, metrics: dict) -> None:
        if metrics["step"] > self.first_step and "test/acc_mean" in metrics:
            self.tables.append({int(r["client"]): float(r["test_acc"]) for r in loop.sim.last_client_table})

    def state_dict(self):
        return self.tables

    def load_state_dict(self, state) -> None:
        self.tables = [{int(k): v for k, v in t.items()} for t in state]

    def columns(self, loop) -> dict:
        from ...federation.attacks import malicious_clients

        n = loop.sim.data.num_clients
        benign = sorted(set(range(n)) - set(malicious_clients(self.cfg, n)))
        return {"tail": self.tables, "benign": benign, "benign_acc": mean_over(self.tables, benign),
                "benign_clients": float(len(benign)),
                "diverged": float(any(h.get("attack/diverged") for h in loop.sim.history))}


def mean_over(tables, clients) -> float:
    """Mean over the tail's evaluations of the mean accuracy of ``clients``."""
    per_eval = [np.mean([t[c] for c in clients if c in t]) for t in tables if any(c in t for c in clients)]
    return float(np.mean(per_eval)) if per_eval else NAN


@table_hook("records", "robustness_drop")
def like_for_like(records: list[dict]) -> list[dict]:
    """Each run's clean reference on its own benign devices, and the drop from it."""
    for rec in records:   # JSON made the client ids strings
        rec["tail"] = [{int(k): v for k, v in t.items()} for t in rec.get("tail", [])]
    clean = {(r["group"].split("|")[0], r["row"], r["seed"]): r for r in records if r["group"].endswith("|none|0")}
    for rec in records:
        ref = clean.get((rec["group"].split("|")[0], rec["row"], rec["seed"]))
        same = mean_over(ref["tail"], rec.get("benign", [])) if ref and rec.get("benign") else NAN
        rec["clean_same_devices"], rec["drop"] = same, same - rec.get("benign_acc", NAN)
    for rec in records:
        rec.pop("tail", None)
        rec.pop("benign", None)
    return records


def _cells(summary: list[dict]) -> dict[tuple[str, str, str, float], dict]:
    out = {}
    for r in summary:
        scenario, attack, fraction = r["group"].split("|")
        out[(scenario, r["row"], attack, float(fraction))] = r
    return out


@table_hook("report", "robustness_grid")
def report(summary: list[dict], cells, out: Path) -> tuple[str, list[Path]]:
    """Per scenario, methods × (clean, attack × fraction) with ★ (the best of a column) and ≈ (within
    its spread); the largest drop of each method; one plot per attack (a panel per scenario)."""
    by = _cells(summary)
    scenarios = list(dict.fromkeys(k[0] for k in by))
    methods = list(dict.fromkeys(k[1] for k in by))
    attacks = [a for a in dict.fromkeys(k[2] for k in by) if a != "none"]
    fractions = sorted({k[3] for k in by})
    cols = [("none", 0.0)] * (0.0 in fractions) + [(a, f) for a in attacks for f in fractions if f > 0]
    lines = []
    for scenario in scenarios:
        lines += [f"\n{scenario}: benign test accuracy (%), mean ± std over the seeds",
                  "| method | " + " | ".join("clean" if f == 0 else f"{a} {f:g}" for a, f in cols) + " |",
                  "|" + "---|" * (len(cols) + 1)]
        for m in methods:
            row = []
            for a, f in cols:
                c = by.get((scenario, m, a, f))
                mark = {"ref": " ★", MARK: f" {MARK}"}.get((c or {}).get("mark", ""), "")
                row.append("–" if c is None else fmt(c["benign_acc_mean"], c["benign_acc_std"], 100.0) + mark)
            lines.append(f"| {m} | " + " | ".join(row) + " |")
    lines += [f"\n★ the best method of a column; {MARK} within the spread of the best: the grid does not "
              "separate the two.", "\nLargest drop from the clean run's accuracy on the same benign devices:"]
    for scenario in scenarios:
        for m in methods:
            clean = by.get((scenario, m, "none", 0.0), {}).get("benign_acc_mean", NAN)
            attacked = [(k[3], k[2], c) for k, c in by.items() if k[0] == scenario and k[1] == m and k[3] > 0
                        and c.get("drop_mean", NAN) == c.get("drop_mean", NAN)]
            parts = []
            for limit, what in ((0.4, "≤ 0.4"), (1.0, "all")):
                cands = [(c["drop_mean"], a, f, c["drop_std"]) for f, a, c in attacked if f <= limit]
                if cands:
                    d, a, f, sd = max(cands, key=lambda t: t[0])
                    parts.append(f"{what}: {fmt(d, sd, 100.0, 1)} pt ({a} {f:g})")
            if parts:
                lines.append(f"- {scenario} {m}: clean {100 * clean:.2f} %, largest drop " + "; ".join(parts))
    return "\n".join(lines), [_plot(by, a, scenarios, methods, fractions, out) for a in attacks]


def _plot(by: dict, attack: str, scenarios: list[str], methods: list[str], fractions: list[float], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.2 * len(scenarios), 4.0), dpi=100, squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for m in methods:
            ys = [by.get((scenario, m, "none" if f == 0 else attack, f), {}).get("benign_acc_mean", NAN)
                  for f in fractions]
            if any(y == y for y in ys):
                ax.plot(fractions, [100 * y for y in ys], marker="o", label=m)
        ax.set(title=f"{scenario}: {attack}", xlabel="fraction of malicious devices",
               ylabel="benign test accuracy (%), mean over seeds")
        ax.grid(alpha=0.3)
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path = out / f"benign_acc_vs_fraction_{attack}.png"
    fig.savefig(path)
    plt.close(fig)
    return path
