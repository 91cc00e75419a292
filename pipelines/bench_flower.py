"""bench_workers' FedAvg rows in Flower's simulation: the same partition, CNN, initial weights, clients and SGD.

    .venv-flower/bin/python pipelines/bench_flower.py '{"clients": 1000, "per_round": 50, "rounds": 4, "actors": 2}'

Run with a Python that has ``flwr[simulation]`` and its own Ray (bench_workers' docstring: a venv beside
the system packages, so ``import pfl`` works); bench_workers ``--flower PYTHON`` runs it. Everything a
run is made of comes from pfl itself, so only the framework differs: the config is bench_workers'
(``fmnist_dir01`` with its overrides: FedAvg, ``cnn_fedavg``, ``clients`` clients, one local epoch,
batch 20, lr 0.05, seed ``seed``, default 0); every process builds the partition
with ``load_federated`` (each client when first asked for) and the model as pfl's simulator does; the
initial global model is FedAvg's (``RunContext.init_params``) and round r's clients are pfl's
(``Population.sample``), both computed in a helper process so the Flower server holds no data.

Flower's side is its current API: ``run_simulation`` (deprecated in 1.42 for ``flwr run``, which needs a
packaged app and drives the same engine, ``_run_simulation``) with a ``ServerApp`` running Flower's ``FedAvg``
(``Strategy.start``; weighted by ``num-examples``, numpy aggregation) and a ``ClientApp`` (Message API)
on ``actors`` Ray actors (``init_args.num_cpus`` the machine's cores, ``client_resources.num_cpus``
cores / actors). The one change to FedAvg is ``configure_train``: it sends to the nodes of pfl's sampled
clients (a query to every node first maps node ids to partition ids; it also warms the actors up). A
client trains as pfl's FedAvg client does, written as a plain PyTorch loop: ``torch.optim.SGD`` with
pfl's learning rate, each epoch one ``randperm`` from pfl's generator of (seed, round, client, "train")
and its batches in order (the whole set unshuffled when it fits in one batch), cross-entropy, pfl's
thread count; so a client's update has pfl's bits (tests/test_bench_flower.py). Only the aggregation
rounds differently (Flower: Σ (w_k/W)·x_k in float32, in the replies' arrival order, so its bits also
depend on the number of actors; pfl: Σ w_k·x_k, then / W). No evaluation. The Flower server also
polls: its grid pulls replies every 0.1 s and the engine looks for messages to every node every 0.1 s
(part of what its rows measure).

One warm-up round (the actors build their data and model), then ``rounds`` timed rounds; the times are
the gaps between ``evaluate_fn`` calls (the strategy calls it after every round's aggregation). Printed
(last line, JSON): s/round (median), the driver's CPU s/round, the CPU s/round of the driver plus the
actors (``/proc``, pids the actors report), the driver's peak plus the actors' resident MiB at the end,
the driver's and the actors' proportional set sizes at the end summed,
the final model's digest and its accuracy on the pooled test splits. ``save`` in the spec: the final
model goes there (``torch.save``, for tests).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from pfl import bench  # noqa: E402

_SETUPS: dict[str, SimpleNamespace] = {}   # per process: the run's data, model and context, by spec


def setup(spec_json: str) -> SimpleNamespace:
    """The run bench_workers' child builds (config, data, model, context), once per process."""
    if spec_json not in _SETUPS:
        from pfl.data import load_federated
        from pfl.federation.context import FederationMeta, RunContext
        from pfl.federation.newcomers import newcomer_clients
        from pfl.federation.population import Population
        from pfl.models import build_model
        from pfl.models.custom import prepare_model
        from pfl.resolver import load
        from pfl.tune.space import load_scenario

        spec = json.loads(spec_json)
        overrides = {"method.name": "fedavg", "model.name": "cnn_fedavg", "data.num_clients": spec["clients"],
                     "federation.clients_per_round": spec["per_round"], "federation.local_epochs": 1,
                     "federation.rounds": 10**6, "federation.eval_every": 10**6, "tracking.enabled": False,
                     "seed": spec.get("seed", 0)}
        cfg = load(None, overrides, load_scenario("fmnist_dir01"))
        torch.set_num_threads(cfg.federation.threads)
        data = load_federated(cfg.data, cfg.seed, on_demand=True)
        torch.manual_seed(cfg.seed)  # as the simulator builds its model
        model = prepare_model(build_model(cfg.model.name, cfg.model.params, data.input_shape, data.num_classes),
                              cfg, data)
        ctx = RunContext(cfg=cfg, meta=FederationMeta.of(data), model=model, device=torch.device("cpu"),
                         newcomers=newcomer_clients(cfg, len(data.clients)))
        _SETUPS[spec_json] = SimpleNamespace(cfg=cfg, data=data, model=model, ctx=ctx,
                                             population=Population(ctx, data.client_ids))
    return _SETUPS[spec_json]


def plan(spec_json: str, rounds: int) -> tuple[dict, list[list[int]]]:
    """FedAvg's initial global model and the clients of rounds 0 … rounds-1, as pfl draws them."""
    s = setup(spec_json)
    return {k: v.numpy() for k, v in s.ctx.init_params().items()}, [s.population.sample(r) for r in range(rounds)]


def accuracy(spec_json: str, params: dict) -> float:
    """``params`` on every client's test split pooled (pfl's evaluation routine)."""
    from pfl.training import evaluate

    s = setup(spec_json)
    x = torch.cat([c.x_test for c in s.data.clients])
    y = torch.cat([c.y_test for c in s.data.clients])
    return evaluate(s.model, {k: torch.as_tensor(v) for k, v in params.items()}, x, y).acc


def sgd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, lr: float, batch_size: int, epochs: int,
        generator: torch.Generator) -> float:
    """pfl's local SGD without its hooks, as a PyTorch loop; returns the mean batch loss."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    n, total, steps = len(y), torch.zeros(()), 0
    for _ in range(epochs if n else 0):
        if batch_size <= 0 or batch_size >= n:
            parts = [(x, y)]
        else:
            perm = torch.randperm(n, generator=generator)
            xs, ys = x[perm], y[perm]
            parts = [(xs[i:i + batch_size], ys[i:i + batch_size]) for i in range(0, n, batch_size)]
        for xb, yb in parts:
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            total += loss.detach()
            steps += 1
    return float(total) / max(steps, 1)


client_app = ClientApp()


@client_app.query()
def where(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"where": MetricRecord({"partition-id": int(context.node_config["partition-id"]),
                                                      "pid": os.getpid()})}), reply_to=msg)


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    s = setup(str(config["spec"]))
    rnd, cid, fed = int(config["server-round"]) - 1, int(context.node_config["partition-id"]), s.cfg.federation
    data = s.data.clients[cid]
    s.model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loss = sgd(s.model, data.x_train, data.y_train, lr=s.ctx.lr(rnd), batch_size=fed.batch_size,
               epochs=fed.local_epochs, generator=s.ctx.generator(rnd, cid, "train"))
    return Message(RecordDict({"arrays": ArrayRecord(s.model.state_dict()),
                               "metrics": MetricRecord({"train_loss": loss, "num-examples": len(data.y_train)})}),
                   reply_to=msg)


class PflClients(FedAvg):
    """Flower's FedAvg sending round r's training to the nodes of pfl's clients of round r − 1."""

    def __init__(self, picks: list[list[int]], node_of: dict[int, int], spec_json: str):
        super().__init__(fraction_train=len(picks[0]) / len(node_of), fraction_evaluate=0.0,
                         min_available_nodes=len(node_of))
        self.picks, self.node_of, self.spec_json = picks, node_of, spec_json

    def configure_train(self, server_round, arrays, config, grid):
        config["server-round"], config["spec"] = server_round, self.spec_json
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return [Message(content=record, message_type=MessageType.TRAIN, dst_node_id=self.node_of[cid])
                for cid in self.picks[server_round - 1]]


def measure(spec: dict, helper: ProcessPoolExecutor) -> dict:
    spec_json = json.dumps({k: spec[k] for k in ("clients", "per_round", "seed") if k in spec}, sort_keys=True)
    timed, actors, cores = spec["rounds"], spec["actors"], os.cpu_count() or 1
    init, picks = helper.submit(plan, spec_json, timed + 1).result()
    marks: list[tuple[float, float]] = []   # (wall, driver CPU) after each round; [0]: before the first
    seen: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        while len(nodes := list(grid.get_node_ids())) < spec["clients"]:  # the nodes register after this starts
            time.sleep(0.1)
        replies = grid.send_and_receive([Message(RecordDict(), message_type=MessageType.QUERY, dst_node_id=n)
                                         for n in nodes])
        where = {m.metadata.src_node_id: m.content["where"] for m in replies}
        node_of = {int(w["partition-id"]): n for n, w in where.items()}
        seen["pids"] = sorted({int(w["pid"]) for w in where.values()})

        def evaluate_fn(server_round: int, arrays: ArrayRecord) -> None:
            marks.append((time.perf_counter(), time.process_time()))
            if server_round == 1:
                seen["cpu0"] = bench.proc_cpu_and_rss(seen["pids"])[0]
            if server_round == timed + 1:
                seen["cpu1"], seen["rss"] = bench.proc_cpu_and_rss(seen["pids"])
                seen["pss"] = bench.pss_mib([os.getpid(), *seen["pids"]])
                seen["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            return None

        result = PflClients(picks, node_of, spec_json).start(grid, ArrayRecord({k: torch.from_numpy(v) for k, v in
                                                                                 init.items()}),
                                                             num_rounds=timed + 1, evaluate_fn=evaluate_fn)
        seen["model"] = {k: v.numpy() for k, v in result.arrays.items()}

    run_simulation(server_app, client_app, num_supernodes=spec["clients"],
                   backend_config={"init_args": {"num_cpus": cores, "log_to_driver": False},
                                   "client_resources": {"num_cpus": cores / actors, "num_gpus": 0.0}})
    if len(seen.get("pids", [])) != actors or "model" not in seen:
        raise RuntimeError(f"{spec}: {len(seen.get('pids', []))} actors answered, the run "
                           f"{'finished' if 'model' in seen else 'did not finish'}")
    times = [b[0] - a[0] for a, b in zip(marks[1:], marks[2:])]
    own = marks[-1][1] - marks[1][1]
    model = seen["model"]
    if spec.get("save"):
        torch.save({k: torch.from_numpy(v) for k, v in model.items()}, spec["save"])
    return {"s_per_round": statistics.median(times), "wall_s": marks[-1][0] - marks[1][0],
            "driver_cpu_s": own / timed, "all_cpu_s": (own + seen["cpu1"] - seen["cpu0"]) / timed,
            "peak_mib": seen["peak"] + seen["rss"], "pss_mib": seen["pss"], "driver_peak_mib": seen["peak"], "actors_mib": seen["rss"],
            "test_acc": helper.submit(accuracy, spec_json, model).result(),
            "digest": hashlib.sha256(b"".join(v.tobytes() for v in model.values())).hexdigest()[:12],
            "workers_seen": len(seen["pids"])}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as helper:
        result = measure(spec, helper)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    import bench_flower  # the ClientApp's functions then pickle by reference (the actors import this file)

    sys.exit(bench_flower.main())
