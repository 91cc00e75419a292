"""The disk store's segment files: the write buffer becomes a segment written behind, on a thread,
and segments nothing needs any more are deleted or, when most of their bytes are dead, compacted.

:class:`SegmentFiles` is a part of :class:`~pfl.federation.diskstore.DiskStore`, kept apart so that
the store's module holds what a client sees (load, save, snapshots, checkpoints) and this one how its
records reach the disk and leave it. It holds no state of its own: the attributes it names are the
store's (set in its ``__init__``), and it calls back only the store's ``open``, ``_space`` and
``_stored``. A snapshot here is anything with ``segments()``: its class stays in the store's module,
which imports this one, because a checkpoint names a snapshot's class by its module.
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .records import SUFFIX, SegmentBuffer
from .store import StoreError

log = logging.getLogger(__name__)


class SegmentFiles:
    """Segment writing, collection and compaction, mixed into the disk store."""

    # the store's attributes this part reads and changes (see DiskStore.__init__)
    root: Path
    token: str
    read_only: bool
    flush_bytes: int
    index: dict[str, np.ndarray]
    spans: dict[str, np.ndarray]
    names: list[str | None]
    counts: list[int]
    sizes: list[int]
    buffer: SegmentBuffer
    pending: dict[tuple[str, int], tuple[int, int, int]]
    _inflight: tuple[int, SegmentBuffer, Future] | None
    _spare: SegmentBuffer | None
    _writer: ThreadPoolExecutor | None
    _snapshots: weakref.WeakSet[Any]

    @property
    def segment_bytes(self) -> int:
        """A segment is written when its buffer holds this much: half the write buffer, since the
        segment before it may still be in memory, being written."""
        return self.flush_bytes // 2

    def flush(self) -> None:
        """Write the buffered records and wait until every segment is on disk."""
        self._rotate()
        self._settle()

    def _rotate(self) -> None:
        """Hand the buffer to the writer as the next segment (if it holds a record that counts)."""
        if not self.pending:
            self.buffer.clear()   # only records that changed nothing, or that later saves replaced
            return
        self._write_pending()
        self._collect()
        self._maybe_compact()

    def _write_pending(self) -> None:
        """The buffer becomes segment ``len(names)``, written by a background thread: the write
        (to the page cache, and when the system holds too many unwritten pages, to the device)
        overlaps the next clients' steps; records are read from the buffer until it is done."""
        if self.read_only:
            raise StoreError(f"{self.root} is read-only here")
        self.open()
        self._settle()   # one segment in flight at a time; a failed write is raised here
        num = len(self.names)
        name = f"seg-{self.token}-{num:06d}{SUFFIX}"
        buffer = self.buffer
        self.names.append(name)
        self.counts.append(buffer.records)
        self.sizes.append(buffer.used)
        for (space, cid), span in self.pending.items():
            self._space(space)[cid] = num
            self.spans[space][cid] = span
        self.pending.clear()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pfl-store-writer")
        self._inflight = (num, buffer, self._writer.submit(buffer.write, self.root / name))
        self.buffer = self._spare if self._spare is not None else SegmentBuffer()
        self._spare = None

    def _settle(self) -> None:
        """Wait for the segment in flight to be on disk (raising the write's error)."""
        if self._inflight is None:
            return
        num, buffer, write = self._inflight
        try:
            write.result()
        finally:
            self._inflight = None
            buffer.clear()
            self._spare = buffer

    def _live(self) -> np.ndarray:
        """Live records per segment (the index's)."""
        live = np.zeros(len(self.names), dtype=np.int64)
        for arr in self.index.values():
            used = arr[arr >= 0]
            if used.size:
                live += np.bincount(used, minlength=len(self.names))
        return live

    def _pinned(self) -> set[int]:
        return set().union(*(s.segments() for s in list(self._snapshots)))

    def _collect(self) -> None:
        """Delete the segments neither the index nor a live snapshot needs."""
        if self.read_only:
            return
        keep = set(np.flatnonzero(self._live()).tolist()) | self._pinned()
        if self._inflight is not None:
            keep.add(self._inflight[0])   # not on disk yet: deleted by a later collection if dead
        for num, name in enumerate(self.names):
            if name is not None and num not in keep:
                (self.root / name).unlink(missing_ok=True)
                self.names[num] = None

    def _maybe_compact(self, min_dead: int = 256 * 2**20) -> None:
        """When dead records hold more bytes than live ones (and at least ``min_dead``), rewrite the
        live records of the unpinned segments that are mostly dead, a write buffer at a time."""
        live = self._live()
        on = [i for i, n in enumerate(self.names) if n is not None]
        frac = {i: live[i] / max(self.counts[i], 1) for i in on}
        dead = sum(self.sizes[i] * (1 - frac[i]) for i in on)
        if dead < max(min_dead, sum(self.sizes[i] * frac[i] for i in on)):
            return
        pinned = self._pinned()
        victims = [i for i in on if frac[i] < 0.5 and i not in pinned]
        log.info("client store: compacting %d segments (%.0f MB dead)", len(victims), dead / 2**20)
        for num in victims:
            for space, arr in self.index.items():
                for cid in np.flatnonzero(arr == num).tolist():
                    self.pending[(space, cid)] = self.buffer.append_record(self._stored(space, cid))
            if self.buffer.used >= self.segment_bytes:
                self._write_pending()
        if self.pending:
            self._write_pending()
        self._settle()
        self._collect()


__all__ = ["SegmentFiles"]
