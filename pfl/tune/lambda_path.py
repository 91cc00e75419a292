"""FPFC's λ tuning strategies: a warm-started λ path vs separate runs (docs/methods/fpfc.md §4).

*One convergence rule.* A segment of training at one λ (a path stage, a separate run, the
warm-up's final continuation) ends when it has **converged** — the best validation score of its
last ``window`` evaluations is at most ``tolerance`` above its best before them — or at its cap.
The score is validation accuracy (regression: minus the validation RMSE). A window of
evaluations rather than one difference: single 10-round differences of a slowly rising accuracy
fall below 1e-3 by noise long before training has settled.

*Warmup (path following).* Train at the first λ of the grid until convergence (or ``stage_cap``),
record the stage, move to the next λ from the current state (models, pair variables, duals). Stop
once validation has been below the path's best for ``patience`` consecutive stages (the decline).
If the grid ends while its last stage is still the best, the path goes on past it, one grid step
at a time, at most ``extend`` λ values (the decline not reached is reported). The ``finalists``
best stages were snapshotted; the *playoff* continues each from its own state until all have the
same number of lineage rounds (the latest one's plus ``playoff_rounds``), so candidates are
compared at equal training — the later stages of a path otherwise win by having trained longer.
The best of them is continued until convergence (the final continuation). No lineage trains past
``budget`` rounds: the path, the playoff and the continuation stop there.

*Separate.* One λ from scratch until the same convergence rule, capped at ``budget`` rounds.

Both run as :class:`LambdaPath`, a callback that steers the one round loop
(:mod:`pfl.federation.loop`): it chooses the evaluation rounds, changes λ, snapshots and restores
model states, and stops the loop when the schedule is done. Its position (phase, stages, the
finalists' snapshots) is part of the loop's checkpoint, so an interrupted path resumes where it
was. Restoring a finalist's state restores the model lineage only: the run's executed rounds,
metric steps and cumulative communication keep counting, so every round run is paid for in
``fpfc/total_rounds`` and ``comm/*``. At the end the selected model is evaluated once more (with
the final cluster read-out), so every reported metric, the client table and the cluster file are
that model's.

The ascending order is the paper's; from a common start (``method.init_std: 0``) it re-fuses the
devices as λ grows, and ``direction: descending`` fragments them (docs/methods/fpfc.md §4).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..federation.loop import Callback, LoopResult, RoundLoop, StopTraining
from ..schema import ConfigError, hp
from .path_report import plot_path, stage_metrics, write_stages

Stage = dict[str, float]


@dataclass
class PathSettings:
    lambdas: list[float] = hp(default_factory=lambda: [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4],
                              doc="the λ grid (sorted by `direction`)")
    direction: str = hp("ascending", "order of the path", choices=("ascending", "descending"))
    tolerance: float = hp(1e-3, "a segment has converged when its best validation score of the last `window` "
                                "evaluations is at most this above its best before them", low=0.0)
    window: int = hp(3, "evaluations the convergence rule looks back over", low=1)
    eval_every: int = hp(10, "rounds between the evaluations the convergence rule compares", low=1)
    stage_cap: int = hp(200, "round cap of one path stage", low=1)
    min_stage_rounds: int = hp(0, "rounds every segment runs before the convergence rule may end it: 0, or at "
                                  "least (window + 1) × eval_every, the rule's own minimum", low=0)
    patience: int = hp(2, "stop the path after this many consecutive stages below the best", low=1)
    extend: int = hp(2, "λ values the path adds past the grid's end (one grid step each) while its last stage "
                        "is still its best; 0: the grid only", low=0)
    finalists: int = hp(3, "best path stages (by validation) compared in the playoff at equal lineage rounds; "
                           "1: no playoff, the best stage is continued", low=1)
    playoff_rounds: int = hp(50, "rounds the latest finalist is continued in the playoff; the others are "
                                 "continued to the same lineage total", low=0)
    budget: int = hp(1000, "most rounds any model's lineage trains: a separate run, and a warm-up lineage "
                           "(path, playoff and final continuation)", low=1)

    def validate(self, path: str) -> None:
        def key(name: str) -> str:
            return f"{path}.{name}" if path else name

        if not self.lambdas:
            raise ConfigError(key("lambdas"), "needs at least one λ")
        if any(v <= 0 for v in self.lambdas):
            raise ConfigError(key("lambdas"), "every λ must be > 0")
        least = (self.window + 1) * self.eval_every
        if 0 < self.min_stage_rounds < least:
            # the rule needs window + 1 evaluations, so a smaller minimum would have no effect
            raise ConfigError(key("min_stage_rounds"), f"allowed: 0 or at least (window + 1) × eval_every = "
                                                       f"{least} (the convergence rule's own minimum), got "
                                                       f"{self.min_stage_rounds}")

    def ordered(self) -> list[float]:
        return sorted(self.lambdas, reverse=self.direction == "descending")

    def next_lambda(self, visited: list[float]) -> float | None:
        """The λ one grid step past ``visited[-1]`` in the path's direction (None: no step, or λ ≤ 0)."""
        grid = self.ordered()
        if len(grid) < 2:
            return None
        nxt = round(visited[-1] + (grid[-1] - grid[-2]), 10)
        return nxt if nxt > 0 else None


def converged(scores: list[float], window: int, tolerance: float) -> bool:
    """Whether a segment's validation scores (higher is better, oldest first) have settled: the best
    of the last ``window`` is at most ``tolerance`` above the best before them."""
    if len(scores) <= window:
        return False
    return max(scores[-window:]) <= max(scores[:-window]) + tolerance


def require_validation(cfg) -> None:
    """Both strategies choose λ by validation accuracy: the clients need a validation split."""
    if not cfg.data.val_fraction > 0:
        raise ConfigError("data.val_fraction", "λ tuning selects by validation accuracy; set a fraction "
                                               f"in (0, 1), got {cfg.data.val_fraction}")


def set_lambda(sim, lam: float) -> None:
    """Change λ of a live FPFC run (both sides of the method, and the config, kept in step)."""
    import dataclasses

    sim.set_hparams(dataclasses.replace(sim.method.hp, lam=float(lam)))


RECORD_KEYS = ("val/acc_mean", "val/rmse_mean", "test/acc_mean", "test/rmse_mean", "cluster/num", "cluster/ari",
               "fpfc/readout_acc")


def stage_record(lam: float, metrics: dict, rounds: int, wall: float, **extra: float) -> Stage:
    out = {"lambda": float(lam), "rounds": float(rounds), "wall_s": wall}
    out.update({k: float(metrics[k]) for k in RECORD_KEYS if k in metrics})
    out.update({k: float(v) for k, v in extra.items()})
    return out


def score_of(task: str) -> tuple[str, float]:
    """The validation metric λ is chosen by and its sign (the score is maximised)."""
    return ("val/rmse_mean", -1.0) if task == "regression" else ("val/acc_mean", 1.0)


#: what a λ-tuning trial reports besides the run's own metrics
PATH_METRICS = ("fpfc/selected_lambda", "fpfc/total_rounds", "fpfc/path_stages", "fpfc/lineage_rounds",
                "fpfc/converged", "fpfc/path_rounds", "fpfc/playoff_total_rounds", "fpfc/final_rounds",
                "fpfc/grid_extended", "fpfc/decline_reached", "fpfc/budget_reached", "fpfc/trial_wall_s",
                "fpfc/compute_s", "fpfc/cpu_s", "stage/*", "playoff/*")


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
    def _segment(self, sim, lam: float, cap: int, stop_early: bool) -> None:
        set_lambda(sim, lam)
        self.st.update(lam=float(lam), start=sim.round, cap=int(cap), stop_early=stop_early, scores=[],
                       t0=sim.elapsed, c0=self.st.get("cpu_s", 0.0))

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
        self.st = {"phase": "path", "lambdas": cfg.ordered(), "index": 0, "stages": [], "finalists": [],
                   "best": -math.inf, "below": 0, "extended": 0, "playoff": [], "match": 0, "wall_s": 0.0,
                   "cpu_s": 0.0}
        self._segment(sim, self.st["lambdas"][0], min(cfg.stage_cap, cfg.budget - sim.round), stop_early=True)

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
        if self.metric not in metrics:
            if rounds % cfg.eval_every == 0 or rounds >= st["cap"]:  # an evaluation this schedule asked for
                raise RuntimeError(f"the λ schedule chooses by {self.metric}, which the evaluation did not report "
                                   f"(reported: {', '.join(sorted(k for k in metrics if k.startswith('val/')))})")
            return
        st["scores"].append(self.sign * float(metrics[self.metric]))
        settled = st["stop_early"] and rounds >= cfg.min_stage_rounds and \
            converged(st["scores"], cfg.window, cfg.tolerance)
        if not (settled or rounds >= st["cap"]):
            return
        record = stage_record(st["lam"], metrics, rounds, sim.elapsed - st["t0"], converged=float(settled),
                              lineage=float(sim.round), cpu_s=st["cpu_s"] - st["c0"])
        getattr(self, f"_end_{st['phase']}")(loop, metrics, record)

    # ---- the path ------------------------------------------------------------------------------
    def _end_path(self, loop: RoundLoop, metrics: dict, record: Stage) -> None:
        sim, st, cfg = loop.sim, self.st, self.settings
        st["stages"].append(record)
        metrics.update(stage_metrics(record))
        if self.on_stage is not None:
            self.on_stage(st["index"], record)
        score = st["scores"][-1]
        self._keep_best(sim, score, record)
        if score > st["best"]:
            st["best"], st["below"], st["best_index"] = score, 0, len(st["stages"]) - 1
        else:
            st["below"] += 1
        st["index"] += 1
        if st["index"] >= len(st["lambdas"]) and st["below"] == 0 and st["extended"] < cfg.extend:
            nxt = cfg.next_lambda(st["lambdas"])   # still rising at the grid's end: the decline is further on
            if nxt is not None:
                st["lambdas"].append(nxt)
                st["extended"] += 1
        if st["below"] >= cfg.patience or st["index"] >= len(st["lambdas"]) or sim.round >= cfg.budget:
            self._after_path(loop, metrics)
        else:
            self._segment(sim, st["lambdas"][st["index"]], min(cfg.stage_cap, cfg.budget - sim.round),
                          stop_early=True)

    def _keep_best(self, sim, score: float, record: Stage) -> None:
        """Snapshot the model into the finalists (best first) if this stage is among the best."""
        finalists, size = self.st["finalists"], self.settings.finalists
        if len(finalists) >= size and score <= finalists[-1]["score"]:
            return
        finalists.append({"lam": self.st["lam"], "score": score, "lineage": sim.round, "record": dict(record),
                          "state": sim.snapshot()})
        finalists.sort(key=lambda c: -c["score"])
        del finalists[size:]

    def _after_path(self, loop: RoundLoop, metrics: dict) -> None:
        st = self.st
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
            self._segment(loop.sim, candidate["lam"], rounds, stop_early=False)
            return
        # already at the playoff's total (the latest finalist with playoff_rounds 0, or the budget)
        set_lambda(loop.sim, candidate["lam"])
        self._match_done(loop, metrics, dict(candidate["record"], rounds=0.0, wall_s=0.0, cpu_s=0.0, converged=0.0),
                         candidate["score"])

    def _end_playoff(self, loop: RoundLoop, metrics: dict, record: Stage) -> None:
        self._match_done(loop, metrics, record, self.st["scores"][-1])

    def _match_done(self, loop: RoundLoop, metrics: dict | None, record: Stage, score: float) -> None:
        st = self.st
        candidate = st["finalists"][st["match"]]
        candidate.update(score=score, record=dict(record), lineage=loop.sim.round, state=loop.sim.snapshot())
        st["playoff"].append(record)
        if metrics is not None:
            metrics.update(stage_metrics(record, "playoff/"))
        st["match"] += 1
        if st["match"] < len(st["finalists"]):
            self._start_match(loop)
        else:
            self._start_final(loop, max(st["finalists"], key=lambda c: c["score"]))

    def _start_final(self, loop: RoundLoop, winner: dict) -> None:
        sim, st = loop.sim, self.st
        st["phase"] = "final"
        sim.restore(winner["state"])
        st["finalists"] = [dict(winner, state=None)]  # the other snapshots are no longer needed
        st["selected"] = winner["lam"]
        if self.settings.budget > sim.round:
            self._segment(sim, winner["lam"], self.settings.budget - sim.round, stop_early=True)
        else:
            set_lambda(sim, winner["lam"])
            st.update(lam=winner["lam"], start=sim.round, t0=sim.elapsed)
            self._finish(loop, dict(winner["record"], rounds=0.0, wall_s=0.0, cpu_s=0.0, converged=0.0))

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
            summary["fpfc/decline_reached"] = float(st.get("best_index", 0) < len(stages) - 1)
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
