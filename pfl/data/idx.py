"""Reading and writing IDX files, the container format of MNIST and Fashion-MNIST.

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of dimensions), one
big-endian uint32 per dimension, then the values in C order, big-endian. The published files are
gzip-compressed; torchvision keeps an uncompressed copy next to them. Both are read here.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

# IDX type code -> numpy dtype (big-endian where it matters)
_CODES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
          0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    # decide by content rather than by name: some mirrors serve uncompressed files named *.gz
    if raw[:2] != _GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as err:  # a cut-off download, a damaged copy
        raise ValueError(f"{path} is truncated or corrupt ({len(raw)} bytes; gzip: {err})") from None


def read_idx(path: str | Path) -> np.ndarray:
    """The array stored in an IDX file (gzip-compressed or not), in native byte order."""
    path = Path(path)
    buf = _read_bytes(path)
    if len(buf) < 4 or buf[0] != 0 or buf[1] != 0 or buf[2] not in _CODES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {buf[:4]!r})")
    dtype, ndim = _CODES[buf[2]], buf[3]
    header = 4 + 4 * ndim
    if len(buf) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = tuple(int(s) for s in np.frombuffer(buf, dtype=">u4", count=ndim, offset=4))
    count = int(np.prod(shape, dtype=np.int64))
    if len(buf) != header + count * dtype.itemsize:
        raise ValueError(f"{path}: IDX header announces shape {shape} but the file holds "
                         f"{len(buf) - header} data bytes")
    data = np.frombuffer(buf, dtype=dtype, count=count, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file; gzip-compressed when the name ends in ``.gz``."""
    path = Path(path)
    array = np.asarray(array)
    for code, dtype in _CODES.items():
        if dtype.kind == array.dtype.kind and dtype.itemsize == array.dtype.itemsize:
            break
    else:
        raise ValueError(f"dtype {array.dtype} has no IDX type code")
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=dtype).tobytes()
    path.write_bytes(gzip.compress(payload) if path.name.endswith(".gz") else payload)
