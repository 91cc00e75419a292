"""Files that are whole or refused: synced writes and checksummed (sealed) checkpoint files.

**Durable writes** follow the order databases use: write a temporary name, ``fsync`` it, rename it
over the target, ``fsync`` the folder — so after a host crash or a power loss the name points at
either the old file or the complete new one, never at a renamed file whose data never reached the
device. (A killed process needs none of this: the page cache survives it; the rename alone already
made the write atomic.)

**A sealed file** is its payload followed by a 20-byte trailer: ``PFLCRC32``, the payload's length
(uint64) and its CRC-32 (uint32), little-endian. A checkpoint's payload is the zip ``torch.save``
writes; zip readers find their directory from the end and ignore what follows it, so the file still
loads with ``torch.load`` (and ``mmap=True``). :func:`check_seal` reads the whole file once and says
what is wrong with it in words: empty, no trailer, a length that is not the file's, a checksum that
does not match (``torch.load`` alone checks none of this: it ignores the zip's own CRCs, so a zeroed
block of tensor bytes loads as different weights).
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

_TRAILER = struct.Struct("<8sQI")
SEAL_MAGIC = b"PFLCRC32"
_CHUNK = 8 * 2**20
#: a zip archive's end-of-central-directory signature (a complete zip without a pfl trailer)
_ZIP_END = b"PK\x05\x06"


def sync_file(path: str | Path) -> None:
    """Force ``path``'s data to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path: str | Path) -> None:
    """Force ``path``'s entries (a rename, a new link) to the device; a no-op where folders cannot
    be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass   # some file systems refuse fsync on a folder; their renames are as durable as they get
    finally:
        os.close(fd)


def file_crc(path: str | Path, length: int | None = None) -> int:
    """CRC-32 of the first ``length`` bytes of ``path`` (all of it by default), read in chunks."""
    crc, left = 0, length
    with open(path, "rb", buffering=0) as fh:
        while left is None or left > 0:
            chunk = fh.read(_CHUNK if left is None else min(_CHUNK, left))
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            if left is not None:
                left -= len(chunk)
    return crc


def seal(path: str | Path) -> None:
    """Append the trailer (payload length and CRC-32) to ``path`` (not synced: :func:`sync_file`)."""
    path = Path(path)
    size = path.stat().st_size
    crc = file_crc(path)   # read back from the page cache: faster than hashing torch.save's many small writes
    with open(path, "ab") as fh:
        fh.write(_TRAILER.pack(SEAL_MAGIC, size, crc))


def replace_durably(tmp: str | Path, path: str | Path) -> None:
    """Rename the synced file ``tmp`` over ``path`` and sync the folder (see the module docstring)."""
    os.replace(tmp, path)
    sync_dir(Path(path).parent)


def check_seal(path: str | Path) -> str | None:
    """What is wrong with sealed file ``path``, in words (None: it is whole).

    ``"unsealed"`` for a complete zip without a trailer (a checkpoint an earlier pfl wrote, or a
    new one cut exactly at its trailer: the caller tells them apart by the format inside)."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    if size < _TRAILER.size:
        return f"is truncated ({size} bytes)"
    with open(path, "rb") as fh:
        fh.seek(size - _TRAILER.size)
        magic, length, crc = _TRAILER.unpack(fh.read(_TRAILER.size))
        if magic != SEAL_MAGIC:
            fh.seek(max(0, size - 256))
            return "unsealed" if _ZIP_END in fh.read() else (
                f"is truncated or damaged: its {size:,} bytes do not end in pfl's checksum trailer")
    if length != size - _TRAILER.size:
        return f"is truncated or damaged: its trailer says {length + _TRAILER.size:,} bytes, the file has {size:,}"
    if file_crc(path, length) != crc:
        return "is damaged: its checksum does not match its bytes"
    return None


__all__ = ["SEAL_MAGIC", "check_seal", "file_crc", "replace_durably", "seal", "sync_dir", "sync_file"]
