"""The disk client store: per-client state in immutable segment files (:mod:`.records`), a
client in memory only while it takes a step.

The store's *index* is one int32 array per space (client states, each server-side memory): the
segment holding each client's current record, −1 for none; beside it the record's *span* in that
segment (offset, header and blob lengths: three int64), so loading a client is one read of its
record. Saved records wait in a write buffer (``flush_bytes``) and go to disk together as one new
segment, written behind on a thread (:mod:`.segments`, which also deletes and compacts segments).

**Fresh clients have no record.** A client without a record gets ``new_state(cid)`` (the method's
``init_client``) when it is loaded, and a save that leaves a state bit for bit as it was loaded
(its record, or the fresh state) writes nothing. So a 100,000-client population costs disk only
for the clients whose state changed, and an evaluation pass over everyone writes nothing for a
method whose evaluation does not change client state. The check costs no read: the store remembers
the header of each record it handed out (:meth:`DiskStore.load`), and a state whose header changed
(a new loss, a new shape) has changed; only a state with the same header is compared byte for byte
with its record.

**Snapshots and checkpoints are indexes.** Because segments are immutable, a snapshot is a copy
of the index and spans (:class:`DiskSnapshot`, 28 bytes per client), and a checkpoint is the index plus hard
links (copies across file systems) to the segments it needs, in a folder next to the checkpoint
file: only segments written since the previous checkpoint are linked (synced to the device with
the checkpoint file: :mod:`.checkpoint`); the ones no longer needed are removed after the checkpoint file
is in place, so the last checkpoint stays whole. Every record a checkpoint needs is read and its
checksum checked when the checkpoint is loaded, before anything is trained.

**The folder is the run's.** ``pfl-store-<id>/`` holds an owner file; a killed run's folder is
removed by the next disk store that opens beside it (:mod:`.store_owner`). Segments
that neither the index nor a live snapshot needs are deleted; when most of the bytes on disk are
dead, the live records of sparse segments are rewritten into new ones (compaction).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import store_owner
from .records import Record, SegmentBuffer, check_segment, layout, link_or_copy, pack, read_record, unpack
from .segments import SegmentFiles
from .state import checkpointable
from .store import ClientStore, StoreError, memory_part

# 1: records described by a torch.save index at each segment's end; 2: records without checksums
DISK_FORMAT = 3


# ---- snapshots and checkpoint parts ----------------------------------------------------------------

@checkpointable
@dataclass(eq=False)
class DiskSnapshot:
    """Every space's index (segment numbers, −1: no record) and spans when the snapshot was taken."""
    index: dict
    spans: dict | None = None   # None only in a checkpoint of disk format 1, which is refused on resume

    def segments(self) -> set[int]:
        return {int(s) for a in self.index.values() for s in np.unique(a) if s >= 0}


def is_disk_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("store") == "disk"


def segment_names(part: Any) -> set[str]:
    """The segment files a checkpoint's client part needs (none for a memory store's part)."""
    return set(part["segments"].values()) if is_disk_part(part) else set()


def find_snapshots(obj: Any) -> list[DiskSnapshot]:
    """Every :class:`DiskSnapshot` inside ``obj`` (a checkpoint's other parts)."""
    if isinstance(obj, DiskSnapshot):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in find_snapshots(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in find_snapshots(v)]
    return []


def _replace_snapshots(obj: Any, fn: Callable[[DiskSnapshot], Any]) -> Any:
    if isinstance(obj, DiskSnapshot):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _replace_snapshots(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace_snapshots(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_replace_snapshots(v, fn) for v in obj)
    return obj


def materialized(part: dict, directory: Path, extra: Any, new_state: Callable[[int], dict],
                 device: torch.device) -> tuple[Any, Any]:
    """A disk part (and the disk snapshots in ``extra``) as a memory store's parts."""
    reader = DiskStore(directory, part["num_clients"], new_state, device, read_only=True)
    reader.adopt(part, directory, find_snapshots(extra))

    def as_memory(snap: DiskSnapshot | None = None) -> Any:
        if snap is not None:
            reader.restore(snap)
        memories = reader.memories()
        return reader.states() if not memories else {"states": reader.states(), "memories": memories}

    extra = _replace_snapshots(extra, as_memory)
    reader.restore(DiskSnapshot(part["index"], part["spans"]))
    return as_memory(), extra


# ---- the store -------------------------------------------------------------------------------------

class DiskStore(SegmentFiles, ClientStore):
    """Client states in segment files under ``base`` (see the module docstring)."""

    kind = "disk"

    def __init__(self, base: str | Path | None, num_clients: int, new_state: Callable[[int], dict],
                 device: torch.device, flush_bytes: int = 64 * 2**20, read_only: bool = False):
        self.num_clients = num_clients
        self.new_state = new_state
        self.device = torch.device(device)
        self.flush_bytes = flush_bytes
        self.token = uuid.uuid4().hex[:10]
        if read_only:
            self.root = Path(base)
        else:
            parent = Path(base or os.environ.get("PFL_STORE_DIR") or tempfile.gettempdir()).expanduser()
            self.root = parent / f"pfl-store-{self.token}"
        self.read_only = read_only
        self.index: dict[str, np.ndarray] = {self.CLIENT: self._empty()}
        self.spans: dict[str, np.ndarray] = {self.CLIENT: self._no_spans()}
        self.names: list[str | None] = []            # segment number → file name (None: deleted)
        self.counts: list[int] = []                  # segment number → records it holds
        self.sizes: list[int] = []                   # segment number → bytes
        self.buffer = SegmentBuffer()                # the next segment
        # the segment before it, while a background thread writes it (write-behind): its number,
        # its buffer (records are read from there until it is on disk) and the write
        self._inflight: tuple[int, SegmentBuffer, Future] | None = None
        self._spare: SegmentBuffer | None = None
        self._writer: ThreadPoolExecutor | None = None
        self.pending: dict[tuple[str, int], tuple[int, int, int]] = {}   # its live records' spans
        # the header of each record load() handed out, until its save (bounded: a load without a
        # save, as inspection does, must not grow it; a forgotten header is read back instead)
        self._handed: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._snapshots: weakref.WeakSet[DiskSnapshot] = weakref.WeakSet()
        self._opened = False
        self._finalizer = None

    #: headers remembered between a load and its save (a round's clients, with room to spare)
    HANDED_MAX = 8192

    def _empty(self) -> np.ndarray:
        return np.full(self.num_clients, -1, dtype=np.int32)

    def _no_spans(self) -> np.ndarray:
        return np.zeros((self.num_clients, 3), dtype=np.int64)

    def __len__(self) -> int:
        return self.num_clients

    # ---- the folder ------------------------------------------------------------------------------
    def open(self) -> None:
        if self._opened or self.read_only:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            store_owner.claim(self.root)   # also the probe that the folder is writable
        except OSError as err:
            raise StoreError(f"cannot write client states to {self.root}: {err.strerror or err} "
                             "(federation.client_store_dir, or $PFL_STORE_DIR)") from err
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self._opened = True
        store_owner.sweep(self.root.parent, keep=self.root)

    def close(self) -> None:
        try:
            self._settle()
        except StoreError:
            pass   # the folder goes anyway
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None
        if self._finalizer is not None:
            self._finalizer()
        self._opened = False

    def path(self, num: int) -> Path:
        return self.root / self.names[num]

    # ---- one client --------------------------------------------------------------------------------
    def _space(self, space: str) -> np.ndarray:
        if space not in self.index:
            self.index[space] = self._empty()
            self.spans[space] = self._no_spans()
        return self.index[space]

    def _stored(self, space: str, cid: int) -> Record | None:
        """Client ``cid``'s record on disk (None: it has none)."""
        num = int(self._space(space)[cid])
        if num < 0:
            return None
        span = tuple(int(v) for v in self.spans[space][cid])
        if self._inflight is not None and self._inflight[0] == num:   # still being written
            return self._inflight[1].record(span)
        return read_record(self.path(num), *span, what=_what(space, cid))

    def _fresh(self, space: str, cid: int) -> dict:
        return self.new_state(cid) if space == self.CLIENT else {}

    def _hand_out(self, key: tuple[str, int], header: bytes) -> None:
        self._handed[key] = header
        self._handed.move_to_end(key)
        while len(self._handed) > self.HANDED_MAX:
            self._handed.popitem(last=False)

    def load(self, cid: int, space: str = ClientStore.CLIENT) -> dict:
        key = (space, cid)
        span = self.pending.get(key)
        rec = self.buffer.record(span) if span is not None else self._stored(space, cid)
        if rec is None:
            state = self._fresh(space, cid)
            self._hand_out(key, pack(state, with_blob=False).header)
            return state
        if span is None:
            self._hand_out(key, rec.header)
        return unpack(rec, self.device, copy=False)  # a copy of the buffer, or a buffer just read: the step's own

    def save(self, cid: int, state: dict, space: str = ClientStore.CLIENT) -> None:
        key = (space, cid)
        lay = layout(state)
        handed = self._handed.pop(key, None)
        if not lay.blob_len and key not in self.pending and handed == lay.header:
            return  # no tensors, and the header is the whole state: as it was loaded (a stateless method)
        if self.buffer.used and self.buffer.used + lay.disk_bytes > max(self.segment_bytes, lay.disk_bytes):
            self._rotate()   # make room first: a save is packed straight into the buffer
        start = self.buffer.used
        span = self.buffer.append(lay)
        old = self.pending.get(key)
        if old is not None:
            unchanged = old[1:] == span[1:] and self.buffer.record(old).same(self.buffer.record(span))
        else:
            before = handed if handed is not None else self._current_header(space, cid)
            unchanged = False
            if before == lay.header:  # the same structure and plain values: compare the tensors' bytes
                if not lay.blob_len:
                    unchanged = True  # no tensors: the header is the whole state
                else:
                    stored = self._stored(space, cid)
                    if stored is None:
                        stored = pack(self._fresh(space, cid))
                    unchanged = stored.blob == self.buffer.blob(span)
        if unchanged:
            self.buffer.truncate(start)  # its record (or its fresh state) stands
            return
        self.pending[key] = span  # a record it replaces in the buffer stays there, dead
        if self.buffer.used >= self.segment_bytes:
            self._rotate()

    def _current_header(self, space: str, cid: int) -> bytes:
        stored = self._stored(space, cid)
        return stored.header if stored is not None else pack(self._fresh(space, cid), with_blob=False).header

    # ---- snapshots and checkpoints -----------------------------------------------------------------
    def snapshot(self) -> DiskSnapshot:
        self.flush()
        snap = DiskSnapshot({k: v.copy() for k, v in self.index.items()}, {k: v.copy() for k, v in self.spans.items()})
        self._snapshots.add(snap)
        return snap

    def restore(self, snapshot: Any) -> None:
        if not isinstance(snapshot, DiskSnapshot):  # a memory store's snapshot (a resumed run's)
            self.replace(*memory_part(snapshot))
            return
        missing = [n for n in snapshot.segments() if n >= len(self.names) or self.names[n] is None]
        if missing:
            raise StoreError(f"a snapshot needs segments {missing} that {self.root} no longer has")
        self._set_index(snapshot.index, snapshot.spans)
        self._snapshots.add(snapshot)
        self._collect()

    def write_checkpoint(self, directory: Path, snapshots: Sequence[Any] = ()) -> dict:
        self.flush()
        needed = set(np.flatnonzero(self._live()).tolist())
        for snap in snapshots:
            if isinstance(snap, DiskSnapshot):
                needed |= snap.segments()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"cannot write the checkpoint's client states to {directory}: "
                             f"{err.strerror or err}") from err
        for num in sorted(needed):   # synced with the checkpoint file (checkpoint._persist)
            if not (directory / self.names[num]).exists():  # segment names are never reused
                link_or_copy(self.path(num), directory / self.names[num])
        return {"store": "disk", "format": DISK_FORMAT, "num_clients": self.num_clients,
                "segments": {num: self.names[num] for num in sorted(needed)},
                "counts": {num: self.counts[num] for num in sorted(needed)},
                "next": len(self.names), "index": {k: v.copy() for k, v in self.index.items()},
                "spans": {k: v.copy() for k, v in self.spans.items()}}

    def _set_index(self, index: dict, spans: dict) -> None:
        """Every space's index and spans from a snapshot or checkpoint (the write buffer dropped)."""
        self._settle()
        self.pending.clear()
        self.buffer.clear()
        self._handed.clear()
        self.index = {k: np.asarray(v, dtype=np.int32).copy() for k, v in index.items()}
        self.spans = {k: np.asarray(spans[k], dtype=np.int64).reshape(-1, 3).copy() for k in self.index}

    def adopt(self, part: dict, directory: Path, snapshots: Sequence[Any] = ()) -> None:
        """Take over a checkpoint's segments (linked into this store's folder) and index, once every
        record it or its ``snapshots`` name is found whole (:func:`check_checkpoint_records`)."""
        self._settle()
        if part.get("format") != DISK_FORMAT:
            raise StoreError(f"the client states in {directory} are in disk format {part.get('format')}, which this "
                             f"pfl no longer reads (it reads format {DISK_FORMAT}); finish that run with the pfl that "
                             "wrote it, or start it again")
        if int(part["num_clients"]) != self.num_clients:
            raise StoreError(f"the client states in {directory} are for {part.get('num_clients')} clients, "
                             f"this run has {self.num_clients}")
        check_checkpoint_records(part, directory, snapshots)
        keep = set(part["segments"].values())
        for name in self.names:  # this store's own segments the checkpoint does not have: stale now
            if name is not None and name not in keep and not self.read_only:
                (self.root / name).unlink(missing_ok=True)
        self.token = uuid.uuid4().hex[:10]  # names of segments written from here on are new names
        self.names = [None] * int(part["next"])
        self.counts = [0] * len(self.names)
        self.sizes = [0] * len(self.names)
        if not self.read_only:
            self.open()
        for num, name in part["segments"].items():
            src = directory / name
            if not src.is_file():
                raise StoreError(f"the checkpoint's client states are incomplete: {src} is missing")
            if not self.read_only:
                link_or_copy(src, self.root / name)
            self.names[int(num)] = name
            self.counts[int(num)] = int(part["counts"][num])
            self.sizes[int(num)] = src.stat().st_size
        self._set_index(part["index"], part["spans"])

    def read_checkpoint(self, part: Any, directory: Path, extra: Any = None) -> None:
        if not is_disk_part(part):
            self.replace(*memory_part(part))
            return
        snapshots = find_snapshots(extra)
        self.adopt(part, directory, snapshots)
        for snap in snapshots:  # the λ path's finalists: their segments stay
            self._snapshots.add(snap)

    # ---- the whole population (inspection, tests, conversion) --------------------------------------
    def states(self) -> list[dict]:
        return [self.load(cid) for cid in range(self.num_clients)]

    def memories(self) -> dict[str, dict[int, dict]]:
        out = {}
        for space, arr in self.index.items():
            if space == self.CLIENT:
                continue
            cids = sorted(set(np.flatnonzero(arr >= 0).tolist()) | {c for s, c in self.pending if s == space})
            entries = {cid: self.load(cid, space) for cid in cids}
            entries = {cid: v for cid, v in entries.items() if v}
            if entries:
                out[space] = entries
        return out

    def replace(self, states: Sequence[dict], memories: dict | None = None) -> None:
        self._set_index({self.CLIENT: self._empty()}, {self.CLIENT: self._no_spans()})
        for cid, state in enumerate(states):
            self.save(cid, state)
        for space, entries in (memories or {}).items():
            for cid, value in entries.items():
                self.save(int(cid), value, space)
        self.flush()
        self._collect()

    def disk_bytes(self) -> int:
        """Bytes of this store's segment files."""
        return sum(s for s, n in zip(self.sizes, self.names) if n is not None)


def _what(space: str, cid: int) -> str:
    return f"client {cid}'s state" if space == ClientStore.CLIENT else f"client {cid}'s {space} memory"


def check_checkpoint_records(part: dict, directory: Path, snapshots: Sequence[Any] = ()) -> None:
    """Every record the checkpoint's index (and ``snapshots``) names, read from ``directory`` and
    checked against its checksum, each segment file read once; raises
    :class:`~pfl.federation.store.DamagedFileError` naming the file and the client."""
    wanted: dict[int, dict[tuple[int, int, int], str]] = {}
    views = [(part["index"], part["spans"])] + [(s.index, s.spans) for s in snapshots if isinstance(s, DiskSnapshot)]
    for index, spans in views:
        for space, arr in index.items():
            arr = np.asarray(arr)
            rows = np.asarray(spans[space], dtype=np.int64).reshape(-1, 3)
            for cid in np.flatnonzero(arr >= 0).tolist():
                span = tuple(int(v) for v in rows[cid])
                wanted.setdefault(int(arr[cid]), {}).setdefault(span, _what(space, cid))
    names = {int(k): v for k, v in part["segments"].items()}
    for num in sorted(wanted):
        if num not in names:
            raise StoreError(f"the checkpoint's index names segment {num}, which its client part does not list "
                             f"(a damaged checkpoint in {directory})")
        check_segment(directory / names[num], wanted[num])


__all__ = ["DISK_FORMAT", "DiskSnapshot", "DiskStore", "check_checkpoint_records", "find_snapshots", "is_disk_part",
           "materialized", "segment_names"]
