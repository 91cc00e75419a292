"""tables/fpfc_s1.yaml, tables/fpfc_labelswap.yaml: FPFC's read-outs beside the accuracy."""

from ..hooks import TrialColumns, table_hook


@table_hook("trial", "fpfc_readout")
class FPFCReadout(TrialColumns):
    """For FPFC and FPFC-L1 rows: the largest within- and smallest between-cluster ‖θ_ij‖ (any ν
    between them recovers the true clusters, docs/methods/fpfc.md §11); for FPFC-L1 also the read-out
    at the ν halfway between, its clusters, ARI and accuracy (its README ν = 4 need not be there)."""

    def columns(self, loop) -> dict:
        return readout(loop.sim)


def readout(sim) -> dict:
    from ...clusters import cluster_metrics

    method = sim.method
    if not hasattr(method, "theta_gap"):
        return {}
    gap = method.theta_gap()
    if "fpfc/theta_max_within" not in gap or "fpfc/theta_min_between" not in gap:
        return {}
    lo, hi = gap["fpfc/theta_max_within"], gap["fpfc/theta_min_between"]
    out = {"theta_max_within": lo, "theta_min_between": hi}
    if sim.cfg.method.name == "fpfc_l1":
        nu = (lo + hi) / 2
        labels = method.clusters(nu)
        found = cluster_metrics(labels, method.ctx.meta.true_clusters)
        acc = sim.evaluate_models(method.readout_params(labels), "fpfc/readout").get("fpfc/readout_acc", float("nan"))
        out.update(l1_nu=nu, l1_clusters=found.get("cluster/num", float("nan")),
                   l1_ari=found.get("cluster/ari", float("nan")), l1_readout_acc=acc)
    return out
