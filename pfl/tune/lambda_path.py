"""FPFC's λ tuning strategies: a warm-started λ path vs separate runs (docs/methods/fpfc.md §4).

*One convergence rule* (:func:`pfl.tune.path_settings.converged`). A segment of training at one λ
(a path stage, a separate run, the warm-up's final continuation) ends when it has reached that λ's
solution — FPFC's ADMM residuals small against their scales and validation settled — or at its
cap. Each segment records what ended it (``end``: converged, stage cap, budget).

*Warmup (path following).* Train at the first λ until convergence (or ``stage_cap``), record the
stage, move to the next λ from the current state (models, pair variables, duals). A stage is below
the path's best only when its validation score is lower by more than the validation estimate's
noise (``noise_se`` standard errors); the path stops after ``patience`` such stages in a row (a
real decline). If the grid ends first, the path goes on past it (``extension``: a step or a
factor), at most ``extend`` λ values; ``fpfc/decline_reached`` says whether it ended on a decline,
``fpfc/path_end`` what ended it otherwise (0 decline, 1 the extension's limit, 2 the budget). The
``finalists`` best stages are snapshotted; the *playoff* continues each from its own state to the
same number of lineage rounds (the latest one's plus ``playoff_rounds``), so candidates are
compared at equal training; the best — or a finalist with fewer clusters within the noise
(:func:`pfl.tune.path_settings.parsimonious`) — is continued until convergence (the final
continuation). The path and the playoff stop at ``budget`` lineage rounds; the final continuation
stops, like a separate run, when the selected model has trained ``budget`` rounds at its λ (its
stage and playoff rounds included).

Directions: ``ascending`` is the paper's order. From a common start it splits the devices at the
first (small) λ, and SCAD cannot undo that: a pair farther apart than aλ feels no pull, so larger λ
keeps the split partition. ``descending`` starts where the devices are fused and lets them split
as λ decreases, the direction in which a warm start stays near the next λ's solution.
``descending_skip_glued`` ends a stage at the rule's minimum while two of its read-out clusters are
glued (most device pairs between them within SCAD's soft-threshold region, ‖θ_ij‖ < λ: the penalty
holds the clusters together, a biased compromise the next λ releases; FPFC's
``fpfc/glued_clusters``), so the path spends its rounds where the clusters are free.

*The stage report.* Each stage records how its partition moved: ``ari_prev`` (ARI against the
previous stage's read-out), ``unchanged`` (1 when the new λ changed nothing: the stage converged at
the rule's minimum with the partition and validation, within its noise, as they were) and, after two
transitions without any change of the partition while λ moved, the path warns once that its
partition froze (``warnings``, logged).

*Separate.* One λ from scratch until the same convergence rule, capped at ``budget`` rounds.

Both run as :class:`LambdaPath`, a callback that steers the one round loop
(:mod:`pfl.federation.loop`): it chooses the evaluation rounds, changes λ, snapshots and restores
model states, and stops the loop when the schedule is done. Its position is part of the loop's
checkpoint, so an interrupted path resumes where it was. Restoring a finalist's state restores the
model lineage only: the run's executed rounds, metric steps and cumulative communication keep
counting, so every round run is paid for in ``fpfc/total_rounds`` and ``comm/*``. At the end the
selected model is evaluated once more (with the final cluster read-out), so every reported metric,
the client table and the cluster file are that model's.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..federation.loop import Callback, LoopResult, RoundLoop, StopTraining
from ..schema import ConfigError
from .path_report import PATH_METRICS, partition_change, plot_path, stage_metrics, stage_record, write_stages
from .path_settings import PathSettings, below_best, converged, parsimonious, residual_ratios

log = logging.getLogger(__name__)
Stage = dict[str, float]

#: what ended a path: ``fpfc/path_end``
PATH_ENDS = {"decline": 0.0, "extension limit": 1.0, "budget": 2.0}


def require_validation(cfg) -> None:
    """Both strategies choose λ by validation accuracy: the clients need a validation split."""
    if not cfg.data.val_fraction > 0:
        raise ConfigError("data.val_fraction", "λ tuning selects by validation accuracy; set a fraction "
                                               f"in (0, 1), got {cfg.data.val_fraction}")


def set_lambda(sim, lam: float) -> None:
    """Change λ of a live FPFC run (both sides of the method, and the config, kept in step)."""
    import dataclasses

    sim.set_hparams(dataclasses.replace(sim.method.hp, lam=float(lam)))


def score_of(task: str) -> tuple[str, float]:
    """The validation metric λ is chosen by and its sign (the score is maximised)."""
    return ("val/rmse_mean", -1.0) if task == "regression" else ("val/acc_mean", 1.0)


@dataclass
class PathResult:
    stages: list[Stage]
    best_lambda: float
    final: Stage
    total_rounds: int
    wall_s: float
    extra: dict = field(default_factory=dict)


class LambdaPath(Callback):
    """Steers a run through the warm-up path (``strategy="warmup"``) or one separate λ.

    Segments of rounds are trained at one λ from a start round: a path stage (ends on convergence
    after ``min_stage_rounds``, or at ``stage_cap``), a playoff match (to the playoff's lineage
    total), the final continuation and a separate run (on convergence, or at ``budget`` lineage
    rounds). Evaluations fall every ``eval_every`` rounds of a segment and at its end. Each stage
    end adds ``stage/*`` to that round's metrics, each match end ``playoff/*``; at the end
    ``loop.summary`` holds the ``fpfc/*`` schedule metrics (:data:`PATH_METRICS`) and the selected
    model's evaluation.
    """

    key = "lambda_path"
    #: what the schedule changes: logged at the end as the final model's λ and the rounds run
    steered_keys = ("method.lam", "federation.rounds")
    #: metrics that mark an event of one round (a stage or match end), not the run's state
    event_prefixes = ("stage/", "playoff/")

    def __init__(self, settings: PathSettings, strategy: str = "warmup",
                 on_stage: Callable[[int, Stage], None] | None = None):
        if strategy not in ("warmup", "separate"):
            raise ConfigError("strategy", f"unknown strategy {strategy!r}; allowed: warmup, separate")
        self.settings = settings
        self.strategy = strategy
        self.on_stage = on_stage
        self.st: dict[str, Any] = {}   # the position; empty before the first round
        self._clock = time.perf_counter()
        self._cpu = time.process_time()

    # ---- segments ------------------------------------------------------------------------------
    def _segment(self, sim, lam: float, cap: int, stop_early: bool, capped_by: str = "budget") -> None:
        set_lambda(sim, lam)
        self.st.update(lam=float(lam), start=sim.round, cap=int(cap), stop_early=stop_early, scores=[], ratios=[],
                       last_ratios=None, capped_by=capped_by, t0=sim.elapsed, c0=self.st.get("cpu_s", 0.0))

    def _stage_segment(self, sim, lam: float) -> None:
        cfg = self.settings
        left = cfg.budget - sim.round
        self._segment(sim, lam, min(cfg.stage_cap, left), stop_early=True,
                      capped_by="stage cap" if cfg.stage_cap < left else "budget")

    def on_start(self, loop: RoundLoop) -> None:
        sim = loop.sim
        self.metric, self.sign = score_of(sim.data.task)
        self._clock, self._cpu = time.perf_counter(), time.process_time()
        if self.st:
            return  # resumed from a checkpoint: the position came with it
        require_validation(sim.cfg)
        cfg = self.settings
        if self.strategy == "separate":
            self.st = {"phase": "separate", "wall_s": 0.0, "cpu_s": 0.0}
            self._segment(sim, sim.method.hp.lam, cfg.budget - sim.round, stop_early=True)
            return
        self.st = {"phase": "path", "lambdas": cfg.ordered(), "index": 0,
                   "stages": [], "finalists": [], "best": -math.inf, "best_se": math.nan, "below": 0, "extended": 0,
                   "playoff": [], "match": 0, "wall_s": 0.0, "cpu_s": 0.0, "partitions": [], "still": 0,
                   "warnings": []}
        self._stage_segment(sim, self.st["lambdas"][0])

    def wants_eval(self, loop: RoundLoop, rnd: int) -> bool:
        done = rnd + 1 - self.st["start"]
        return done % self.settings.eval_every == 0 or done >= self.st["cap"]

    def on_round(self, loop: RoundLoop, metrics: dict[str, float]) -> None:
        # CPU seconds as well as wall time: on a shared machine the wall time of a round depends on the
        # load of the moment, its CPU time (one thread per trial) hardly
        now, cpu = time.perf_counter(), time.process_time()
        sim, st, cfg = loop.sim, self.st, self.settings
        st["wall_s"] += now - self._clock
        st["cpu_s"] += cpu - self._cpu
        self._clock, self._cpu = now, cpu
        rounds = sim.round - st["start"]
        ratios = residual_ratios(metrics)
        if ratios is not None:
            st["ratios"].append(ratios)
        if self.metric not in metrics:
            if rounds % cfg.eval_every == 0 or rounds >= st["cap"]:  # an evaluation this schedule asked for
                raise RuntimeError(f"the λ schedule chooses by {self.metric}, which the evaluation did not report "
                                   f"(reported: {', '.join(sorted(k for k in metrics if k.startswith('val/')))})")
            return
        st["scores"].append(self.sign * float(metrics[self.metric]))
        window, st["ratios"] = st["ratios"], []   # the residuals of the rounds since the last evaluation
        if window:
            st["last_ratios"] = [math.fsum(r for r, _ in window) / len(window),
                                 math.fsum(s for _, s in window) / len(window)]
        settled = st["stop_early"] and rounds >= cfg.min_stage_rounds and \
            converged(st["scores"], cfg.window, cfg.tolerance, window, cfg.residual_tol)
        # a glued stage's solution is a compromise between clusters the penalty holds together: the
        # descending path that skips them moves on at the rule's minimum
        glued = (cfg.direction == "descending_skip_glued" and st["phase"] == "path" and not settled
                 and metrics.get("fpfc/glued_clusters", 0.0) > 0 and rounds >= cfg.minimum_rounds())
        if not (settled or glued or rounds >= st["cap"]):
            return
        residual = st["last_ratios"] or [math.nan, math.nan]
        end = "converged" if settled else "glued" if glued else st["capped_by"]
        record = stage_record(st["lam"], metrics, rounds, sim.elapsed - st["t0"], converged=float(settled),
                              end=end, lineage=float(sim.round),
                              cpu_s=st["cpu_s"] - st["c0"], primal_rel=residual[0], dual_rel=residual[1])
        getattr(self, f"_end_{st['phase']}")(loop, metrics, record)

    # ---- the path ------------------------------------------------------------------------------
    def _end_path(self, loop: RoundLoop, metrics: dict, record: Stage) -> None:
        sim, st, cfg = loop.sim, self.st, self.settings
        score = st["scores"][-1]
        se = float(record.get(self.metric.replace("_mean", "_se"), math.nan))
        self._report_partition(sim, record, score, se)
        st["stages"].append(record)
        metrics.update(stage_metrics(record))
        if self.on_stage is not None:
            self.on_stage(st["index"], record)
        self._keep_best(sim, score, record)
        if below_best(score, se, st["best"], st["best_se"], cfg.noise_se):
            st["below"] += 1
        else:
            st["below"] = 0
        if score > st["best"]:
            st["best"], st["best_se"], st["best_index"] = score, se, len(st["stages"]) - 1
        st["index"] += 1
        if st["below"] >= cfg.patience:
            return self._after_path(loop, metrics, "decline")
        if sim.round >= cfg.budget:
            return self._after_path(loop, metrics, "budget")
        if st["index"] >= len(st["lambdas"]):
            nxt = cfg.extended(st["lambdas"]) if st["extended"] < cfg.extend else None
            if nxt is None:
                return self._after_path(loop, metrics, "extension limit")
            st["lambdas"].append(nxt)   # no decline yet: it lies further on
            st["extended"] += 1
        self._stage_segment(sim, st["lambdas"][st["index"]])

    def _report_partition(self, sim, record: Stage, score: float, se: float) -> None:
        """How the stage moved the partition (``ari_prev``, ``unchanged``); the one-line warning when
        it froze while λ grew."""
        st, cfg = self.st, self.settings
        assign = getattr(sim.method, "cluster_assignment", None)
        labels = assign() if callable(assign) else None
        current = [int(labels[c]) for c in sorted(labels)] if labels else None
        previous = st["partitions"][-1] if st["partitions"] else None
        prev_score, st["prev_score"] = st.get("prev_score", math.nan), score
        st["partitions"].append(current)
        if current is None or previous is None or len(current) != len(previous):
            st["still"] = 0
            return
        ari = partition_change(previous, current)
        record["ari_prev"] = ari
        # the new λ changed nothing: converged at the rule's minimum, same partition, same validation
        noise = se if se == se else 0.0
        record["unchanged"] = float(ari >= 1.0 and record["rounds"] <= cfg.minimum_rounds() and record["end"] == "converged"
                                    and abs(score - prev_score) <= noise)
        grew = st["stages"] and st["lam"] > st["stages"][-1]["lambda"]
        st["still"] = st["still"] + 1 if ari >= 1.0 and grew else 0
        if st["still"] >= 2 and not st.get("frozen"):
            first = st["stages"][-2]["lambda"]
            text = (f"the λ path's partition froze: {len(set(current))} clusters, unchanged from λ {first:g} to "
                    f"λ {st['lam']:g} (ARI 1.00 between the stages' read-outs); SCAD does not pull pairs farther apart "
                    "than aλ, so a larger λ cannot re-fuse what an earlier stage split")
            st["frozen"] = {"from": first, "to": st["lam"], "clusters": len(set(current))}
            st["warnings"].append(text)
            log.warning(text)

    def _keep_best(self, sim, score: float, record: Stage) -> None:
        """Snapshot the model into the finalists (best first) if this stage is among the best."""
        finalists, size = self.st["finalists"], self.settings.finalists
        if len(finalists) >= size and score <= finalists[-1]["score"]:
            return
        finalists.append({"lam": self.st["lam"], "score": score, "lineage": sim.round, "record": dict(record),
                          "at_lambda": record["rounds"], "state": sim.snapshot()})
        finalists.sort(key=lambda c: -c["score"])
        del finalists[size:]

    def _after_path(self, loop: RoundLoop, metrics: dict, reason: str) -> None:
        st = self.st
        st["path_end"] = reason
        if len(st["finalists"]) < 2:
            self._start_final(loop, st["finalists"][0])
            return
        # equal training for every finalist: the latest one's lineage plus playoff_rounds (within the
        # budget); the matches run latest first, so only the first can be one of no rounds
        st["finalists"].sort(key=lambda c: -c["lineage"])
        st["target"] = min(st["finalists"][0]["lineage"] + self.settings.playoff_rounds, self.settings.budget)
        st["phase"], st["match"] = "playoff", 0
        self._start_match(loop, metrics)

    def _start_match(self, loop: RoundLoop, metrics: dict | None = None) -> None:
        st = self.st
        candidate = st["finalists"][st["match"]]
        loop.sim.restore(candidate["state"])
        rounds = st["target"] - loop.sim.round
        if rounds > 0:
            self._segment(loop.sim, candidate["lam"], rounds, stop_early=False, capped_by="playoff")
            return
        # already at the playoff's total (the latest finalist with playoff_rounds 0, or the budget)
        set_lambda(loop.sim, candidate["lam"])
        self._match_done(loop, metrics, dict(candidate["record"], rounds=0.0, wall_s=0.0, cpu_s=0.0, converged=0.0,
                                             end="playoff"), candidate["score"])

    def _end_playoff(self, loop: RoundLoop, metrics: dict, record: Stage) -> None:
        self._match_done(loop, metrics, record, self.st["scores"][-1])

    def _match_done(self, loop: RoundLoop, metrics: dict | None, record: Stage, score: float) -> None:
        st = self.st
        candidate = st["finalists"][st["match"]]
        candidate.update(score=score, record=dict(record), lineage=loop.sim.round, state=loop.sim.snapshot(),
                         at_lambda=candidate.get("at_lambda", 0.0) + record["rounds"])
        st["playoff"].append(record)
        if metrics is not None:
            metrics.update(stage_metrics(record, "playoff/"))
        st["match"] += 1
        if st["match"] < len(st["finalists"]):
            self._start_match(loop)
        else:   # the best after equal training, or a finalist with fewer clusters within the noise
            se_key = self.metric.replace("_mean", "_se")
            pick = parsimonious([(c["score"], c["record"].get(se_key, math.nan), c["record"].get("cluster/num", math.nan))
                                 for c in st["finalists"]], self.settings.noise_se)
            self._start_final(loop, st["finalists"][pick])

    def _start_final(self, loop: RoundLoop, winner: dict) -> None:
        sim, st = loop.sim, self.st
        st["phase"] = "final"
        sim.restore(winner["state"])
        st["finalists"] = [dict(winner, state=None)]  # the other snapshots are no longer needed
        st["selected"] = winner["lam"]
        # like a separate run, the selected model trains at most `budget` rounds at its λ (its stage and
        # playoff rounds included), so a path that spent its lineage on other λ still converges it
        left = self.settings.budget - int(winner.get("at_lambda", 0))
        if left > 0:
            self._segment(sim, winner["lam"], left, stop_early=True)
        else:
            set_lambda(sim, winner["lam"])
            st.update(lam=winner["lam"], start=sim.round, t0=sim.elapsed)
            self._finish(loop, dict(winner["record"], rounds=0.0, wall_s=0.0, cpu_s=0.0, converged=0.0, end="budget"))

    def _end_final(self, loop: RoundLoop, metrics: dict, record: Stage) -> None:
        self._finish(loop, record)

    def _end_separate(self, loop: RoundLoop, metrics: dict, record: Stage) -> None:
        self._finish(loop, record)

    def _finish(self, loop: RoundLoop, final: Stage) -> None:
        sim, st = loop.sim, self.st
        self.loop_executed = sim.executed
        st["phase"], st["final"] = "done", final
        stages = st.get("stages", [])
        playoff = st.get("playoff", [])
        summary = {
            "fpfc/total_rounds": float(sim.executed),
            "fpfc/path_stages": float(len(stages) or 1), "fpfc/lineage_rounds": float(sim.round),
            "fpfc/converged": final.get("converged", 0.0), "fpfc/final_rounds": final["rounds"],
            "fpfc/path_rounds": float(sum(s["rounds"] for s in stages)),
            "fpfc/playoff_total_rounds": float(sum(m["rounds"] for m in playoff)),
            "fpfc/budget_reached": float(sim.round >= self.settings.budget),
            "fpfc/trial_wall_s": st["wall_s"], "fpfc/compute_s": float(sim.elapsed), "fpfc/cpu_s": st["cpu_s"]}
        if self.strategy == "warmup":  # a separate run selects nothing: its λ is its param method.lam
            summary["fpfc/selected_lambda"] = final["lambda"]
            summary["fpfc/grid_extended"] = float(st["extended"])
            summary["fpfc/decline_reached"] = float(st.get("path_end") == "decline")
            summary["fpfc/path_end"] = PATH_ENDS[st.get("path_end", "budget")]
            summary["fpfc/frozen"] = float(bool(st.get("frozen")))
        # the selected model itself, with the final read-out: every reported metric is this model's
        # (after a playoff the last evaluated model may be another finalist's)
        evaluated = sim.evaluate(final=True)
        loop.summary.update(evaluated)
        loop.summary.update(summary)
        st["final"] = {**final, **stage_record(final["lambda"], evaluated, final["rounds"], final["wall_s"])}
        raise StopTraining("FINISHED")

    # ---- results -------------------------------------------------------------------------------
    def result(self, loop: RoundLoop) -> PathResult:
        st = self.st
        stages = st.get("stages") or [st["final"]]
        return PathResult(stages, float(st["final"]["lambda"]), st["final"], int(loop.sim.executed),
                          loop.sim.elapsed, extra={"playoff": list(st.get("playoff", [])),
                                                   "lambdas": list(st.get("lambdas", [])),
                                                   "path_end": st.get("path_end"),
                                                   "warnings": list(st.get("warnings", [])),
                                                   "summary": dict(loop.summary)})

    def on_end(self, loop: RoundLoop, result: LoopResult) -> None:
        if result.status == "FINISHED" and self.st.get("phase") != "done":
            raise RuntimeError("the λ schedule did not finish (the loop ended before it)")

    def write_artifacts(self, loop: RoundLoop, outdir: Path) -> list[tuple[Path, str | None]]:
        if self.strategy != "warmup" or not self.st.get("stages"):
            return []
        files = [(write_stages(self.st["stages"], outdir / "lambda_path.csv"), None)]
        if self.st["playoff"]:
            files.append((write_stages(self.st["playoff"], outdir / "lambda_playoff.csv"), None))
        files.append((plot_path(self.st["stages"], outdir / "lambda_path.png",
                                f"FPFC λ path ({self.settings.direction})", self.st["playoff"]), "plots"))
        return files

    def final_params(self) -> dict[str, str]:
        """The steered keys as the run ended (λ of the final model, rounds the trial computed) and
        the path the λ took."""
        st = self.st
        out = {"federation.rounds": str(int(self.loop_executed))} if hasattr(self, "loop_executed") else {}
        if st.get("stages"):
            visited = " ".join(f"{s['lambda']:g}" for s in st["stages"])
            played = " ".join(f"{s['lambda']:g}" for s in st.get("playoff", []))
            out["path.lambdas_run"] = visited + (f" | playoff {played}" if played else "")
            out["path.end"] = st.get("path_end", "")
        return out

    def state_dict(self) -> dict:
        return self.st

    def load_state_dict(self, state: dict) -> None:
        self.st = dict(state)


def _run(sim, controller: LambdaPath, on_round: Callable[[dict], None] | None) -> LambdaPath:
    from ..callbacks import StopOnDivergence
    from ..federation.simulator import DivergedError

    class _Hook(Callback):
        def on_round(self, loop, metrics):
            on_round(metrics)

    # the hook sees each round before the controller may restore another branch's state
    chain: list[Callback] = [StopOnDivergence()] + ([_Hook()] if on_round else []) + [controller]
    loop = RoundLoop(sim, chain)
    result = loop.run(until=math.inf)
    if result.status == "FAILED":
        raise DivergedError(result.reason)
    controller.loop = loop
    return controller


def warmup_path(sim, settings: PathSettings, on_stage: Callable[[int, Stage], None] | None = None,
                on_round: Callable[[dict], None] | None = None) -> PathResult:
    """The warm-started λ path on a fresh simulator, the playoff of its best stages (when
    ``finalists`` > 1), then the chosen λ continued until convergence (without a sweep's callbacks)."""
    controller = _run(sim, LambdaPath(settings, "warmup", on_stage), on_round)
    return controller.result(controller.loop)


def separate_run(sim, lam: float, settings: PathSettings,
                 on_round: Callable[[dict], None] | None = None) -> Stage:
    """One λ from scratch until convergence (or ``budget`` rounds): the separate strategy's unit."""
    set_lambda(sim, lam)
    controller = _run(sim, LambdaPath(settings, "separate"), on_round)
    return controller.st["final"]


__all__ = ["LambdaPath", "PATH_ENDS", "PATH_METRICS", "PathResult", "PathSettings", "converged", "require_validation",
           "separate_run", "set_lambda", "stage_record", "warmup_path"]
