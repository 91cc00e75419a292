"""The λ schedule's choices (pfl/tune/lambda_path.py) on a stub whose *training* is a formula.

The schedule under test is the real one (``LambdaPath`` in the round loop, with its convergence
rule, decline, grid extension and playoff); only the simulator is replaced: a model is the list of
λ values its lineage trained with, and its validation accuracy a formula of that list, so each test
knows the right answer without running the schedule's logic itself.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest

from pfl.schema import ConfigError
from pfl.tune.lambda_path import LambdaPath, PathSettings, converged, separate_run, warmup_path


@dataclasses.dataclass
class Hp:
    lam: float = 1.0


class StubSim:
    """The simulator's interface as the schedule uses it; training appends λ to the lineage.

    ``acc(rounds, lam, seed)``: validation accuracy after ``rounds`` lineage rounds, the latest
    ones at ``lam``. Test accuracy is validation − 0.01, its 10th percentile validation − 0.1.
    ``task="regression"`` reports only ``val/rmse_mean`` = 1 − accuracy (and the test RMSE).
    """

    def __init__(self, acc, seed: int = 0, task: str = "classification"):
        self.acc, self.seed = acc, seed
        self.cfg = SimpleNamespace(data=SimpleNamespace(val_fraction=0.2), attack=SimpleNamespace(kind="none"),
                                   federation=SimpleNamespace(rounds=10**9))
        self.data = SimpleNamespace(task=task)
        self.method = SimpleNamespace(hp=Hp())
        self.round = self.executed = 0
        self.elapsed = 0.0
        self.lineage: list[float] = []
        self.max_lineage = 0
        self.evaluations = 0

    def set_hparams(self, hp):
        self.method.hp = hp

    def snapshot(self):
        return {"round": self.round, "lineage": list(self.lineage)}

    def restore(self, snap):
        self.round, self.lineage = snap["round"], list(snap["lineage"])

    def run_round(self, evaluate=None):
        self.lineage.append(self.method.hp.lam)
        self.round += 1
        self.executed += 1
        self.elapsed += 1.0
        self.max_lineage = max(self.max_lineage, self.round)
        metrics = {"round": float(self.round - 1), "step": float(self.executed), "train/loss": 1.0}
        if evaluate:
            metrics.update(self.evaluate())
        return metrics

    def evaluate(self, final=False):
        self.evaluations += 1
        a = self.acc(self.round, self.lineage[-1] if self.lineage else 0.0, self.seed)
        if self.data.task == "regression":
            return {"val/rmse_mean": 1.0 - a, "test/rmse_mean": 1.01 - a}
        return {"val/acc_mean": a, "test/acc_mean": a - 0.01, "test/acc_p10": a - 0.1}

    def join_newcomers(self):
        return {}


def noise(seed: int, rounds: int, lam: float, sigma: float = 0.002) -> float:
    """Evaluation noise, a fixed function of the model (the same model always scores the same)."""
    return float(np.random.default_rng([seed, rounds, int(round(lam * 1000))]).normal(0.0, sigma))


def rise(rounds: int) -> float:
    """Accuracy that keeps growing with training: still +0.5 pt per 100 rounds after 300 rounds."""
    return 0.5 + 0.3 * (1.0 - math.exp(-rounds / 150.0))


SETTINGS = dict(lambdas=[0.4, 0.6, 0.8, 1.0, 1.2], tolerance=1e-3, window=3, eval_every=10, stage_cap=1000,
                patience=2, finalists=3, playoff_rounds=50, budget=5000)


def test_the_convergence_rule_on_hand_worked_scores():
    assert not converged([0.5, 0.6, 0.7], window=3, tolerance=1e-3)           # no score before the window
    assert converged([0.5, 0.6, 0.6005, 0.6009], window=2, tolerance=1e-3)   # +0.0009 over the best before
    assert not converged([0.5, 0.6, 0.6005, 0.6011], window=2, tolerance=1e-3)  # +0.0011
    # a dip does not end a segment early: the best of the window counts, not its last value
    assert not converged([0.5, 0.6, 0.59, 0.62], window=2, tolerance=1e-3)
    assert converged([0.6, 0.5, 0.55, 0.6], window=3, tolerance=0.0)


def test_path_selects_the_middle_lambda_where_accuracy_peaks_though_it_grows_with_rounds():
    # accuracy grows with the rounds trained and peaks at λ = 0.8 (by 0.8 pt per grid step); a
    # rule that compares stages by how far training has come picks the path's last λ instead
    def acc(rounds, lam, seed):
        return rise(rounds) + 0.02 - 0.04 * abs(lam - 0.8) + noise(seed, rounds, lam)

    for seed in range(6):
        sim = StubSim(acc, seed)
        result = warmup_path(sim, PathSettings(**SETTINGS))
        assert result.best_lambda == 0.8, (seed, [(s["lambda"], s["rounds"]) for s in result.stages])
        visited = [s["lambda"] for s in result.stages]
        assert visited[:3] == [0.4, 0.6, 0.8] and 1.0 in visited       # walked past the peak: the decline
        assert result.extra["summary"]["fpfc/decline_reached"] == 1.0
        # the finalists were compared at the same lineage rounds
        assert len({m["lineage"] for m in result.extra["playoff"]}) == 1
        assert sim.method.hp.lam == 0.8 and sim.lineage[-1] == 0.8


def test_lambda_independent_accuracy_does_not_systematically_select_the_last_lambda():
    def acc(rounds, lam, seed):
        return rise(rounds) + noise(seed, rounds, lam)

    picks, lasts = [], []
    for seed in range(12):
        result = warmup_path(StubSim(acc, seed), PathSettings(**SETTINGS))
        picks.append(result.best_lambda)
        lasts.append(result.stages[-1]["lambda"])
    hits = sum(p == last for p, last in zip(picks, lasts))
    # the finalists meet at equal training, so the noise decides among them (about 1 in 3 each)
    assert hits <= 7 and len(set(picks)) >= 2, list(zip(picks, lasts))


def test_the_path_extends_the_grid_until_accuracy_declines():
    def acc(rounds, lam, seed):   # the peak λ = 1.6 lies past the grid's end (1.2)
        return rise(rounds) + 0.02 - 0.04 * abs(lam - 1.6) + noise(seed, rounds, lam)

    step = {**SETTINGS, "extension": "step"}
    result = warmup_path(StubSim(acc), PathSettings(**{**step, "extend": 4}))
    assert [s["lambda"] for s in result.stages] == [0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0]
    assert result.best_lambda == 1.6
    summary = result.extra["summary"]
    assert summary["fpfc/grid_extended"] == 4 and summary["fpfc/decline_reached"] == 1
    assert summary["fpfc/path_end"] == 0 and result.extra["path_end"] == "decline"
    # the limit reached before the decline: the path says so
    short = warmup_path(StubSim(acc), PathSettings(**{**step, "extend": 1}))
    assert [s["lambda"] for s in short.stages][-1] == 1.4 and short.best_lambda == 1.4
    assert short.extra["summary"]["fpfc/decline_reached"] == 0
    assert short.extra["summary"]["fpfc/path_end"] == 1 and short.extra["path_end"] == "extension limit"
    # geometric: × 1.2 / 1.0 per λ past the end (0.4 → 0.6 → 0.8 … is a step of 0.2, the last ratio 1.2)
    geo = warmup_path(StubSim(acc), PathSettings(**{**SETTINGS, "extension": "geometric", "extend": 2}))
    assert [s["lambda"] for s in geo.stages][5:] == [1.44, 1.728]


def test_segments_end_on_convergence_and_separate_runs_are_not_a_fixed_budget():
    def acc(rounds, lam, seed):   # settles after about 300 rounds, whatever λ
        return 0.9 - 0.4 * math.exp(-rounds / 40.0)

    settings = PathSettings(**{**SETTINGS, "budget": 2000})
    stage = separate_run(StubSim(acc), 0.6, settings)
    assert stage["converged"] == 1 and stage["rounds"] < 400
    # the last 30 rounds gain 0.4·e^(−t/40)·(e^(30/40) − 1) ≤ 1e-3
    # once t ≥ 40·ln(400·(e^0.75 − 1)) = 244.1
    first = math.ceil(40 * math.log(400 * (math.exp(0.75) - 1)) / 10) * 10
    assert stage["rounds"] == first == 250
    never = separate_run(StubSim(lambda r, lam, s: r / 1e4), 0.6, settings)   # +0.1 pt per 10 rounds
    assert never["converged"] == 0 and never["rounds"] == 2000              # capped at the budget


def test_min_stage_rounds_is_honoured_and_a_value_without_effect_refused():
    def flat(rounds, lam, seed):
        return 0.7

    base = {**SETTINGS, "lambdas": [0.4, 0.6], "finalists": 1, "window": 2, "extend": 0}
    result = warmup_path(StubSim(flat), PathSettings(**base))
    assert [s["rounds"] for s in result.stages] == [30, 30]           # the rule's own minimum: 3 evaluations
    result = warmup_path(StubSim(flat), PathSettings(**{**base, "min_stage_rounds": 55}))
    assert [s["rounds"] for s in result.stages] == [60, 60]           # the first evaluation at ≥ 55 rounds
    from pfl.schema import from_dict

    with pytest.raises(ConfigError) as err:                            # 20 < (2 + 1) × 10: no effect
        from_dict(PathSettings, {**base, "min_stage_rounds": 20}, "pipeline")
    assert err.value.field == "pipeline.min_stage_rounds" and "30" in str(err.value)


def test_the_budget_holds_and_every_reported_metric_is_the_selected_models():
    # the path outruns the budget (stages capped at 100 rounds, budget 250); the playoff's last
    # match is not the winner's, so the last evaluated model is another finalist's
    def acc(rounds, lam, seed):
        return 0.6 + 0.1 * (lam == 0.8) + rounds / 1e3

    settings = PathSettings(lambdas=[0.4, 0.6, 0.8, 1.0], tolerance=1e-3, window=3, eval_every=10, stage_cap=100,
                            patience=5, finalists=2, playoff_rounds=40, budget=250)
    sim = StubSim(acc)
    lineages = []
    result = warmup_path(sim, settings, on_round=lambda m: lineages.append((sim.round, sim.method.hp.lam)))
    assert [s["lambda"] for s in result.stages] == [0.4, 0.6, 0.8]         # the third stage ends at 250
    assert [s["lineage"] for s in result.stages] == [100, 200, 250]
    # latest first: 0.8 is already at the playoff's total (the budget), 0.6 continues 200 -> 250
    assert [(m["lambda"], m["rounds"]) for m in result.extra["playoff"]] == [(0.8, 0), (0.6, 50)]
    # no path or playoff round past the budget's lineage; then the winner, 50 rounds at λ 0.8 so far,
    # trains (never converging) until it has had the budget's 250 rounds at its λ, like a separate run
    assert max(r for r, _ in lineages[:300]) == 250
    assert result.best_lambda == 0.8 and sim.round == 250 + 200 and sim.lineage[-201:] == [0.8] * 201
    summary = result.extra["summary"]
    expected = acc(450, 0.8, 0)                                            # the last match's model: acc(250, 0.6)
    assert summary["val/acc_mean"] == pytest.approx(expected)
    assert summary["test/acc_p10"] == pytest.approx(expected - 0.1)
    assert result.final["test/acc_mean"] == pytest.approx(expected - 0.01) and result.final["end"] == "budget"
    assert summary["fpfc/budget_reached"] == 1 and summary["fpfc/final_rounds"] == 200
    assert result.total_rounds == summary["fpfc/total_rounds"] == sim.executed == 250 + 50 + 200


def test_a_regression_source_chooses_by_rmse_and_stops():
    def acc(rounds, lam, seed):
        return rise(rounds) + 0.02 - 0.04 * abs(lam - 0.6) + noise(seed, rounds, lam)

    sim = StubSim(acc, task="regression")
    result = warmup_path(sim, PathSettings(**{**SETTINGS, "budget": 3000}))
    assert result.best_lambda == 0.6 and sim.executed < 3000 * 2
    assert "val/rmse_mean" in result.final and "val/acc_mean" not in result.final
    assert "val/rmse_mean" in result.stages[0]


def test_an_evaluation_without_the_selection_metric_fails_instead_of_looping():
    class NoVal(StubSim):
        def evaluate(self, final=False):
            return {"test/acc_mean": 0.5}

    with pytest.raises(RuntimeError, match="val/acc_mean"):
        warmup_path(NoVal(lambda r, lam, s: 0.5), PathSettings(**SETTINGS))


def test_the_path_resumes_from_its_state_dict_and_ends_as_the_straight_run():
    from pfl.federation.loop import Callback, RoundLoop

    def acc(rounds, lam, seed):
        return rise(rounds) + 0.02 - 0.04 * abs(lam - 0.8) + noise(seed, rounds, lam)

    settings = PathSettings(**SETTINGS)
    straight = warmup_path(StubSim(acc), settings)

    class Cut(Callback):
        def on_round(self, loop, metrics):
            if loop.sim.executed == 700:
                raise KeyboardInterrupt

    sim = StubSim(acc)
    path = LambdaPath(settings)
    with pytest.raises(KeyboardInterrupt):
        RoundLoop(sim, [path, Cut()]).run(until=math.inf)
    state, snap, executed = path.state_dict(), sim.snapshot(), sim.executed
    again = StubSim(acc)
    again.restore(snap)
    again.executed = executed
    resumed = LambdaPath(settings)
    resumed.load_state_dict(state)
    loop = RoundLoop(again, [resumed])
    assert loop.run(until=math.inf).status == "FINISHED"
    assert resumed.result(loop).best_lambda == straight.best_lambda
    assert loop.summary["fpfc/total_rounds"] == straight.total_rounds


class NoisySim(StubSim):
    """A stub whose evaluation also reports the validation estimate's standard error (``se``), and
    whose method has a partition (``partition(lam)``: the read-out after training at λ)."""

    def __init__(self, acc, se: float, partition=None, seed: int = 0):
        super().__init__(acc, seed)
        self.se = se
        if partition is not None:
            self.method.cluster_assignment = lambda: dict(enumerate(partition(self.method.hp.lam)))

    def evaluate(self, final=False):
        return {**super().evaluate(final), "val/acc_se": self.se}


def test_a_dip_within_the_validation_noise_is_no_decline_and_a_real_one_is():
    # validation independent of λ, with evaluation noise of σ = 0.004, which the reported SE states
    def flat(rounds, lam, seed):
        return 0.8 + noise(seed, rounds, lam, sigma=0.004)

    settings = {**SETTINGS, "window": 2, "finalists": 1, "extend": 3, "extension": "step", "budget": 10**5}
    for seed in range(5):
        result = warmup_path(NoisySim(flat, se=0.004, seed=seed), PathSettings(**settings))
        # every stage is within the noise of the best: the path walks the grid and its extension
        assert [s["lambda"] for s in result.stages] == [0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8], seed
        assert result.extra["path_end"] == "extension limit"
        assert result.extra["summary"]["fpfc/decline_reached"] == 0
    # the same noise with no standard error reported: a dip counts, and some seed stops early on noise
    early = [len(warmup_path(StubSim(flat, seed), PathSettings(**settings)).stages) for seed in range(5)]
    assert min(early) < 8, early

    # a real decline: 3 pt per grid step past λ = 0.8, beyond 2 · √2 · SE = 1.1 pt
    def peaked(rounds, lam, seed):
        return 0.8 - 0.15 * max(0.0, lam - 0.8) + noise(seed, rounds, lam, sigma=0.004)

    for seed in range(5):
        result = warmup_path(NoisySim(peaked, se=0.004, seed=seed), PathSettings(**settings))
        assert [s["lambda"] for s in result.stages][-1] == 1.2, seed     # 1.0 and 1.2 below: patience 2
        assert result.extra["path_end"] == "decline"
        assert result.extra["summary"]["fpfc/decline_reached"] == 1


def test_a_partition_that_freezes_while_lambda_grows_is_reported_once(caplog):
    frozen = [0] * 5 + [1] * 5 + [2] * 10      # three clusters whatever λ
    settings = PathSettings(**{**SETTINGS, "finalists": 1, "extend": 0})

    def flat(rounds, lam, seed):
        return 0.8

    with caplog.at_level("WARNING", logger="pfl.tune.lambda_path"):
        result = warmup_path(NoisySim(flat, se=0.01, partition=lambda lam: frozen), settings)
    warnings = result.extra["warnings"]
    assert len(warnings) == 1 and "froze" in warnings[0] and "0.4 to λ 0.8" in warnings[0]
    assert sum("froze" in r.getMessage() for r in caplog.records) == 1
    assert result.extra["summary"]["fpfc/frozen"] == 1
    stages = result.stages
    assert "ari_prev" not in stages[0] and all(s["ari_prev"] == 1.0 for s in stages[1:])
    # flat validation, same partition, each stage ends at the rule's minimum: the new λ changed nothing
    assert all(s["unchanged"] == 1.0 and s["rounds"] == 40 for s in stages[1:])

    # a partition that moves with λ (clusters merge as λ grows): no warning, nothing unchanged
    def merging(lam):
        return [i // max(1, int(round(10 * lam))) for i in range(20)]

    moving = warmup_path(NoisySim(flat, se=0.01, partition=merging), settings)
    assert moving.extra["warnings"] == [] and moving.extra["summary"]["fpfc/frozen"] == 0
    assert all(s["ari_prev"] < 1.0 and s["unchanged"] == 0.0 for s in moving.stages[1:])
    # descending through the same frozen partition: λ did not grow, so no warning
    down = warmup_path(NoisySim(flat, se=0.01, partition=lambda lam: frozen),
                       PathSettings(**{**SETTINGS, "finalists": 1, "extend": 0, "direction": "descending"}))
    assert [s["lambda"] for s in down.stages][0] == 1.2 and down.extra["warnings"] == []


class ResidualSim(StubSim):
    """A stub that logs ADMM residuals every round: r/scale = s/scale = ``ratio(rounds at this λ)``."""

    def __init__(self, acc, ratio):
        super().__init__(acc)
        self.ratio, self.since = ratio, 0
        self.lam = None

    def run_round(self, evaluate=None):
        if self.method.hp.lam != self.lam:
            self.lam, self.since = self.method.hp.lam, 0
        self.since += 1
        metrics = super().run_round(evaluate)
        r = self.ratio(self.since)
        return {**metrics, "fpfc/primal_residual": r, "fpfc/primal_scale": 1.0, "fpfc/dual_residual": r / 2,
                "fpfc/dual_scale": 0.5}


def test_a_segment_ends_only_when_the_residuals_are_small_too():
    # validation is flat from the start (a plateau the old rule took for convergence); the residual
    # ratio halves every 50 rounds from 0.1: it is ≤ 2e-3 on average over an evaluation's 10 rounds once
    # 0.1 · 2^(−t/50) averaged over (t − 10, t] ≤ 2e-3
    def ratio(t):
        return 0.1 * 2 ** (-t / 50)

    settings = PathSettings(**{**SETTINGS, "residual_tol": 2e-3, "budget": 2000})
    stage = separate_run(ResidualSim(lambda r, lam, s: 0.8, ratio), 0.6, settings)
    first = next(t for t in range(10, 2000, 10) if sum(ratio(u) for u in range(t - 9, t + 1)) / 10 <= 2e-3)
    assert stage["rounds"] == first == 290 and stage["end"] == "converged"
    assert stage["primal_rel"] == pytest.approx(sum(ratio(u) for u in range(281, 291)) / 10)
    # without the residuals the plateau ends the run at the validation rule's minimum
    plateau = separate_run(StubSim(lambda r, lam, s: 0.8), 0.6, settings)
    assert plateau["rounds"] == 40 and plateau["end"] == "converged"
    # residuals that never fall: the run ends at the budget, and says so
    capped = separate_run(ResidualSim(lambda r, lam, s: 0.8, lambda t: 0.01), 0.6, settings)
    assert capped["rounds"] == 2000 and capped["end"] == "budget" and capped["converged"] == 0
    path = warmup_path(ResidualSim(lambda r, lam, s: 0.8, lambda t: 0.01),
                       PathSettings(**{**SETTINGS, "residual_tol": 2e-3, "stage_cap": 60, "finalists": 1,
                                       "extend": 0, "budget": 2000}))
    assert all(s["end"] == "stage cap" and s["rounds"] == 60 for s in path.stages)


def test_the_descent_that_skips_glued_stages_leaves_them_at_the_rules_minimum():
    # λ above 0.7 glues the clusters (some pair across them inside the penalty's soft-threshold region);
    # accuracy keeps rising with training, so only the stage cap ends the other stages
    class Glued(StubSim):
        def evaluate(self, final=False):
            return {**super().evaluate(final), "fpfc/glued_clusters": 3.0 if self.method.hp.lam > 0.7 else 0.0}

    settings = {**SETTINGS, "stage_cap": 200, "finalists": 1, "extend": 0, "patience": 5}
    def acc(rounds, lam, seed):   # +0.1 pt per 10 rounds: never settles
        return 0.5 + rounds / 1e4

    skip = warmup_path(Glued(acc), PathSettings(**settings, direction="descending_skip_glued"))
    assert [(s["lambda"], s["rounds"], s["end"]) for s in skip.stages] == [
        (1.2, 40, "glued"), (1.0, 40, "glued"), (0.8, 40, "glued"), (0.6, 200, "stage cap"), (0.4, 200, "stage cap")]
    plain = warmup_path(Glued(acc), PathSettings(**settings, direction="descending"))
    assert [s["rounds"] for s in plain.stages] == [200] * 5       # the plain descent trains every stage


def test_the_playoff_prefers_fewer_clusters_within_the_noise_and_the_best_beyond_it():
    # a descending path: validation rises 0.2 pt per 0.2 less λ while clusters fragment (4 at λ ≥ 0.8,
    # 40 below); with an SE of 0.4 pt the 0.2-0.4 pt gains are noise, with 0.02 pt they are not
    def acc(rounds, lam, seed):
        return 0.85 - 0.01 * lam

    def partition(lam):
        return [i // 5 for i in range(20)] if lam >= 0.8 else list(range(20))

    class Clustered(NoisySim):
        def evaluate(self, final=False):
            return {**super().evaluate(final), "cluster/num": 4.0 if self.method.hp.lam >= 0.8 else 20.0}

    settings = PathSettings(**{**SETTINGS, "direction": "descending", "extend": 0, "finalists": 3, "patience": 5})
    noisy = warmup_path(Clustered(acc, se=0.004, partition=partition), settings)
    assert noisy.best_lambda == 0.8                       # the 4-cluster finalist, 0.4 pt below the best
    sharp = warmup_path(Clustered(acc, se=0.0002, partition=partition), settings)
    assert sharp.best_lambda == 0.4                       # beyond the noise: the best validated


def test_the_separate_strategy_applies_the_same_rule_per_seed():
    from pfl.tune.path_compare import separate_per_seed

    runs = [dict(_run(0, 0.4, 500, 0.868, 0.867), clusters=48.0, val_se=0.0038),
            dict(_run(0, 0.6, 700, 0.866, 0.866), clusters=4.0, val_se=0.0038),
            dict(_run(0, 0.8, 1000, 0.815, 0.814), clusters=4.0, val_se=0.0042)]
    assert separate_per_seed(runs)[0]["selected_lambda"] == 0.4              # no noise: the best validated
    assert separate_per_seed(runs, noise=2.0)[0]["selected_lambda"] == 0.6   # within 1.1 pt: fewer clusters


# ---- the comparison's counting (pfl/tune/path_compare.py) ------------------------------------------

def _path(seed, rounds, compute, val, test, lam, stages):
    return {"seed": seed, "selected_lambda": lam, "val": val, "test": test, "clusters": 4.0, "ari": 1.0,
            "rounds": rounds, "compute_s": compute, "converged": 1.0,
            "stages": [{"lambda": l, "rounds": r, "converged": c, "val": v, "compute_s": r / 4} for l, r, c, v in stages]}


def _run(seed, lam, rounds, val, test, converged=1.0):
    return {"seed": seed, "lambda": lam, "val": val, "test": test, "clusters": 4.0, "ari": 1.0, "rounds": rounds,
            "compute_s": rounds / 4, "converged": converged}


def test_both_strategies_are_counted_per_seed_with_every_trial_and_the_spread_over_seeds():
    from pfl.tune.path_compare import markdown, per_lambda, separate_per_seed, strategy_row, verdict

    paths = [_path(0, 1000, 250, 0.86, 0.85, 0.8, [(0.4, 470, 1, 0.83), (0.8, 60, 1, 0.86), (1.2, 40, 1, 0.85)]),
             _path(1, 1200, 300, 0.88, 0.87, 0.8, [(0.4, 520, 1, 0.84), (0.8, 80, 0, 0.88), (1.2, 40, 1, 0.86)])]
    runs = [_run(0, 0.4, 470, 0.84, 0.83), _run(0, 0.8, 660, 0.80, 0.81), _run(0, 1.2, 1500, 0.82, 0.80, 0.0),
            _run(1, 0.4, 500, 0.83, 0.82), _run(1, 0.8, 700, 0.85, 0.86), _run(1, 1.2, 900, 0.84, 0.83)]
    per_seed = separate_per_seed(runs)
    # seed 0: 470 + 660 + 1500 rounds, λ 0.4 best by validation; seed 1: 2100 rounds, λ 0.8
    assert [(s["selected_lambda"], s["rounds"], s["test"], s["converged"]) for s in per_seed] == \
        [(0.4, 2630, 0.83, 2), (0.8, 2100, 0.86, 3)]
    warm, sep = strategy_row("warmup", paths), strategy_row("separate", per_seed)
    assert warm["rounds"] == 1100 and warm["rounds_sd"] == pytest.approx(math.sqrt(2 * 100 ** 2))
    assert sep["rounds"] == 2365 and sep["rounds_sd"] == pytest.approx(265 * math.sqrt(2))
    assert sep["test"] == pytest.approx(0.845) and sep["test_sd"] == pytest.approx(0.015 * math.sqrt(2))
    assert sep["models"] == 6 and sep["converged"] == 5 and warm["spread_over"] == "2 seeds"
    line = verdict(warm, sep)
    # +1.5 pt against ± √(0.01414² + 0.02121²) = 2.55 pt: within the spread; 2365 / 1100 = 2.15×
    assert "+1.50 pt (within the seed spread of ± 2.55 pt)" in line and "2.1× fewer rounds" in line
    rows = {r["lambda"]: r for r in per_lambda(paths, runs)}
    assert rows[0.8]["warmup_rounds"] == 70 and rows[0.8]["warmup_capped"] == 1
    assert rows[1.2]["separate_rounds"] == 1200 and rows[1.2]["separate_capped"] == 1
    text = markdown([warm, sep], list(rows.values()))
    assert "| 1.2 | 40 (converged) | 1200 (1 of 2 at a cap) |" in text and "| warmup | 0.8, 0.8 |" in text


def test_each_path_order_is_counted_against_the_separate_runs_of_the_lambdas_it_visited():
    from pfl.tune.path_compare import separate_per_seed, strategy_row, verdict, visited_runs

    path = _path(0, 1000, 250, 0.86, 0.85, 0.6, [(1.0, 300, 0, 0.80), (0.6, 300, 1, 0.86)])
    runs = [_run(0, lam, 1000, 0.8 + lam / 100, 0.8) for lam in (0.2, 0.4, 0.6, 0.8, 1.0)]
    own = visited_runs([path], runs)
    assert sorted(r["lambda"] for r in own) == [0.6, 1.0]          # not 0.2, 0.4, 0.8: another order's
    line = verdict(strategy_row("warmup", [path]), strategy_row("separate", separate_per_seed(own)),
                   " (the 2 λ it visited)")
    assert line.startswith("warmup vs separate (the 2 λ it visited): λ 0.6 vs 1") and "2.0× fewer rounds" in line


def test_with_one_seed_there_is_no_spread_and_the_tables_say_so():
    from pfl.tune.path_compare import markdown, separate_per_seed, strategy_row, verdict

    warm = strategy_row("warmup", [_path(0, 1000, 250, 0.86, 0.85, 0.8, [(0.4, 470, 1, 0.83)])])
    sep = strategy_row("separate", separate_per_seed([_run(0, 0.4, 470, 0.84, 0.845)]))
    assert warm["test_sd"] != warm["test_sd"] and warm["spread_over"] == sep["spread_over"] == "one seed"
    assert "+0.50 pt (one seed: no spread, so no claim either way)" in verdict(warm, sep)
    assert "| one seed |" in markdown([warm, sep], [])


def test_the_recommendation_is_the_best_validated_model_of_either_strategy_over_seeds():
    from pfl.tune.path_compare import recommend, recommendation_line

    paths = [_path(0, 1000, 250, 0.86, 0.85, 0.8, []), _path(1, 1000, 250, 0.84, 0.83, 0.6, [])]
    runs = [_run(0, 0.4, 470, 0.88, 0.87), _run(1, 0.4, 500, 0.80, 0.79),    # mean val 0.84
            _run(0, 0.6, 660, 0.86, 0.86), _run(1, 0.6, 700, 0.855, 0.85)]   # mean val 0.8575
    rec = recommend({"warmup": paths}, runs)
    # seed 0 alone would pick λ 0.4 from scratch (0.88); over both seeds λ 0.6 from scratch is best
    assert rec["strategy"] == "separate" and rec["lambdas"] == [0.6, 0.6]
    assert rec["val"] == pytest.approx(0.8575) and rec["test"] == pytest.approx(0.855)
    assert "λ 0.6, trained from scratch" in recommendation_line(rec) and "2 seeds" in recommendation_line(rec)
    better = [dict(p, val=p["val"] + 0.03) for p in paths]                 # the paths' mean val 0.88
    rec = recommend({"warmup": better}, runs)
    assert rec["strategy"] == "warmup" and rec["lambdas"] == [0.8, 0.6]
    assert "λ 0.8/0.6 (per seed), reached by the warmup path" in recommendation_line(rec)
    # an RMSE is minimised
    assert recommend({}, runs, sign=-1.0)["lambdas"] == [0.4, 0.4]


def test_the_recommendation_prefers_fewer_clusters_only_within_the_noise():
    from pfl.tune.path_compare import recommend, recommendation_line

    def fragmented(p, clusters=48.0):
        return dict(p, clusters=clusters, ari=0.6)

    # one seed: the path's model is 0.14 pt better with 48 clusters; the binomial SEs are 0.38 pt each,
    # so the difference is within 2 · √2 · 0.38 = 1.07 pt and the 4-cluster model from scratch is chosen
    path = fragmented(dict(_path(0, 1500, 200, 0.8676, 0.8666, 0.4, []), val_se=0.0038))
    runs = [dict(_run(0, 0.6, 740, 0.8662, 0.8658), val_se=0.0038), dict(_run(0, 0.8, 1000, 0.8153, 0.81), val_se=0.004)]
    rec = recommend({"warmup": [path]}, runs)
    assert rec["strategy"] == "separate" and rec["lambdas"] == [0.6] and rec["parsimonious"]
    line = recommendation_line(rec)
    assert "fewest clusters among the models within 2 standard errors of the best validated one (warmup λ 0.4" in line
    # a gap beyond the noise: the best validated model, fragmented or not
    far = fragmented(dict(path, val=0.8862))
    assert recommend({"warmup": [far]}, runs)["strategy"] == "warmup"
    assert not recommend({"warmup": [far]}, runs)["parsimonious"]
    # over seeds the noise is the seed spread over √seeds: 0.8 pt apart, spreads of 0.1 pt → beyond
    paths = [fragmented(dict(_path(s, 1500, 200, v, v, 0.4, []), val_se=0.0038)) for s, v in ((0, 0.875), (1, 0.877))]
    seeds = [dict(_run(s, 0.6, 740, v, v), val_se=0.0038) for s, v in ((0, 0.867), (1, 0.869))]
    assert recommend({"warmup": paths}, seeds)["strategy"] == "warmup"
    # several path orders are candidates too, each under its name
    other = [dict(p, val=p["val"] + 0.01, clusters=4.0) for p in paths]
    assert recommend({"warmup": paths, "warmup-ascending": other}, seeds)["strategy"] == "warmup-ascending"


def test_the_tuning_space_holds_out_validation_as_a_fifth_of_each_devices_training_part():
    """Spec §4: validation = 20 % of the training part (80/20 train/test first: 64/16/20), in the λ
    tuning's space only, so every other run keeps its split."""
    from pathlib import Path

    from pfl.resolver import resolve
    from pfl.data import load_federated
    from pfl.tune.space import base_config, load_space

    space = load_space(Path(__file__).resolve().parents[1] / "search_spaces" / "fpfc.yaml")
    cfg = resolve(base_config(space, ["data.params.size_scale=0.05", "data.num_clients=40"]))
    data = load_federated(cfg.data, cfg.seed)
    for client in data.clients:
        n = client.n_train + client.n_val + client.n_test
        assert abs(client.n_test - 0.2 * n) <= 0.5
        assert abs(client.n_val - 0.2 * (client.n_train + client.n_val)) <= 1.0, (n, client.n_val, client.n_train)
    assert resolve({}).data.val_fraction == 0.1            # the default split is unchanged
