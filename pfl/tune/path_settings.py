"""The λ schedule's settings and its rules, as plain functions (docs/methods/fpfc.md §4).

:class:`PathSettings` is the ``pipeline:`` block of ``search_spaces/fpfc.yaml``. The rules a
:class:`pfl.tune.lambda_path.LambdaPath` applies are here, without the loop, so each can be checked
against a hand-worked case:

* :func:`converged` — a segment of training at one λ has reached that λ's solution: FPFC's ADMM
  residuals are below ``residual_tol`` of their scales (mean over the rounds since the previous
  evaluation: with partial participation a single round's residual jumps with the sample) **and**
  validation has settled (the best score of the last ``window`` evaluations at most ``tolerance``
  above the best before them). A validation plateau alone is not a solution: a λ whose models are
  glued together learns slowly and looks flat long before it has converged.
* :func:`below_best` — a stage is worse than the path's best only by more than ``noise_se``
  standard errors of the validation estimate (the binomial noise of the validation samples).
* :func:`parsimonious` — the model to choose: the best validated one, unless one with fewer clusters
  is within the same noise (the one-standard-error rule of model selection, with clusters as the
  model's size); the playoff, the separate strategy and the pipeline's recommendation all use it.
* :meth:`PathSettings.extended` — the λ past the grid's end, a step or a factor further.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schema import ConfigError, hp

#: the path orders: the paper's ascending one; the descending one from the common (fused) start; the
#: descending one that leaves a glued stage early (its clusters held together by the penalty: a biased
#: compromise the next, smaller λ releases)
DIRECTIONS = ("ascending", "descending", "descending_skip_glued")


@dataclass
class PathSettings:
    lambdas: list[float] = hp(default_factory=lambda: [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4],
                              doc="the λ grid (sorted by `direction`)")
    direction: str = hp("ascending", "order of the path: 'ascending' (the paper's), 'descending', or "
                                     "'descending_skip_glued' (a stage with two read-out clusters held together by "
                                     "the penalty, fpfc/glued_clusters > 0, ends at the rule's minimum)",
                        choices=DIRECTIONS)
    tolerance: float = hp(1e-3, "validation has settled when its best score of the last `window` evaluations is at "
                                "most this above its best before them", low=0.0)
    window: int = hp(3, "evaluations the validation rule looks back over", low=1)
    eval_every: int = hp(10, "rounds between the evaluations the convergence rule compares", low=1)
    residual_tol: float = hp(2e-3, "ADMM residuals (primal, dual) at most this fraction of their scales, mean over "
                                   "the rounds since the last evaluation; 0: validation alone decides", low=0.0)
    stage_cap: int = hp(200, "round cap of one path stage", low=1)
    min_stage_rounds: int = hp(0, "rounds every segment runs before the convergence rule may end it: 0, or at "
                                  "least (window + 1) × eval_every, the rule's own minimum", low=0)
    patience: int = hp(2, "stop the path after this many consecutive stages below the best (beyond the noise)",
                       low=1)
    noise_se: float = hp(2.0, "standard errors (val/acc_se) of the difference of two validation scores that count as "
                              "noise: a stage is below the best only beyond it, and a model with fewer clusters within "
                              "it is chosen over the best validated one; 0: every difference counts", low=0.0)
    extend: int = hp(2, "λ values the path adds past the grid's end while it has not declined; 0: the grid only",
                     low=0)
    extension: str = hp("geometric", "how the path goes past the grid: 'geometric' (× the ratio of the grid's last "
                                     "two λ, never reaching 0) or 'step' (+ their difference)",
                        choices=("geometric", "step"))
    finalists: int = hp(2, "best path stages (by validation) compared in the playoff at equal lineage rounds; "
                           "1: no playoff, the best stage is continued", low=1)
    playoff_rounds: int = hp(50, "rounds the latest finalist is continued in the playoff; the others are "
                                 "continued to the same lineage total", low=0)
    budget: int = hp(1000, "most rounds a model trains at one λ (a separate run; the warm-up's selected model, its "
                           "stage and playoff rounds included) and most lineage rounds of a path and its playoff", low=1)

    def validate(self, path: str) -> None:
        def key(name: str) -> str:
            return f"{path}.{name}" if path else name

        if not self.lambdas:
            raise ConfigError(key("lambdas"), "needs at least one λ")
        if any(v <= 0 for v in self.lambdas):
            raise ConfigError(key("lambdas"), "every λ must be > 0")
        if len(set(self.lambdas)) != len(self.lambdas):
            raise ConfigError(key("lambdas"), f"each λ once, got {self.lambdas}")
        least = (self.window + 1) * self.eval_every
        if 0 < self.min_stage_rounds < least:
            # the rule needs window + 1 evaluations, so a smaller minimum would have no effect
            raise ConfigError(key("min_stage_rounds"), f"allowed: 0 or at least (window + 1) × eval_every = "
                                                       f"{least} (the convergence rule's own minimum), got "
                                                       f"{self.min_stage_rounds}")

    def ordered(self) -> list[float]:
        """The grid in path order."""
        return sorted(self.lambdas, reverse=self.direction != "ascending")

    def minimum_rounds(self) -> int:
        """The fewest rounds the convergence rule lets a segment run."""
        return max((self.window + 1) * self.eval_every, self.min_stage_rounds)

    def extended(self, visited: list[float]) -> float | None:
        """The λ one step past ``visited[-1]`` in the path's direction, by ``extension`` (None: the
        grid has a single λ, or a step would reach λ ≤ 0)."""
        grid = self.ordered()
        if len(grid) < 2:
            return None
        if self.extension == "geometric":
            return round(visited[-1] * grid[-1] / grid[-2], 10)
        nxt = round(visited[-1] + (grid[-1] - grid[-2]), 10)
        return nxt if nxt > 0 else None


def residual_ratios(metrics: dict[str, float]) -> tuple[float, float] | None:
    """(r / its scale, s / its scale) from a round's metrics (FPFC's ``fpfc/*_residual`` and
    ``fpfc/*_scale``, :class:`pfl.methods.fpfc_admm.Residuals`); None when the round has none."""
    try:
        r, s = metrics["fpfc/primal_residual"], metrics["fpfc/dual_residual"]
        r_scale, s_scale = metrics["fpfc/primal_scale"], metrics["fpfc/dual_scale"]
    except KeyError:
        return None

    def ratio(x: float, scale: float) -> float:
        return x / scale if scale > 0 else (0.0 if x == 0 else math.inf)

    return ratio(r, r_scale), ratio(s, s_scale)


def validation_settled(scores: list[float], window: int, tolerance: float) -> bool:
    """Whether a segment's validation scores (higher is better, oldest first) have settled: the best
    of the last ``window`` is at most ``tolerance`` above the best before them."""
    if len(scores) <= window:
        return False
    return max(scores[-window:]) <= max(scores[:-window]) + tolerance


def residuals_small(ratios: list[tuple[float, float]], tol: float) -> bool:
    """Whether the rounds' residual ratios (r / its scale, s / its scale) are, on average, both at most
    ``tol``; True when there are none to judge (a method without residuals) or ``tol`` is 0."""
    if tol <= 0 or not ratios:
        return True
    primal = math.fsum(r for r, _ in ratios) / len(ratios)
    dual = math.fsum(s for _, s in ratios) / len(ratios)
    return primal <= tol and dual <= tol


def converged(scores: list[float], window: int, tolerance: float,
              ratios: list[tuple[float, float]] | None = None, residual_tol: float = 0.0) -> bool:
    """The one convergence rule of every segment: the residuals are small and validation has settled."""
    return residuals_small(ratios or [], residual_tol) and validation_settled(scores, window, tolerance)


def below_best(score: float, se: float, best: float, best_se: float, noise_se: float) -> bool:
    """Whether a stage's validation ``score`` is below the path's ``best`` by more than the noise:
    ``noise_se`` standard errors of the difference of the two estimates, √(se² + best_se²) (a NaN
    error counts as 0). Treating the two as independent overstates the noise of two models scored on
    the same samples, which errs towards walking on rather than stopping at a dip; the best is the
    maximum of several noisy scores, which is biased upwards, hence the default of 2."""
    se, best_se = (v if v == v else 0.0 for v in (se, best_se))
    return best - score > noise_se * math.hypot(se, best_se)


def parsimonious(candidates: list[tuple[float, float, float]], noise_se: float) -> int:
    """The index of the candidate (score, standard error, clusters) to choose: among those whose score
    is within ``noise_se`` standard errors of the difference from the best one (:func:`below_best`
    says no), the fewest clusters, then the best score. NaN clusters count as many."""
    best = max(range(len(candidates)), key=lambda i: candidates[i][0])
    score, se, _ = candidates[best]
    close = [i for i, (s, e, _) in enumerate(candidates) if not below_best(s, e, score, se, noise_se)]
    return min(close, key=lambda i: (candidates[i][2] if candidates[i][2] == candidates[i][2] else math.inf,
                                     -candidates[i][0]))


__all__ = ["DIRECTIONS", "PathSettings", "below_best", "converged", "parsimonious", "residual_ratios",
           "residuals_small", "validation_settled"]
