"""Where client steps compute: one after another, or as a vectorized cohort.

A client step (a method's client-side code, unchanged) trains and evaluates through its
:class:`~pfl.methods.base.ClientHandle`, which hands each request to the handle's **compute
object**:

* :class:`Direct` computes it at once, alone (:func:`~pfl.training.local_sgd`,
  :func:`~pfl.training.evaluate`): the sequential cohort, and any handle built for inspection.
* A seat in a :class:`Cohort` pauses the step (each step runs in a greenlet of its own) and hands
  the request to the cohort. Once every step of the cohort has paused or finished, the cohort
  groups the requests that can run together (:mod:`pfl.federation.batched`) and computes each
  group at once; every step then resumes with its own result.

Both runners offer the same two calls, so the exchange (:mod:`pfl.federation.exchange`) drives
them with one code path: :meth:`parts` (which clients run together) and :meth:`run` (a job per
client, called with the compute object it must use).

A request that cannot run batched (a closure hook, an extra loss) runs alone inside the cohort,
exactly as in the sequential one. Such clients are counted (``cohort/sequential_clients`` in the
round's metrics) and, for a method that declares ``cohort = "vectorized"``, the first one is
reported by a warning: the method asked for batching and does not get it.

The rule for client code that follows from the greenlets: no state outside ``client.state`` may
live across a ``client.train`` / ``client.evaluate`` call (a module global or thread-local set
before the call may be changed by another client's step before it returns).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

from ..training import EvalCall, EvalResult, TrainCall, TrainResult, evaluate, local_sgd
from .batched import eval_key, evaluate_cohort, train_batchable, train_cohort, train_key

log = logging.getLogger(__name__)


class Compute:
    """Computes a client's training and evaluation requests (a handle's ``compute``)."""

    def train(self, call: TrainCall) -> TrainResult:
        raise NotImplementedError

    def evaluate(self, call: EvalCall) -> EvalResult:
        raise NotImplementedError


class Direct(Compute):
    """Every request computed at once, alone."""

    def train(self, call: TrainCall) -> TrainResult:
        return local_sgd(call.model, call.params, call.x, call.y, **call.kwargs)

    def evaluate(self, call: EvalCall) -> EvalResult:
        return evaluate(call.model, call.params, call.x, call.y, call.task, forward=call.forward)


DIRECT = Direct()

#: one client's work in a cohort: called with the compute object its handle must use
Job = Callable[[Compute], Any]


class Sequential:
    """Client steps one after another, each request computed directly."""

    def parts(self, cids: Sequence[int]) -> list[list[int]]:
        return [[cid] for cid in cids]

    def run(self, jobs: Mapping[int, Job]) -> dict[int, Any]:
        return {cid: job(DIRECT) for cid, job in jobs.items()}

    def take_sequential(self) -> set[int]:
        return set()

    def round_metrics(self) -> dict[str, float]:
        return {}


class _Seat(Compute):
    """A client's place in a running cohort: a request pauses its step until the cohort answers."""

    def __init__(self, main):
        self.main = main

    def train(self, call: TrainCall) -> TrainResult:
        return self.main.switch(call)

    def evaluate(self, call: EvalCall) -> EvalResult:
        return self.main.switch(call)


class _Done:
    def __init__(self, value: Any):
        self.value = value


class Cohort:
    """Client steps in lockstep, their requests batched (``chunk`` clients at a time; 0: all).

    ``batch=False`` answers every request alone (a cohort that behaves as the sequential one).
    ``vectorizable``: the method declares ``cohort = "vectorized"`` (a fallback is then warned about).
    """

    def __init__(self, chunk: int = 0, batch: bool = True, vectorizable: bool = False, method: str = ""):
        self.chunk = chunk
        self.batch = batch
        self.vectorizable = vectorizable
        self.method = method
        self.stats = {"train_batched": 0, "train_alone": 0, "eval_batched": 0, "eval_alone": 0}
        self.sequential: set[int] = set()   # clients whose requests could not be batched (since taken)
        self.warned = False

    def parts(self, cids: Sequence[int]) -> list[list[int]]:
        return chunks(cids, self.chunk)

    def take_sequential(self) -> set[int]:
        """The clients that ran alone because a request could not be batched, since the last call."""
        out, self.sequential = self.sequential, set()
        return out

    def round_metrics(self) -> dict[str, float]:
        return {}

    def run(self, jobs: Mapping[int, Job]) -> dict[int, Any]:
        """``job(seat)`` for every client of ``jobs``; their results by client."""
        from greenlet import greenlet

        main = greenlet.getcurrent()
        seat = _Seat(main)
        workers = {cid: greenlet(lambda job=job: _Done(job(seat)), parent=main) for cid, job in jobs.items()}
        state = {cid: g.switch() for cid, g in workers.items()}
        while any(not isinstance(s, _Done) for s in state.values()):
            waiting = {cid: req for cid, req in state.items() if not isinstance(req, _Done)}
            answers = self.answer(waiting)
            for cid in waiting:
                state[cid] = workers[cid].switch(answers[cid])
        return {cid: s.value for cid, s in state.items()}

    def answer(self, requests: Mapping[int, Any]) -> dict[int, Any]:
        """Results of the paused clients' requests: groups that can run together at once, the rest alone."""
        out: dict[int, Any] = {}
        train = {i: r for i, r in requests.items() if isinstance(r, TrainCall)}
        evals = {i: r for i, r in requests.items() if isinstance(r, EvalCall)}
        groups: dict[Any, list[int]] = {}
        for i, call in train.items():
            if self.batch and not train_batchable(call):
                self._fell_back(i, "training request (a closure hook or an extra loss)")
            key = train_key(call) if self.batch and train_batchable(call) else ("alone", i)
            groups.setdefault(key, []).append(i)
        for key, members in groups.items():
            if len(members) == 1 or key[0] == "alone":
                for i in members:
                    out[i] = DIRECT.train(train[i])
                    self.stats["train_alone"] += 1
            else:
                for i, res in zip(members, train_cohort([train[i] for i in members])):
                    out[i] = res
                self.stats["train_batched"] += len(members)
        groups = {}
        for i, call in evals.items():
            key = eval_key(call) if self.batch else None
            if self.batch and key is None:
                self._fell_back(i, "evaluation request (a closure forward)")
            groups.setdefault(key if key is not None else ("alone", i), []).append(i)
        for key, members in groups.items():
            if len(members) == 1 or key[0] == "alone":
                for i in members:
                    out[i] = DIRECT.evaluate(evals[i])
                    self.stats["eval_alone"] += 1
            else:
                for i, res in zip(members, evaluate_cohort([evals[i] for i in members])):
                    out[i] = res
                self.stats["eval_batched"] += len(members)
        return out

    def _fell_back(self, cid: int, what: str) -> None:
        self.sequential.add(cid)
        if self.vectorizable and not self.warned:
            self.warned = True
            log.warning("method %s declares cohort='vectorized' but client %d's %s cannot be batched: it runs "
                        "alone (counted in cohort/sequential_clients; write the hook as a pfl.training.Term, or "
                        "declare cohort='sequential')", self.method, cid, what)


_SAID_STATISTICS = False


def batches_model(model: Any) -> bool:
    """Whether ``model``'s clients may run in a vectorized cohort: not when it keeps running
    statistics (BatchNorm). A batched group pads its clients' minibatches to one width and masks the
    padding out of the loss, but a BatchNorm layer's batch mean and variance take the padding in: a
    batched step would not compute what the client's own step computes (a client's statistics 0.02
    off after two steps: tests/test_truth_buffers.py). Such a run uses the sequential cohort, said
    once per process (a sweep's trials would repeat it)."""
    from ..models.functional import buffer_names

    global _SAID_STATISTICS
    if not buffer_names(model):
        return True
    if not _SAID_STATISTICS:
        _SAID_STATISTICS = True
        log.warning("the model keeps running statistics (BatchNorm): its clients run in the sequential cohort "
                    "(a batched group's padding would enter BatchNorm's batch statistics; pfl/federation/cohort.py)")
    return False


def cohort_runner(fed: Any, method_cls: Any, device: Any, model: Any) -> "Sequential | Cohort":
    """The runner ``federation.cohort`` asks for. ``auto`` batches only on a GPU: on CPU the batched
    cohort measured no faster than the loop, for training and evaluation alike
    (pipelines/bench_cohort.py); a model with running statistics never batches (:func:`batches_model`)."""
    vectorized = fed.cohort == "vectorized" or (
        fed.cohort == "auto" and method_cls.cohort == "vectorized" and device.type == "cuda")
    if vectorized and batches_model(model):
        return Cohort(fed.cohort_chunk, vectorizable=method_cls.cohort == "vectorized", method=method_cls.name)
    return Sequential()


def chunks(items: Sequence[int], size: int) -> list[list[int]]:
    """``items`` in pieces of at most ``size`` (0: one piece)."""
    if not size or size >= len(items):
        return [list(items)]
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


__all__ = ["Cohort", "Compute", "DIRECT", "Direct", "Job", "Sequential", "batches_model", "chunks", "cohort_runner"]
