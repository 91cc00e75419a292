"""Store folders owned by their run: a killed run's ``pfl-store-<id>/`` is removed by the next one.

A disk store writes its client states under ``<parent>/pfl-store-<id>/`` (``parent``:
``federation.client_store_dir``, ``$PFL_STORE_DIR`` or the temporary folder) and removes the folder
when its run ends — unless the process is killed (SIGKILL, the out-of-memory killer, a lost node),
which no ``finally`` survives. So each store writes an owner file, ``.owner``: the host, the
process id and the process's start time (``/proc/<pid>/stat``; a process id is reused, a (pid,
start) pair is not). When a disk store opens, it removes every ``pfl-store-*`` folder beside it
whose owner ran on this host and is gone, and says what it freed.

Nothing a checkpoint needs is lost by that: a checkpoint's segments are hard links (or copies) in
its own folder, ``<checkpoint>.clients/``, and a resumed run reads them from there. A folder
without an owner file (written by pfl before owners existed, or being created this instant) and one
whose owner ran on another host (a shared folder) are left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path

log = logging.getLogger(__name__)

OWNER = ".owner"
PREFIX = "pfl-store-"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" where /proc is not available)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rfind(")") + 2:].split()[19]   # field 22: after pid, comm, and 19 more


def _alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # someone else's process: alive
    now = _start_time(pid)
    return not start or not now or now == start


def claim(root: Path) -> None:
    """Mark ``root`` as this process's store folder."""
    pid = os.getpid()
    (root / OWNER).write_text(f"{socket.gethostname()} {pid} {_start_time(pid)}\n")


def orphaned(folder: Path) -> bool:
    """Whether ``folder``'s owner ran on this host and is gone."""
    try:
        host, pid, *start = (folder / OWNER).read_text().split()
        pid = int(pid)
    except (OSError, ValueError):
        return False
    return host == socket.gethostname() and not _alive(pid, start[0] if start else "")


def _size(folder: Path) -> int:
    total = 0
    for f in folder.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass
    return total


def sweep(parent: Path, keep: Path | None = None) -> list[tuple[Path, int]]:
    """Remove the orphaned store folders in ``parent`` (except ``keep``); returns them with their
    sizes and logs a line saying what was freed."""
    freed = []
    try:
        folders = [p for p in parent.iterdir() if p.name.startswith(PREFIX) and p.is_dir() and p != keep]
    except OSError:
        return freed
    for folder in folders:
        if orphaned(folder):
            size = _size(folder)
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                freed.append((folder, size))
    if freed:
        total = sum(s for _, s in freed) / 2**20
        log.warning("removed %d client-state folder%s left by killed runs (%.0f MiB freed): %s", len(freed),
                    "s" if len(freed) > 1 else "", total, ", ".join(str(p) for p, _ in freed))
    return freed


__all__ = ["OWNER", "claim", "orphaned", "sweep"]
