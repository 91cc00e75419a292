"""Client-state records and the segment files that hold them (the disk store's format).

**Records.** A client's state is kept as a record: its *skeleton* (the state as plain data,
:func:`pfl.federation.state.encode`, with every tensor replaced by a slot number), one descriptor
per tensor (dtype, shape, offset, requires_grad) and one byte blob holding the tensors, each at a
64-byte aligned offset. A tensor that appears twice in a state (two names for one tensor) is
stored once and comes back as one tensor, as the memory store would hand it back. Loading reads
the blob with one read into a buffer that the loaded tensors share: the one copy a step needs
anyway, since it may change its tensors in place. Tensors are stored contiguous.

**Segments.** ``seg-<store>-<n>.pfls``: the blobs of some records, then the index of their
skeletons and descriptors written with ``torch.save``, then the index's offset and a magic tag.
The index is read back with ``torch.load(weights_only=True)``, so a segment cannot name code to
run. A segment is written to a temporary name and renamed, and never changed afterwards.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .state import decode, encode
from .store import StoreError

MAGIC = b"PFLSEG01"
ALIGN = 64
SUFFIX = ".pfls"
_SLOT = "__pfl_slot__"


# ---- records ---------------------------------------------------------------------------------------

@dataclass
class Packed:
    """One state as a record: skeleton, tensor descriptors, blob."""
    skeleton: Any
    tensors: list
    blob: bytearray

    def same(self, other: "Packed | None") -> bool:
        """Bit for bit the same state (floats in the skeleton by their bytes, via pickle)."""
        return (other is not None and len(self.blob) == len(other.blob) and self.blob == other.blob
                and pickle.dumps((self.skeleton, self.tensors)) == pickle.dumps((other.skeleton, other.tensors)))


def pack(state: Any) -> Packed:
    """``state`` as a record (see the module docstring)."""
    slots: dict[tuple, int] = {}
    descs: list = []
    chunks: list[tuple[int, np.ndarray]] = []
    size = 0

    def walk(obj: Any) -> Any:
        nonlocal size
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
            if key not in slots:
                raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                offset = size + (-size) % ALIGN
                size = offset + raw.nbytes
                chunks.append((offset, raw))
                descs.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, bool(obj.requires_grad)))
                slots[key] = len(descs) - 1
            return {_SLOT: slots[key]}
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    skeleton = walk(encode(state, "client state"))
    blob = bytearray(size)
    view = memoryview(blob)
    for offset, raw in chunks:
        view[offset:offset + raw.nbytes] = raw.data
    return Packed(skeleton, descs, blob)


def unpack(rec: Packed, device: torch.device, copy: bool = True) -> Any:
    """The state a record holds, its tensors on ``device`` (sharing one fresh buffer on the CPU)."""
    buf = bytearray(rec.blob) if copy else rec.blob
    base = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    tensors = []
    for dtype, shape, offset, grad in rec.tensors:
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
        t = base[offset:offset + n].view(dt).reshape(shape)
        if device.type != "cpu":
            t = t.to(device)
        tensors.append(t.requires_grad_(True) if grad else t)

    def fill(obj: Any) -> Any:
        if isinstance(obj, dict):
            if _SLOT in obj and len(obj) == 1:
                return tensors[obj[_SLOT]]
            return {k: fill(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [fill(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(fill(v) for v in obj)
        return obj

    return decode(fill(rec.skeleton))


# ---- segment files ---------------------------------------------------------------------------------

def write_segment(path: Path, records: dict[tuple[str, int], Packed]) -> None:
    """``records`` as one segment file (written to a temporary name, then renamed)."""
    index: dict[str, dict[int, tuple]] = {}
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            pos = 0
            for (space, cid), rec in records.items():
                pad = (-pos) % ALIGN
                fh.write(b"\0" * pad)
                pos += pad
                fh.write(rec.blob)
                index.setdefault(space, {})[int(cid)] = (pos, len(rec.blob), rec.skeleton, rec.tensors)
                pos += len(rec.blob)
            buf = io.BytesIO()
            torch.save(index, buf)
            fh.write(buf.getvalue())
            fh.write(struct.pack("<Q", pos) + MAGIC)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise StoreError(f"cannot write client states to {path.parent}: {err.strerror or err}") from err


def read_segment_index(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            fh.seek(-16, os.SEEK_END)
            tail = fh.read(16)
            if tail[8:] != MAGIC:
                raise StoreError(f"{path} is not a pfl client-state segment")
            start = struct.unpack("<Q", tail[:8])[0]
            fh.seek(start)
            raw = fh.read(os.fstat(fh.fileno()).st_size - 16 - start)
        return torch.load(io.BytesIO(raw), weights_only=True)
    except OSError as err:
        raise StoreError(f"cannot read client states from {path}: {err.strerror or err}") from err


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` becomes ``src``'s file: a hard link where the file system allows, else a copy."""
    try:
        os.link(src, dst)
    except FileExistsError:
        pass
    except OSError:
        tmp = dst.with_name(dst.name + ".tmp")
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot write client states to {dst.parent}: {err.strerror or err}") from err


def prune_checkpoint_dir(directory: Path, keep: set[str]) -> None:
    """Remove the segment files of ``directory`` that are not in ``keep``."""
    if not directory.is_dir():
        return
    for f in directory.iterdir():
        if f.name.endswith(SUFFIX) and f.name not in keep:
            f.unlink(missing_ok=True)
    if not keep and not any(directory.iterdir()):
        directory.rmdir()


__all__ = ["ALIGN", "MAGIC", "Packed", "SUFFIX", "link_or_copy", "pack", "prune_checkpoint_dir", "read_segment_index",
           "unpack", "write_segment"]
