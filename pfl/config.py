"""The experiment configuration: typed sections, YAML in and out, dotted overrides, validation.

Layout (YAML)::

    seed: 0
    plugins: [my_method.py]                           # own methods/models (pfl/plugins.py)
    data: {source: digits, num_clients: null, partition: {kind: dirichlet, alpha: 0.5}, ...}
    model: {name: auto, params: {}}
    method: {name: fedavg, <that method's hyperparameters>}
    federation: {rounds: 50, clients_per_round: 10, local_epochs: 1, batch_size: 32, lr: 0.05, ...}
    tracking: {enabled: true, experiment: pfl, run_name: null}
    compression: {uplink: {name: qsgd, s: 7}, downlink: {name: none}, error_feedback: false, min_numel: 256}
    attack: {kind: none, fraction: 0.0, ...}          # Byzantine clients (pfl/federation/attacks.py)
    newcomers: {fraction: 0.0, rounds: 50, ...}       # clients that join after training (pfl/federation/newcomers.py)
    evaluation: {when: [before, after], ...}          # evaluations beyond the default (pfl/federation/eval_modes.py)

This module is plain typed data: the sections, YAML in and out, dotted overrides. Checks that need
a registry (the method's hyperparameters, the data source, the model, the compressors) or that
span sections live in :mod:`pfl.resolver`, which builds every :class:`ExperimentConfig` a run uses
(:func:`pfl.resolver.load`, :func:`pfl.resolver.resolve`) before any data is loaded or any model is
trained: an unknown section, field, method, data source or model, or an out-of-range value, raises
:class:`~pfl.schema.ConfigError` naming the dotted field and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .schema import ConfigError, check, hp, to_dict, unknown_key_error

PARTITION_KINDS = ("auto", "natural", "iid", "dirichlet", "shards", "label_swap", "label_shift", "rotation")
#: data.num_clients when it is not given, for every source but data with its own clients (files, hf)
DEFAULT_NUM_CLIENTS = 20
#: data.num_clients: every client of data with its own clients
ALL_CLIENTS = "all"
NUM_CLIENTS_ALLOWED = (f"a whole number >= 1, or {ALL_CLIENTS} (every client of data with its own clients: files or "
                       f"hf with a natural partition); null = the default ({ALL_CLIENTS} for such data, else "
                       f"{DEFAULT_NUM_CLIENTS})")


@dataclass
class PartitionConfig:
    kind: str = hp("auto", "how pooled data is split over clients; 'auto' = 'natural' for sources "
                   "that generate per-client data (fpfc_synthetic, fpfc_linear), else 'dirichlet'",
                   choices=PARTITION_KINDS)
    alpha: float = hp(0.5, "Dirichlet concentration over labels (dirichlet; label_swap/label_shift/rotation "
                      "split labels within the population with it; 0 = iid)", low=0.0)
    classes_per_client: int = hp(2, "labels per client (shards)", low=1)
    num_clusters: int = hp(4, "number of true clusters (label_swap, label_shift, rotation)", low=1)
    sizes: str = hp("equal", "client sizes for iid/shards/label_swap/label_shift/rotation",
                    choices=("equal", "power_law"))
    power: float = hp(1.5, "power-law exponent of client sizes (sizes=power_law)", low=0.0, low_open=True)
    min_samples: int = hp(10, "minimum number of samples per client (Dirichlet redraws/repairs below it)", low=1)


@dataclass
class DataConfig:
    source: str = hp("digits", "data source (see `pfl datasets`)")
    num_clients: int | str | None = hp(None, "number of clients: a whole number >= 1, all, or null. Data with its own "
                                              "clients (files, hf; partition natural): null or all = every client "
                                              "it holds, N = N of them drawn with the experiment seed. Other "
                                              f"sources: N clients, null = {DEFAULT_NUM_CLIENTS}. A resolved config "
                                              "holds the number")
    partition: PartitionConfig = hp(default_factory=PartitionConfig)
    val_fraction: float = hp(0.1, "fraction of each client's data held out for validation", low=0.0, high=0.9)
    test_fraction: float = hp(0.2, "fraction of each client's data held out for testing", low=0.0, high=0.9)
    max_samples: int | None = hp(None, "use a stratified random subset of at most this many pooled "
                                 "samples (fast runs); null = all", low=1)
    params: dict = hp(default_factory=dict, doc="source-specific parameters (see `pfl datasets`)")
    cache: bool = hp(True, "cache partitions as Parquet keyed by a hash of this section")

    def validate(self, path: str) -> None:
        n = self.num_clients
        if not (n is None or n == ALL_CLIENTS or (isinstance(n, int) and not isinstance(n, bool) and n >= 1)):
            raise ConfigError(f"{path}.num_clients", f"{n!r} is not allowed; allowed: {NUM_CLIENTS_ALLOWED}")
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ConfigError(f"{path}.test_fraction", "val_fraction + test_fraction must be < 1")


@dataclass
class ModelConfig:
    name: str = hp("auto", "model (see `pfl methods --models`); 'auto' picks the source's default; your own: "
                           "'path/to/file.py:ClassName' or 'package.module:factory' (docs/your-data.md)")
    params: dict = hp(default_factory=dict, doc="model-specific parameters (your own model: its keyword arguments)")
    head: list[str] | None = hp(None, "parameter-name prefixes of the head, for the methods that split body and "
                                      "head (LG-FedAvg, FedRep-style partial sharing, FedSLR, PerFed-CKT, FPFC's head "
                                      "scope); null = the model's last layer (your own model: its last nn.Linear, "
                                      "filled in when the config is resolved)")


@dataclass
class WorkerResources:
    """What each worker of ``federation.workers`` asks Ray for (pfl/federation/workers.py)."""
    cpu: float = hp(1.0, "CPUs per worker (a fraction lets workers share a core)", low=0.0, low_open=True)
    gpu: float = hp(0.0, "GPUs per worker (a fraction lets several workers share one GPU); a run on a GPU "
                         "(federation.device) needs it above 0, a run on CPU at 0", low=0.0)


@dataclass
class FederationConfig:
    rounds: int = hp(50, "number of communication rounds", low=1)
    clients_per_round: int = hp(10, "clients sampled per round (capped at data.num_clients; 0 = all)", low=0)
    local_epochs: int = hp(5, "local epochs per round", low=0)
    local_steps: int | None = hp(None, "if set, local minibatch steps per round instead of epochs", low=1)
    batch_size: int = hp(32, "local minibatch size (0 = full batch)", low=0)
    lr: float = hp(0.1, "client learning rate", low=0.0, low_open=True)
    lr_decay: float = hp(1.0, "learning rate multiplied by this every lr_decay_every rounds", low=0.0, high=1.0, low_open=True)
    lr_decay_every: int = hp(1, "rounds between learning-rate decays", low=1)
    momentum: float = hp(0.0, "client SGD momentum (reset every round)", low=0.0, high=1.0, high_open=True)
    weight_decay: float = hp(0.0, "client L2 weight decay", low=0.0)
    eval_every: int = hp(1, "evaluate every this many rounds (and always at the last round)", low=1)
    eval_global: bool = hp(True, "also evaluate the global model when the method has one")
    checkpoint_every: int = hp(0, "save a checkpoint every this many rounds (0 = only on request)", low=0)
    device: str = hp("cpu", "torch device: cpu, cuda, cuda:N or auto")
    client_state_device: str = hp("auto", "where per-client state waits between a client's steps: 'device' "
                                  "(the run's device), 'cpu' (host memory, moved in for each step), or "
                                  "'auto' (the device, unless every client's state would not fit in half "
                                  "of its free memory)", choices=("auto", "device", "cpu"))
    client_store: str = hp("auto", "where per-client state and client data live: 'memory' (every client's state "
                           "and data in memory, data built at start), 'disk' (states in files under "
                           "client_store_dir, a client's data built when it is sampled; only the clients of a "
                           "step, recent data and a write buffer within client_memory_gb stay in memory), or "
                           "'auto' (memory while every client's state, at least one model copy each, and data "
                           "fit in client_memory_gb); results are the same bit for bit",
                           choices=("auto", "memory", "disk"))
    client_memory_gb: float | None = hp(None, "memory budget of client state and data (GiB) for client_store "
                                              "auto/disk; null = a quarter of the machine's physical memory",
                                        low=0.0, low_open=True)
    client_store_dir: str | None = hp(None, "folder for a disk store's files (a subfolder per run, removed when "
                                            "the run's process ends; checkpoints keep their own links); null = "
                                            "$PFL_STORE_DIR, else the system's temporary folder")
    server_memory_gb: float | None = hp(None, "memory (GiB) the server state that grows with the population may "
                                              "take (FPFC's pairwise θ and v, PACFL's proximity matrix, per-client "
                                              "updates: `pfl methods`); a method that declares more for this run is "
                                              "refused before any work. null = what the run's device has now: the "
                                              "host's available memory, a CUDA device's free memory; set it when the "
                                              "run will have more (a larger Ray node) or should use less",
                                        low=0.0, low_open=True)
    eval_clients: float = hp(0.0, "clients evaluated at the evaluation rounds before the last: 0 = every "
                                  "client; a fraction (0 < x < 1) or a count (x >= 1) of the members, drawn "
                                  "once from the run's seed, the same every time; the final evaluation always "
                                  "covers every client", low=0.0)
    threads: int = hp(1, "torch CPU threads of the run (1: federated clients train small models on small "
                         "batches, which gain little from more threads, and several threads slow to a crawl "
                         "when other jobs share the cores; 0: torch's default, one per core)", low=0)
    cohort: str = hp("auto", "how the sampled clients train: 'sequential' (one after another), 'vectorized' "
                     "(as one batched computation, torch.func.vmap; same results up to float rounding), or "
                     "'auto' (vectorized on a GPU for the methods that support it, see `pfl methods`; sequential on CPU, "
                     "where the batched cohort measured no faster than the loop)",
                     choices=("auto", "sequential", "vectorized"))
    cohort_chunk: int = hp(0, "at most this many clients in one batched computation (memory); 0 = all sampled",
                           low=0)
    stages: list = hp(default_factory=lambda: ["attack", "compression"],
                      doc="the order of the wire's stages (pfl/federation/wire.py): a sender runs them first to "
                          "last, a receiver last to first; [attack, compression] puts a Byzantine client behind "
                          "compressed uplinks, [compression, attack] lets it rewrite its encoded message")
    workers: int = hp(1, "processes a round's clients train in: 1 = this process; N > 1 = N Ray actors (on the "
                         "cluster RAY_ADDRESS names, else a Ray instance started here), each building the model, the "
                         "method's client side and the client data from this config; results are the same bit for "
                         "bit, and a resumed run may use another N", low=1)
    worker_resources: WorkerResources = hp(default_factory=WorkerResources)
    driver: str = hp("sync", "round driver: 'sync' (sampled cohorts) or 'async' (event-driven: simulated "
                             "device delays, the server updates on every arrival; methods with an "
                             "asynchronous form only)", choices=("sync", "async"))

    def validate(self, path: str) -> None:
        if self.eval_clients >= 1 and self.eval_clients != int(self.eval_clients):
            raise ConfigError(f"{path}.eval_clients", f"{self.eval_clients} is neither a fraction (0 < x < 1) "
                                                      "nor a whole number of clients; allowed: 0, (0, 1), 1, 2, ...")
        dev = self.device
        if not (dev in ("cpu", "cuda", "auto", "mps") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ConfigError(f"{path}.device", f"{dev!r} is not a device; allowed: cpu, cuda, cuda:N, mps, auto")


@dataclass
class TrackingConfig:
    enabled: bool = hp(True, "log the run to MLflow")
    experiment: str | None = hp(None, "MLflow experiment (default: mlflow.yaml's experiment)")
    run_name: str | None = hp(None, "MLflow run name (default: method@source)")
    log_model: bool = hp(True, "log the final model state as an artifact")


ATTACK_KINDS = ("none", "same_value", "sign_flip", "gaussian")


@dataclass
class AttackConfig:
    """Byzantine clients: a fixed subset rewrites every training upload (docs/methods/fpfc.md §8, after Lin et al.
    2022's code). Metrics (``test/*``, ``global/*``) are then over the benign clients only."""
    kind: str = hp("none", "what a malicious client sends instead of its upload: same_value (c·1, one c ~ "
                   "N(0, σ²) per upload), sign_flip (−|s|·upload, s ~ N(0, σ²)), gaussian (i.i.d. N(0, σ²) "
                   "entries)", choices=ATTACK_KINDS)
    fraction: float = hp(0.0, "share of the clients that are malicious: round(m·fraction) clients drawn once "
                         "from the run's seed", low=0.0, high=1.0, high_open=True)
    same_value_std: float = hp(100.0, "σ of the same-value attack's constant c", low=0.0, low_open=True)
    sign_flip_std: float = hp(10.0, "σ of the sign-flip attack's scale s", low=0.0, low_open=True)
    gaussian_std: float = hp(100.0, "σ of the Gaussian attack's entries", low=0.0, low_open=True)
    scope: str = hp("model", "what is rewritten: every floating tensor of the upload (model), or only the "
                    "tensors of the model's head, its last layer (head: the FPFC paper's 'personalization "
                    "layers' of its CNN experiments)", choices=("model", "head"))


@dataclass
class NewcomersConfig:
    """Clients held out of training that join afterwards, each by its method's rule (docs/methods/fpfc.md §8)."""
    fraction: float = hp(0.0, "share of the clients held out of training: round(m·fraction) clients drawn "
                         "once from the run's seed; 0 = none", low=0.0, high=1.0, high_open=True)
    rounds: int = hp(50, "join steps after training (at most): FPFC's newcomer-only ADMM rounds, Local's "
                     "training rounds", low=0)
    finetune_rounds: int = hp(1, "local updates of the fine-tuning rules (LG-FedAvg, Per-FedAvg: from the final "
                              "global model; Ditto: its personal task)", low=0)
    local_rounds: int = hp(1, "FPFC: local updates a newcomer makes alone before its first upload", low=1)
    tol: float = hp(1e-3, "FPFC: a newcomer stops when its upload changes by less than this, relative "
                    "(‖Δw‖ ≤ tol·‖w‖); 0 = always all rounds", low=0.0)


FIT_WHEN = ("before", "after")
UNTRAINED_MODELS = ("method", "personal", "global")


@dataclass
class EvaluationConfig:
    """Evaluations beyond the default (pfl/federation/eval_modes.py); the defaults add nothing."""
    when: list = hp(default_factory=list, doc="the round's sampled clients evaluated on their test splits around "
                                              "their local update, every round: before (the model they start from: "
                                              "fit/before/*) and/or after (the model they trained: fit/after/*); "
                                              "[] = neither")
    local_model: bool = hp(False, "at evaluation rounds, also each client's locally trained model (the one its last "
                                  "local update produced, kept in its state) on its test split: local/test_*")
    server_test: bool = hp(False, "the global model on the union of the evaluated clients' test splits as one "
                                  "pooled set (every sample weighs the same): server/test_*")
    trained_apart: bool = hp(True, "when some evaluated clients never trained, also report the trained clients' "
                                   "test/trained/* and their count test/trained/clients (synchronous driver)")
    untrained_model: str = hp("method", "what a client that never trained is evaluated with: its personal model "
                                        "(personal), the global model it receives (global), or what the method "
                                        "declares (method: Method.untrained_model)", choices=UNTRAINED_MODELS)

    def validate(self, path: str) -> None:
        bad = [w for w in self.when if w not in FIT_WHEN] if isinstance(self.when, list) else [self.when]
        if bad or len(set(self.when)) != len(self.when):
            raise ConfigError(f"{path}.when", f"{self.when!r} is not allowed; allowed: a list of distinct values "
                                              f"from {', '.join(FIT_WHEN)} (e.g. [before, after]), or []")


@dataclass
class MethodConfig:
    """``name`` plus that method's hyperparameters, resolved to its dataclass by :func:`pfl.resolver.resolve`."""
    name: str = "fedavg"
    hparams: Any = None

    def to_dict(self) -> dict:
        out = {"name": self.name}
        if self.hparams is not None:
            out.update(to_dict(self.hparams))
        return out


@dataclass
class CompressionConfig:
    """Message compression at the delivery boundary (``pfl compressors`` lists names and parameters;
    :mod:`pfl.compression.codec` says what is encoded relative to what)."""
    # a {name, ...params} mapping in YAML; after pfl.resolver.resolve a typed CompressorSpec
    uplink: Any = hp(default_factory=lambda: {"name": "none"},
                      doc="compressor of the client → server messages: {name, ...params}, e.g. "
                          "{name: qsgd, s: 7}; the update (received → trained) is compressed per tensor")
    downlink: Any = hp(default_factory=lambda: {"name": "none"},
                        doc="compressor of the server → client messages (the change since the client's "
                            "copy, per tensor)")
    error_feedback: bool = hp(False, "uplink error feedback: each client keeps the compression error in its "
                              "state and adds it to its next update (for the biased compressors: topk, "
                              "sign, randk with scale=false, fp16/bf16)")
    min_numel: int = hp(256, "tensors with fewer entries are sent dense (biases, norms)", low=0)


SECTIONS = ("seed", "plugins", "data", "model", "method", "federation", "tracking", "compression", "attack",
            "newcomers", "evaluation")


@dataclass
class ExperimentConfig:
    seed: int = 0
    plugins: list[str] = dataclasses.field(default_factory=list)  # pfl/plugins.py: own methods, models
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    method: MethodConfig = dataclasses.field(default_factory=MethodConfig)
    federation: FederationConfig = dataclasses.field(default_factory=FederationConfig)
    tracking: TrackingConfig = dataclasses.field(default_factory=TrackingConfig)
    compression: CompressionConfig = dataclasses.field(default_factory=CompressionConfig)
    attack: AttackConfig = dataclasses.field(default_factory=AttackConfig)
    newcomers: NewcomersConfig = dataclasses.field(default_factory=NewcomersConfig)
    evaluation: EvaluationConfig = dataclasses.field(default_factory=EvaluationConfig)

    def to_dict(self) -> dict:
        return {
            "seed": self.seed,
            "plugins": list(self.plugins),
            "data": to_dict(self.data),
            "model": to_dict(self.model),
            "method": self.method.to_dict(),
            "federation": to_dict(self.federation),
            "tracking": to_dict(self.tracking),
            "compression": to_dict(self.compression),
            "attack": to_dict(self.attack),
            "newcomers": to_dict(self.newcomers),
            "evaluation": to_dict(self.evaluation),
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def parse_value(text: str) -> Any:
    """A --set value: YAML scalar/list syntax (``0.1``, ``true``, ``[1, 2]``, ``null``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: dict[str, Any] | list[str] | None) -> dict:
    """Apply ``key.sub=value`` strings (or a {dotted: value} dict) to a nested dict, in order.

    Changing ``method.name`` drops the previous method's hyperparameters, which would otherwise be
    rejected as unknown fields of the new method; hyperparameters set before any name was given are
    kept for the method named later.
    """
    raw = copy.deepcopy(raw)
    if not overrides:
        return raw
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = []
        for item in overrides:
            if "=" not in item:
                raise ConfigError(item, "an override must look like key.sub=value")
            key, value = item.split("=", 1)
            items.append((key.strip(), parse_value(value)))
    # method.name first, so that hyperparameters set in the same call survive the reset
    items.sort(key=lambda kv: kv[0] != "method.name")
    for key, value in items:
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(key, "empty path component")
        if parts[0] not in SECTIONS:
            raise unknown_key_error(parts[0], SECTIONS, "")
        if key == "method.name":
            current = raw.get("method") or {}
            if current.get("name", value) != value:
                raw["method"] = {"name": value}
            else:
                raw["method"] = {**current, "name": value}
            continue
        node = raw
        for part in parts[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                nxt = {}
                node[part] = nxt
            node = nxt
        node[parts[-1]] = value
    return raw


def round_share(m: int, fraction: float) -> int:
    """round(m·fraction), halves rounded up: how many clients a share of ``m`` is."""
    return int(m * fraction + 0.5)


def parse_yaml_file(path: str | Path, what: str = "config") -> Any:
    """A YAML file's content; a syntax error names the file and the line (ConfigError on ``what``)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(what, f"no such file: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(what, f"{p}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                                f"{err.start}); save the file as UTF-8") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(what, f"{where}: YAML syntax error: {problem}") from None


def load_spec_file(path: str | Path, cls: type, what: str, noun: str | None = None):
    """A YAML file of a declarative spec (a search space, a table) as dataclass ``cls``: a missing
    file, a non-mapping or a bad field is a ConfigError on ``what`` / the field, naming the file."""
    from .schema import from_dict

    path = Path(path)
    if not path.is_file():
        raise ConfigError(what, f"no such {noun or what} file: {path}")
    raw = parse_yaml_file(path, what) or {}
    if not isinstance(raw, dict):
        raise ConfigError(what, f"{path} must hold a mapping")
    try:
        spec = from_dict(cls, raw)
    except ConfigError as err:
        raise ConfigError(err.field, f"{err.message} (in {path})") from None
    spec.path = str(path)
    return spec


def read_yaml(path: str | Path) -> dict:
    """A config file's mapping (unvalidated)."""
    loaded = parse_yaml_file(path)
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError("config", f"{path} must hold a mapping at the top level")
    return loaded or {}


def config_notes(cfg: ExperimentConfig) -> list[str]:
    """Things about a valid config that a person should hear before a run starts."""
    notes = []
    fed, m = cfg.federation, cfg.data.num_clients
    if fed.clients_per_round > m:
        notes.append(f"federation.clients_per_round={fed.clients_per_round} is more than data.num_clients="
                     f"{m}: every round samples all {m} clients")
    return notes


__all__ = [
    "ALL_CLIENTS", "ATTACK_KINDS", "AttackConfig", "CompressionConfig", "ConfigError", "DEFAULT_NUM_CLIENTS",
    "DataConfig", "EvaluationConfig", "ExperimentConfig", "FIT_WHEN", "NUM_CLIENTS_ALLOWED", "UNTRAINED_MODELS",
    "FederationConfig", "MethodConfig", "ModelConfig", "NewcomersConfig", "PartitionConfig", "SECTIONS",
    "TrackingConfig", "apply_overrides", "check", "config_notes", "parse_value", "parse_yaml_file", "read_yaml",
    "round_share",
]
