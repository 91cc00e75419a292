"""Server state that grows with the population: what a run needs, what it has, and a refusal before any work.

A method whose server state grows with the number of clients m declares how much
(:meth:`pfl.methods.base.Method.server_bytes`; `pfl methods` lists them): FPFC's pairwise θ and v
(2·m²·p values), PACFL's proximity matrix and data bases, the last update per client that CFL and
LAG keep, FedSLR's ``server: algo2`` duals, FedSplit's and L2GD's latest models under client
sampling, DIANA's per-client shifts. :func:`check_server_memory` compares that need with the memory
the state will live in — the host's available memory (``MemAvailable``) for a CPU run, a CUDA
device's free memory — or with ``federation.server_memory_gb`` when it is set, and refuses a run
that cannot fit with one line (:class:`~pfl.schema.ConfigError`, exit status 2): the method, the
clients, the bytes, what there is, and the options (the method's own alternatives such as FPFC's
``method.shared_layers=body``, fewer clients, a smaller model, the budget key).

It runs where a run's config is known and nothing has been done yet: ``pfl run`` before the data is
loaded, ``run_sweep`` and the λ-path pipeline before Ray starts, and every
:class:`~pfl.federation.simulator.Simulator` before its method creates its state (a sweep's trials
with their own settings, the pipelines' runs). The need is the state and the temporaries a round's
server step holds on top where a method declares them
(:meth:`~pfl.methods.base.Method.server_work_bytes`; FPFC's are as large as its state: its pair
update holds four (|A|, m, p) tensors for |A| sampled devices, its first residual pass two (m, m, p)
ones, measured on an H100 to within 0.3 %). Not counted: the clients' data and states (the client
store's budget, ``federation.client_memory_gb``) and the model.

``federation.server_memory_gb`` is the override for whoever knows better (the trials run on a
larger node than the driver, memory will be freed): the budget is then that number, whatever this
machine shows. The check is not the resolver's: a config's validity must not depend on the machine
that reads it (``--print-config``, a checkpoint's config compared on resume).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import torch
from torch import nn

from .config import ExperimentConfig
from .methods import Method, get_method
from .methods.base import ModelSize
from .models import build_model, layer_groups
from .models.custom import set_head
from .schema import ConfigError

GiB = 2 ** 30
BUDGET_KEY = "federation.server_memory_gb"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB', 7.3e11 -> '676 GiB' (binary units, three significant digits)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    if unit == "B":
        return f"{n:.0f} B"
    return f"{n:.0f} {unit}" if abs(n) >= 100 else f"{n:.3g} {unit}"


# ---- what the run has ----------------------------------------------------------------------------

def host_available() -> int | None:
    """The host memory available to a new allocation without swapping (Linux ``MemAvailable``; else the
    free physical pages); None when the system says neither."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def run_device(name: str) -> torch.device:
    """The device ``federation.device`` names (``auto``: CUDA when there is one); a CUDA device that
    is not there counts as the host (the run itself refuses it)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    return dev if dev.type != "cuda" or torch.cuda.is_available() else torch.device("cpu")


def available_memory(device: torch.device, here: bool = True) -> tuple[int | None, str]:
    """(bytes, how the message says it) of the memory the server state on ``device`` may take.

    A CUDA device: its free memory when the run computes in this process (``here``); otherwise its
    total, read without creating a CUDA context (a sweep's driver must not hold one while its trials
    use the device). Anything else: the host's available memory."""
    if device.type == "cuda":
        if here:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free), f"{device} has {{}} free"
        index = device.index if device.index is not None else 0
        return int(torch.cuda.get_device_properties(index).total_memory), f"{device} has {{}} in all"
    return host_available(), "the host has {} available (MemAvailable)"


# ---- what the run needs --------------------------------------------------------------------------

def model_size(model: nn.Module, input_shape: Sequence[int], num_classes: int) -> ModelSize:
    """The :class:`~pfl.methods.base.ModelSize` of a built model (on any device, ``meta`` included)."""
    named = dict(model.named_parameters())
    first = next(iter(named.values()), None)
    return ModelSize(params=sum(t.numel() for t in named.values()),
                     head=sum(named[n].numel() for n in layer_groups(model).head),
                     features=int(math.prod(input_shape)), classes=int(num_classes),
                     itemsize=first.element_size() if first is not None else 4)


def config_model_size(cfg: ExperimentConfig, input_shape: Sequence[int] | None = None,
                      num_classes: int | None = None) -> ModelSize:
    """The size of ``cfg``'s model, built on the ``meta`` device (no memory, no initialisation) for the
    data source's sample shape (or the one given: data already loaded)."""
    if input_shape is None or num_classes is None:
        from .data import source_spec

        input_shape, num_classes = source_spec(cfg.data.source).shape(cfg.data.params)
    try:
        with torch.device("meta"):
            model = build_model(cfg.model.name, cfg.model.params, input_shape, num_classes)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001  (your own model may compute on its tensors while it is built)
        model = build_model(cfg.model.name, cfg.model.params, input_shape, num_classes)
    if cfg.model.head:
        set_head(model, cfg.model.head)
    return model_size(model, input_shape, num_classes)


def declares_memory(cls: type[Method]) -> bool:
    """Whether method class ``cls`` declares server state that grows with the population."""
    return cls.server_bytes.__func__ is not Method.server_bytes.__func__


def with_hparams(cfg: ExperimentConfig, **changes: Any) -> ExperimentConfig:
    """``cfg`` with the method's hyperparameters changed (shallow: for asking a declaration)."""
    hparams = dataclasses.replace(cfg.method.hparams, **changes)
    return dataclasses.replace(cfg, method=dataclasses.replace(cfg.method, hparams=hparams))


def server_need(cfg: ExperimentConfig, m: int, size: ModelSize, copies: int = 1) -> tuple[int, int]:
    """(state, work): the bytes of population-bound server state ``cfg``'s method declares for ``m``
    clients and a model of ``size`` (``copies`` of it), and of a round's temporaries on top."""
    cls = get_method(cfg.method.name)
    state = int(cls.server_bytes(m, size, cfg) or 0)
    return copies * state, int(cls.server_work_bytes(m, size, cfg)) if state else 0


def _largest(fits, high: int) -> int:
    """The largest n in [1, high] with fits(n) (fits is monotone: true up to some n); 0 when none."""
    if high < 1 or not fits(1):
        return 0
    low = 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


# ---- the check -----------------------------------------------------------------------------------

def check_server_memory(cfg: ExperimentConfig, m: int | None = None, size: ModelSize | None = None, *,
                        available: int | None = None, device: torch.device | None = None, here: bool = True,
                        copies: int = 1, copies_note: str = "") -> int | None:
    """Refuse ``cfg`` when its method's population-bound server state cannot fit (module docstring).

    ``m``: the clients (default ``data.num_clients``; not yet a number: nothing is checked); ``size``:
    the model's (default: built on the meta device from the config); ``available``: the bytes there
    are (default: ``federation.server_memory_gb`` when set, else what ``device`` — default the
    run's, ``federation.device`` — has, :func:`available_memory`); ``copies``: how many copies of the
    state the run keeps (the λ path: the live state and its finalists' snapshots, ``copies_note``).
    The need is the state (``copies`` times) and a round's temporaries on top
    (:meth:`~pfl.methods.base.Method.server_work_bytes`). Returns the bytes needed (None: the method
    declares nothing); raises :class:`ConfigError` on the key to change, one line."""
    cls = get_method(cfg.method.name)
    m = cfg.data.num_clients if m is None else m
    if not declares_memory(cls) or isinstance(m, bool) or not isinstance(m, int):
        return None
    size = config_model_size(cfg) if size is None else size

    def need_of(c: ExperimentConfig, clients: int = m, model: ModelSize = size) -> int:
        return sum(server_need(c, clients, model, copies))

    state, work = server_need(cfg, m, size, copies)
    need = state + work
    if not need:
        return need
    gb = cfg.federation.server_memory_gb
    if gb is not None:
        budget, said = int(gb * GiB), f"{BUDGET_KEY} allows {{}}"
    elif available is not None:
        budget, said = available, "{} are available"
    else:
        budget, said = available_memory(device or run_device(cfg.federation.device), here)
    if budget is None or need <= budget:
        return need
    key, options = "data.num_clients", []
    for name, value in cls.memory_options.items():
        if getattr(cfg.method.hparams, name, value) == value:
            continue
        other = need_of(with_hparams(cfg, **{name: value}))
        if other < need:
            options.append(f"method.{name}={value} (needs {human_bytes(other)})")
            key = f"method.{name}" if other <= budget and key == "data.num_clients" else key
    clients = _largest(lambda k: need_of(cfg, clients=k) <= budget, m - 1)
    if clients:
        options.append(f"at most {clients:,} clients (data.num_clients)")
    params = _largest(lambda p: need_of(cfg, model=size.with_params(p)) <= budget, size.params - 1)
    if params:
        options.append(f"a model of at most {params:,} parameters (model.name, model.params)")
    options.append(f"{BUDGET_KEY}=N if the run will have N GiB that this machine does not show")
    what = cls.server_memory_note or "server state that grows with the clients"
    copied = f" (× {copies}: {copies_note})" if copies > 1 else ""
    more = f", and a round needs {human_bytes(work)} more for its temporaries ({human_bytes(need)} in all)" if work else ""
    listed = f"{', '.join(options[:-1])}, or {options[-1]}" if len(options) > 1 else options[0]
    raise ConfigError(key, f"{cls.name} keeps {what}: for {m:,} clients and a model of {size.params:,} parameters "
                           f"({size.head:,} in its head) that is {human_bytes(state)}{copied}{more}, but "
                           f"{said.format(human_bytes(budget))}; options: {listed}")

__all__ = ["BUDGET_KEY", "available_memory", "check_server_memory", "config_model_size", "declares_memory",
           "host_available", "human_bytes", "model_size", "run_device", "server_need", "with_hparams"]
