"""Who takes part, and who is summarised: members, newcomers and malicious clients.

The run's clients are fixed at the start from its seed: the newcomers (``newcomers.*``,
:mod:`.newcomers`) are held out of sampling and evaluation until they join after the last round;
the malicious clients (``attack.*``, :mod:`.attacks`) train and are evaluated like the others, but
the evaluation summary (``test/*``, ``val/*``, ``global/*``) is over the benign members, and the
per-client table marks both kinds.

With ``federation.eval_clients``, the evaluations before the last cover a fixed sample of the
members (drawn once from the run's seed, so every evaluation and a resumed run see the same
clients); the final evaluation covers everyone.
"""

from __future__ import annotations

from pathlib import Path

from .attacks import malicious_clients
from .context import RunContext


class Population:
    def __init__(self, ctx: RunContext, client_ids: list[str] | None = None):
        self.ctx = ctx
        self.client_ids = client_ids  # a natural partition's own id of each client (file sources)
        self.malicious: frozenset[int] = frozenset(malicious_clients(ctx.cfg, ctx.num_clients))
        self.newcomers: frozenset[int] = frozenset(ctx.newcomers)
        self._eval_sample: list[int] | None = None
        self._members: list[int] | None = None

    def sample(self, rnd: int) -> list[int]:
        """The clients of round ``rnd``: ``clients_per_round`` of the members (newcomers never)."""
        k = self.ctx.cfg.federation.clients_per_round
        m = self.ctx.num_members
        if k == 0 or k >= m:
            return self.ctx.members
        picks = self.ctx.rng(rnd, "sample").choice(m, size=k, replace=False)
        if self.newcomers:  # position i among the members; without newcomers member i is client i
            if self._members is None:
                self._members = self.ctx.members
            return sorted(self._members[int(i)] for i in picks)
        return sorted(int(i) for i in picks)  # O(k): no list of a 100,000-client population a round

    def evaluated(self, joined: bool, final: bool = True) -> list[int]:
        """The clients evaluated now: the members, and the newcomers once they have joined; before
        the final evaluation, the ``federation.eval_clients`` sample of the members when one is set."""
        if joined:
            return list(range(self.ctx.num_clients))
        x = self.ctx.cfg.federation.eval_clients
        if final or not x:
            return self.ctx.members
        if self._eval_sample is None:
            members = self.ctx.members
            k = min(len(members), max(1, round(x * len(members))) if x < 1 else int(x))
            picked = self.ctx.rng("eval_clients").choice(len(members), size=k, replace=False)
            self._eval_sample = sorted(members[int(i)] for i in picked)
        return self._eval_sample

    def summary_rows(self, rows: list[dict]) -> list[dict]:
        """The rows the evaluation summary is over: benign members."""
        if not self.malicious and not self.newcomers:
            return rows
        return [r for r in rows if not r.get("malicious") and not r.get("newcomer")]

    def mark(self, row: dict) -> dict:
        """A client's evaluation row with its own id (natural partitions of file sources) and its
        ``malicious`` / ``newcomer`` columns (when the run has any)."""
        if self.client_ids is not None:
            row["client_id"] = self.client_ids[row["client"]]
        if self.malicious:
            row["malicious"] = int(row["client"] in self.malicious)
        if self.newcomers:
            row["newcomer"] = int(row["client"] in self.newcomers)
        return row

    def artifacts(self, outdir: str | Path) -> list[Path]:
        """``attack_malicious.csv`` (the malicious ids) and ``newcomers.csv`` (the newcomer ids) when
        there are any."""
        out = []
        true = self.ctx.meta.true_clusters
        listed = (("attack_malicious.csv", sorted(self.malicious)), ("newcomers.csv", list(self.ctx.newcomers)))
        for name, ids in listed:
            if ids:
                path = Path(outdir) / name
                lines = ["client,true_cluster,n_train"] + [
                    f"{c},{-1 if true is None else int(true[c])},{self.ctx.meta.client_sizes[c]}" for c in ids]
                path.write_text("\n".join(lines) + "\n")
                out.append(path)
        return out


__all__ = ["Population"]
