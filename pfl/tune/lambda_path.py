"""FPFC's λ tuning strategies: a warm-started λ path vs separate runs (docs/methods/fpfc.md §4).

*Warmup (path following).* Train at the first λ of the grid until the validation accuracy
changes by less than ``tolerance`` between evaluations (or ``stage_cap`` rounds), record the
stage, then move to the next λ starting from the current state (models, pair variables, duals),
keeping the state with the best validation accuracy. Stop moving along the path once validation
accuracy has been below the best for ``patience`` consecutive stages. Finally continue the best
stage's state at its λ until its lineage has had ``budget`` rounds (the paper continues the best
model "until the maximum number of iterations is reached"; the path rounds it inherits count).

*Playoff* (ours; ``finalists`` > 1). When the stages are short, as they must be from the official
N(0,1) start, a stage's validation accuracy measures how far training has come more than how good
its λ is, so the last stages of the path always look best. The ``finalists`` best stages are then
each continued ``playoff_rounds`` more rounds from their own state, and the best of them after that
is the one continued to the budget. Every round run counts in ``total_rounds``.

*Separate.* Every λ of the same grid is trained from scratch for the full ``budget`` (docs/methods/fpfc.md
§4: the baseline of the paper's timing table), so both strategies' final models have had the same
number of rounds and the comparison is of how the rounds were spent.

Both run as :class:`LambdaPath`, a callback that steers the one round loop
(:mod:`pfl.federation.loop`): it chooses the evaluation rounds, changes λ, snapshots and restores
model states, and stops the loop when the schedule is done. Its position (phase, stages, the
finalists' snapshots) is part of the loop's checkpoint, so an interrupted path resumes where it
was. Restoring a finalist's state restores the model lineage only: the run's executed rounds,
metric steps and cumulative communication keep counting, so every round run is paid for in
``total_rounds`` and ``comm/*``.

The paper's text says the path ascends (the default here). The spec's own measurement (§4, §11)
found that from the official N(0,1) start an ascending path fragments the devices at its first
small λ (pairs pushed past aλ never feel a pull again) while a descending one keeps the structure
but learns slowly. From a common start (every device the same initial model, ``method.init_std:
0``) the ascending path re-fuses the devices as λ grows, and a descending one fragments them
instead: its validation accuracy keeps rising as λ falls, so it never stops early. Both directions
are implemented (``direction``) and measured in the issue notes.

Measured on S1 from the N(0,1) start (ρ = 1, lr 0.1, budget 2,000; the ``paper`` preset of
search_spaces/fpfc.yaml): 10-round stages do not fragment the devices, but their validation
accuracies (0.623 / 0.629 / 0.630 / 0.622 for λ = 0.8 … 1.4, seed 0) pick λ = 1.2, which continued
reaches 84.4 % on seed 0 (88.5 % on seed 1). After 200 playoff rounds λ = 1.2 is clearly behind
on seed 0 (val 0.677 vs 0.749 for λ = 1.0) and the path selects λ = 1.0 on both seeds: 88.48 % /
88.52 % test, 4 clusters, ARI 1.00, 2,420 rounds, against the separate strategy's best λ = 0.8
(88.48 % / 88.52 %) after 14,000 rounds: 5.8× fewer rounds, 6.7× less compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..federation.loop import Callback, LoopResult, RoundLoop, StopTraining
from ..schema import ConfigError, hp

Stage = dict[str, float]


@dataclass
class PathSettings:
    lambdas: list[float] = hp(default_factory=lambda: [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4],
                              doc="the λ grid (sorted by `direction`)")
    direction: str = hp("ascending", "order of the path", choices=("ascending", "descending"))
    tolerance: float = hp(1e-3, "a stage ends when |Δ val acc| between evaluations is below this", low=0.0)
    eval_every: int = hp(10, "rounds between the evaluations the stopping rule compares", low=1)
    stage_cap: int = hp(200, "round cap of one path stage", low=1)
    min_stage_rounds: int = hp(20, "rounds every stage runs before the tolerance may end it", low=0)
    patience: int = hp(2, "stop the path after this many consecutive stages below the best", low=1)
    finalists: int = hp(1, "best path stages (by val acc) continued `playoff_rounds` each before the final "
                           "choice; 1 continues the best stage (the paper's rule)", low=1)
    playoff_rounds: int = hp(0, "rounds each finalist is continued before the best of them is chosen", low=0)
    budget: int = hp(1000, "rounds of every separate run, and of the warm-up's final model counting "
                           "the path rounds it inherits", low=1)

    def validate(self, path: str) -> None:
        if not self.lambdas:
            raise ConfigError(f"{path}.lambdas" if path else "lambdas", "needs at least one λ")
        if any(v <= 0 for v in self.lambdas):
            raise ConfigError(f"{path}.lambdas" if path else "lambdas", "every λ must be > 0")
        if (self.finalists > 1) != (self.playoff_rounds > 0):
            key = "playoff_rounds" if self.finalists > 1 else "finalists"
            raise ConfigError(f"{path}.{key}" if path else key,
                              f"a playoff needs finalists > 1 and playoff_rounds > 0 (or neither), got "
                              f"finalists={self.finalists}, playoff_rounds={self.playoff_rounds}")

    def ordered(self) -> list[float]:
        return sorted(self.lambdas, reverse=self.direction == "descending")


def require_validation(cfg) -> None:
    """Both strategies choose λ by validation accuracy: the clients need a validation split."""
    if not cfg.data.val_fraction > 0:
        raise ConfigError("data.val_fraction", "λ tuning selects by validation accuracy; set a fraction "
                                               f"in (0, 1), got {cfg.data.val_fraction}")


def set_lambda(sim, lam: float) -> None:
    """Change λ of a live FPFC run (both sides of the method, and the config, kept in step)."""
    import dataclasses

    sim.set_hparams(dataclasses.replace(sim.method.hp, lam=float(lam)))


def stage_record(lam: float, metrics: dict, rounds: int, wall: float) -> Stage:
    keys = ("val/acc_mean", "test/acc_mean", "cluster/num", "cluster/ari", "fpfc/readout_acc")
    out = {"lambda": float(lam), "rounds": float(rounds), "wall_s": wall}
    out.update({k: float(metrics[k]) for k in keys if k in metrics})
    return out


# a stage record's keys -> the names its MLflow metrics carry after the prefix (stage/, playoff/)
STAGE_METRICS = {"lambda": "lambda", "val/acc_mean": "val_acc", "test/acc_mean": "test_acc",
                 "cluster/num": "clusters", "cluster/ari": "ari", "rounds": "rounds"}


#: what a λ-tuning trial reports besides the run's own metrics
PATH_METRICS = ("fpfc/selected_lambda", "fpfc/total_rounds", "fpfc/path_stages", "stage/*", "playoff/*")


def stage_metrics(stage: dict, prefix: str = "stage/") -> dict[str, float]:
    """A path stage (or playoff match) as metrics (``stage/*``, ``playoff/*``)."""
    return {prefix + name: float(stage[key]) for key, name in STAGE_METRICS.items() if key in stage}


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

    Segments of rounds are trained at one λ from a start round: a path stage (ends on the tolerance
    after ``min_stage_rounds`` or at ``stage_cap``), a playoff match (``playoff_rounds``), the final
    continuation (to ``budget`` lineage rounds) or a separate run (``budget`` rounds). Evaluations
    fall every ``eval_every`` rounds of a segment and at its end. Each stage end adds ``stage/*``
    to that round's metrics, each playoff end ``playoff/*``; at the end ``loop.summary`` holds
    ``fpfc/selected_lambda``, ``fpfc/total_rounds``, ``fpfc/path_stages`` and the final model's
    metrics.
    """

    key = "lambda_path"
    #: what the schedule changes: logged at the end as the final model's λ and the rounds run
    steered_keys = ("method.lam", "federation.rounds")

    def __init__(self, settings: PathSettings, strategy: str = "warmup",
                 on_stage: Callable[[int, Stage], None] | None = None):
        if strategy not in ("warmup", "separate"):
            raise ConfigError("strategy", f"unknown strategy {strategy!r}; allowed: warmup, separate")
        self.settings = settings
        self.strategy = strategy
        self.on_stage = on_stage
        self.st: dict[str, Any] = {}   # the position; empty before the first round

    # ---- segments ------------------------------------------------------------------------------
    def _segment(self, sim, lam: float, cap: int, stop_early: bool) -> None:
        set_lambda(sim, lam)
        self.st.update(lam=float(lam), start=sim.round, cap=int(cap), stop_early=stop_early, prev=None,
                       t0=sim.elapsed)

    def on_start(self, loop: RoundLoop) -> None:
        if self.st:
            return  # resumed from a checkpoint: the position came with it
        sim = loop.sim
        require_validation(sim.cfg)
        if self.strategy == "separate":
            self.st = {"phase": "separate"}
            self._segment(sim, sim.method.hp.lam, self.settings.budget, stop_early=False)
            return
        self.st = {"phase": "path", "index": 0, "stages": [], "finalists": [], "best": -math.inf,
                   "below": 0, "playoff": [], "match": 0}
        self._segment(sim, self.settings.ordered()[0], self.settings.stage_cap, stop_early=True)

    def wants_eval(self, loop: RoundLoop, rnd: int) -> bool:
        done = rnd + 1 - self.st["start"]
        return done % self.settings.eval_every == 0 or done >= self.st["cap"]

    def on_round(self, loop: RoundLoop, metrics: dict[str, float]) -> None:
        if "val/acc_mean" not in metrics:
            return
        sim, st, cfg = loop.sim, self.st, self.settings
        rounds = sim.round - st["start"]
        val = float(metrics["val/acc_mean"])
        ended = rounds >= st["cap"]
        if st["stop_early"] and st["prev"] is not None and rounds >= cfg.min_stage_rounds \
                and abs(val - st["prev"]) < cfg.tolerance:
            ended = True
        st["prev"] = val
        if not ended:
            return
        record = stage_record(st["lam"], metrics, rounds, sim.elapsed - st["t0"])
        getattr(self, f"_end_{st['phase']}")(loop, metrics, record)

    # ---- the phases ----------------------------------------------------------------------------
    def _end_path(self, loop: RoundLoop, metrics: dict, record: Stage) -> None:
        sim, st, cfg = loop.sim, self.st, self.settings
        st["stages"].append(record)
        metrics.update(stage_metrics(record))
        if self.on_stage is not None:
            self.on_stage(st["index"], record)
        self._keep_best(sim, record["val/acc_mean"], metrics)
        if record["val/acc_mean"] > st["best"]:
            st["best"], st["below"] = record["val/acc_mean"], 0
        else:
            st["below"] += 1
        st["index"] += 1
        if st["below"] >= cfg.patience or st["index"] >= len(cfg.ordered()):
            self._after_path(loop)
        else:
            self._segment(sim, cfg.ordered()[st["index"]], cfg.stage_cap, stop_early=True)

    def _keep_best(self, sim, val: float, metrics: dict) -> None:
        """Snapshot the model into the finalists (best first) if this stage is among the best."""
        finalists, size = self.st["finalists"], self.settings.finalists
        if len(finalists) >= size and val <= finalists[-1]["val"]:
            return
        finalists.append({"lam": self.st["lam"], "val": val, "metrics": dict(metrics), "state": sim.snapshot()})
        finalists.sort(key=lambda c: -c["val"])
        del finalists[size:]

    def _after_path(self, loop: RoundLoop) -> None:
        st = self.st
        if len(st["finalists"]) > 1 and self.settings.playoff_rounds > 0:
            # short path stages rank λ by training progress as much as by λ; a few hundred rounds
            # more from each finalist's state show which λ keeps improving
            st["phase"], st["match"] = "playoff", 0
            self._start_match(loop)
        else:
            self._start_final(loop, st["finalists"][0])

    def _start_match(self, loop: RoundLoop) -> None:
        candidate = self.st["finalists"][self.st["match"]]
        loop.sim.restore(candidate["state"])
        self._segment(loop.sim, candidate["lam"], self.settings.playoff_rounds, stop_early=False)

    def _end_playoff(self, loop: RoundLoop, metrics: dict, record: Stage) -> None:
        st = self.st
        candidate = st["finalists"][st["match"]]
        candidate.update(val=record["val/acc_mean"], metrics=dict(metrics), state=loop.sim.snapshot())
        st["playoff"].append(record)
        metrics.update(stage_metrics(record, "playoff/"))
        st["match"] += 1
        if st["match"] < len(st["finalists"]):
            self._start_match(loop)
        else:
            self._start_final(loop, max(st["finalists"], key=lambda c: c["val"]))

    def _start_final(self, loop: RoundLoop, winner: dict) -> None:
        sim, st = loop.sim, self.st
        st["phase"] = "final"
        sim.restore(winner["state"])
        st["finalists"] = [dict(winner, state=None)]  # the other snapshots are no longer needed
        if self.settings.budget > sim.round:
            self._segment(sim, winner["lam"], self.settings.budget - sim.round, stop_early=False)
        else:
            set_lambda(sim, winner["lam"])
            st.update(lam=winner["lam"], start=sim.round, t0=sim.elapsed)
            self._finish(loop, stage_record(winner["lam"], winner["metrics"], 0, 0.0))

    def _end_final(self, loop: RoundLoop, metrics: dict, record: Stage) -> None:
        self._finish(loop, record)

    def _end_separate(self, loop: RoundLoop, metrics: dict, record: Stage) -> None:
        self._finish(loop, record)

    def _finish(self, loop: RoundLoop, final: Stage) -> None:
        st = self.st
        self.loop_executed = loop.sim.executed
        st["phase"], st["final"] = "done", final
        loop.summary.update({"fpfc/selected_lambda": final["lambda"], "fpfc/total_rounds": float(loop.sim.executed),
                             "fpfc/path_stages": float(len(st.get("stages", [])) or 1)})
        loop.summary.update({k: v for k, v in final.items() if "/" in k})
        raise StopTraining("FINISHED")

    # ---- results -------------------------------------------------------------------------------
    def result(self, loop: RoundLoop) -> PathResult:
        st = self.st
        stages = st.get("stages") or [st["final"]]
        return PathResult(stages, float(st["final"]["lambda"]), st["final"], int(loop.sim.executed),
                          loop.sim.elapsed, extra={"playoff": list(st.get("playoff", []))})

    def on_end(self, loop: RoundLoop, result: LoopResult) -> None:
        if result.status == "FINISHED" and self.st.get("phase") != "done":
            raise RuntimeError("the λ schedule did not finish (the loop ended before it)")

    def write_artifacts(self, loop: RoundLoop, outdir: Path) -> list[tuple[Path, str | None]]:
        if self.strategy != "warmup" or not self.st.get("stages"):
            return []
        from .fpfc_trainable import plot_path, write_stages

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
    ``finalists`` > 1), then the chosen λ continued to the budget (without callbacks of a sweep)."""
    controller = _run(sim, LambdaPath(settings, "warmup", on_stage), on_round)
    return controller.result(controller.loop)


def separate_run(sim, lam: float, settings: PathSettings,
                 on_round: Callable[[dict], None] | None = None) -> Stage:
    """One λ from scratch for the full budget (the separate strategy's unit of work)."""
    set_lambda(sim, lam)
    controller = _run(sim, LambdaPath(settings, "separate"), on_round)
    return controller.st["final"]
