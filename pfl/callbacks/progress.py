"""One console line per evaluation round: accuracy, clusters, loss, traffic, speed."""

from __future__ import annotations

from typing import Callable

from ..federation.loop import Callback, LoopResult


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def progress_line(m: dict[str, float], total_rounds: int | None) -> str:
    done = int(m["round"]) + 1
    parts = [f"round {done:>4}/{total_rounds}" if total_rounds else f"round {done:>4}"]
    for key, label in (("test/acc_mean", "test acc"), ("val/acc_mean", "val acc"),
                       ("global/test_acc", "global acc"), ("test/rmse_mean", "test rmse"),
                       ("cluster/num", "clusters"), ("cluster/ari", "ARI"), ("train/loss", "loss")):
        if key in m:
            value = m[key]
            parts.append(f"{label} {value:.0f}" if key == "cluster/num" else f"{label} {value:.4f}")
    parts.append(f"up {format_bytes(m.get('comm/up_bytes', 0))} down {format_bytes(m.get('comm/down_bytes', 0))}")
    parts.append(f"{m.get('time/round_s', 0):.2f} s/round")
    return " | ".join(parts)


class ProgressPrinter(Callback):
    def __init__(self, write: Callable[[str], None] = print, total_rounds: int | None = None):
        self.write = write
        self.total_rounds = total_rounds

    def on_round(self, loop, metrics: dict[str, float]) -> None:
        if "val/loss_mean" in metrics or "test/loss_mean" in metrics:
            total = self.total_rounds if self.total_rounds is not None else loop.sim.cfg.federation.rounds
            self.write(progress_line(metrics, total))

    def on_end(self, loop, result: LoopResult) -> None:
        if result.status == "FAILED" and result.clean:
            self.write(f"diverged: {result.reason}")
