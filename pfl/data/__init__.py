"""Data: sources, partitioners, per-client splits and the partition cache.

Entry points::

    resolve_data_config(cfg.data)                   # validate + complete the data section, no work
    data = load_federated(cfg.data, seed, device)   # FederatedData: one ClientData per client
    list_sources(), source_spec(name)               # the registry behind `pfl datasets`

Modules: :mod:`.sources` (registry and params), :mod:`.images` and :mod:`.idx` (file formats),
:mod:`.synthetic` (FPFC generators), :mod:`.crowd` (a large population generated on demand), :mod:`.files` with
:mod:`.readers`, :mod:`.leaf` and :mod:`.tables` (a user's own files), :mod:`.hf` (Hugging Face data sets), :mod:`.partition` (partitioners, stratified splits),
:mod:`.transforms` (label swap, rotation), :mod:`.cache` (Parquet cache), :mod:`.federated`
(the containers and entry points).
"""

from .federated import ClientData, FederatedData, held_partition, load_federated, resolve_data_config
from .sources import SourceData, SourceSpec, list_sources, register_source, source_spec
from . import crowd, files, hf  # noqa: E402,F401  (register data.source: crowd, files and hf)

__all__ = [
    "ClientData", "FederatedData", "SourceData", "SourceSpec", "held_partition", "list_sources", "load_federated",
    "register_source", "resolve_data_config", "source_spec",
]
