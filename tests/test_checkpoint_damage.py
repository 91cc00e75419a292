"""Checkpoints that are right or refused: each way a checkpoint of a real disk-store run can be
damaged — empty, truncated, zeroed, a flipped bit, another version's, a missing or damaged segment,
a path that does not exist — is one line on stderr naming the file and what is wrong, exit 2,
nothing trained; runs killed with SIGKILL (one in the middle of a checkpoint's write, one in the
middle of a segment's, one while a resume loads) resume to the uninterrupted run's bits; a killed
run's store folder is removed by the next run.

The damage is done to the bytes on disk, the way a failing disk or a cut copy does it, and the
verdict comes from pfl's own command line (``pfl.cli.main``, its exit code and stderr)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import same, untimed
from pfl import cli
from pfl.callbacks.divergence import run_rounds
from pfl.federation.checkpoint import clients_dir, load_checkpoint, read_checkpoint, save_checkpoint, wait_checkpoint
from pfl.federation.diskstore import DiskStore
from pfl.federation.drivers import simulator_for
from pfl.federation.durable import seal
from pfl.federation.records import ALIGN
from pfl.federation.state import encode
from pfl.federation.store import DamagedFileError
from pfl.federation.store_owner import OWNER, orphaned, sweep
from pfl.resolver import load

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"data.source": "digits", "data.num_clients": "10", "data.partition.kind": "dirichlet",
            "data.partition.alpha": "0.5", "federation.clients_per_round": "5", "federation.batch_size": "32",
            "federation.lr": "0.1", "method.name": "ditto", "federation.client_store": "disk",
            "federation.checkpoint_every": "1"}


def run_args(ckpt: Path, stores: Path, rounds: int, *extra: str) -> list[str]:
    sets = {**SETTINGS, "federation.rounds": str(rounds), "federation.client_store_dir": str(stores)}
    return ["run", "--no-track", "--checkpoint", str(ckpt), *extra,
            *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A 2-round Ditto run on a disk store, its checkpoint written every round."""
    base = tmp_path_factory.mktemp("original")
    assert cli.main(run_args(base / "c.pt", base / "stores", 2)) == 0
    assert clients_dir(base / "c.pt").is_dir()
    return base / "c.pt"


@pytest.fixture
def ckpt(original, tmp_path):
    """A copy of the original checkpoint (file and segment folder) to damage."""
    shutil.copyfile(original, tmp_path / "c.pt")
    shutil.copytree(clients_dir(original), clients_dir(tmp_path / "c.pt"))
    return tmp_path / "c.pt"


def refused(capsys, ckpt: Path, *words: str, flag: str = "--resume") -> str:
    """Resume from ``ckpt``: exit 2, one line on stderr naming ``words``; the checkpoint untouched."""
    capsys.readouterr()
    before = ckpt.read_bytes() if ckpt.exists() else None
    code = cli.main(run_args(ckpt, ckpt.parent / "stores", 3, flag))
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("WARNING")]   # a swept store's notice
    assert code == 2, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    for word in words:
        assert word in err[0], (word, err[0])
    assert (ckpt.read_bytes() if ckpt.exists() else None) == before   # nothing trained, nothing saved
    return err[0]


def flip(path: Path, offset: int, length: int = 1, zero: bool = False) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        data = fh.read(length)
        fh.seek(offset)
        fh.write(bytes(length) if zero else bytes(b ^ 0xFF for b in data))


# ---- the checkpoint file -------------------------------------------------------------------------

def test_an_empty_checkpoint_is_refused(capsys, ckpt):
    os.truncate(ckpt, 0)
    refused(capsys, ckpt, str(ckpt), "is empty (0 bytes)")


def test_a_truncated_checkpoint_is_refused_as_damaged_not_as_unsafe(capsys, ckpt):
    os.truncate(ckpt, ckpt.stat().st_size // 2)
    line = refused(capsys, ckpt, str(ckpt), "truncated")
    assert "safe" not in line


def test_a_checkpoint_cut_exactly_at_its_trailer_is_refused(capsys, ckpt):
    os.truncate(ckpt, ckpt.stat().st_size - 20)
    refused(capsys, ckpt, str(ckpt), "truncated")


def test_a_zeroed_block_of_the_same_size_is_refused(capsys, ckpt):
    """4 KiB of zeros in the middle: torch.load alone would read different weights."""
    size = ckpt.stat().st_size
    flip(ckpt, size // 2 - 2048, 4096, zero=True)
    assert ckpt.stat().st_size == size
    refused(capsys, ckpt, str(ckpt), "checksum does not match")


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_one_flipped_bit_is_refused(capsys, ckpt, where):
    with open(ckpt, "r+b") as fh:
        fh.seek(int(ckpt.stat().st_size * where))
        byte = fh.read(1)[0]
        fh.seek(-1, 1)
        fh.write(bytes([byte ^ 0x10]))
    refused(capsys, ckpt, str(ckpt), "damaged")


def test_a_checkpoint_of_another_version_is_refused_naming_its_format(capsys, ckpt):
    raw = torch.load(ckpt, weights_only=True)
    raw["format"] = 3
    torch.save(raw, ckpt)                      # an earlier pfl's: no trailer
    refused(capsys, ckpt, str(ckpt), "another pfl version", "format 3")
    raw["format"] = 99
    torch.save(raw, ckpt)
    seal(ckpt)                                 # a later pfl's, whole
    refused(capsys, ckpt, str(ckpt), "another pfl version", "format 99")


def test_a_file_that_is_not_a_checkpoint_is_refused(capsys, ckpt):
    ckpt.write_text("round,acc\n1,0.5\n" * 100)
    refused(capsys, ckpt, str(ckpt), "damaged")


def test_resume_from_a_checkpoint_that_does_not_exist_is_refused(capsys, tmp_path):
    refused(capsys, tmp_path / "absent.pt", str(tmp_path / "absent.pt"), "does not exist")


def test_resume_if_exists_starts_a_new_run_when_there_is_none(capsys, tmp_path):
    assert cli.main(run_args(tmp_path / "new.pt", tmp_path / "stores", 1, "--resume-if-exists")) == 0
    assert "no checkpoint at" in capsys.readouterr().out
    assert read_checkpoint(tmp_path / "new.pt")["run"]["executed"] == 1


# ---- the segments -------------------------------------------------------------------------------

def stored_record(ckpt: Path) -> tuple[int, Path, tuple[int, int, int]]:
    """A client with a record in the checkpoint: its id, its segment in the checkpoint's folder, its span."""
    part = read_checkpoint(ckpt)["model"]["clients"]
    index = np.asarray(part["index"]["client"])
    cid = int(np.flatnonzero(index >= 0)[-1])
    name = part["segments"][int(index[cid])]
    span = tuple(int(v) for v in np.asarray(part["spans"]["client"]).reshape(-1, 3)[cid])
    return cid, clients_dir(ckpt) / name, span


def test_a_missing_segment_is_refused_naming_it(capsys, ckpt):
    _, seg, _ = stored_record(ckpt)
    seg.unlink()
    refused(capsys, ckpt, str(seg), "missing")


def test_a_damaged_client_record_is_refused_naming_the_file_and_the_client(capsys, ckpt):
    """256 bytes inverted inside one client's personal model (the size unchanged)."""
    cid, seg, (offset, header_len, blob_len) = stored_record(ckpt)
    blob = offset + -(-(12 + header_len) // ALIGN) * ALIGN
    flip(seg, blob + blob_len // 2, 256)
    refused(capsys, ckpt, str(seg), f"client {cid}'s state", "checksum does not match")


def test_a_truncated_segment_is_named_in_the_checkpoints_folder(capsys, ckpt):
    _, seg, _ = stored_record(ckpt)
    os.truncate(seg, seg.stat().st_size // 2)
    refused(capsys, ckpt, str(seg), "truncated")


def test_a_record_damaged_in_a_live_store_names_the_client(tmp_path):
    store = DiskStore(tmp_path, 4, lambda cid: {}, torch.device("cpu"), flush_bytes=0)
    store.save(3, {"w": torch.arange(1000.0)})
    store.flush()
    path = store.path(int(store.index["client"][3]))
    flip(path, path.stat().st_size - 200)
    with pytest.raises(DamagedFileError, match=rf"{path}: client 3's state .* checksum does not match"):
        store.load(3)
    store.close()


# ---- killed runs ----------------------------------------------------------------------------------

#: run in a child: the CLI, killed with SIGKILL by itself at a chosen moment (``PFL_KILL_AT``):
#: ``checkpoint:N`` half-way through writing the N-th checkpoint file, ``segment:N`` half-way
#: through the N-th segment file, ``resume`` once a resume has read its checkpoint
CHILD = r"""
import os, signal, sys
import torch
from pfl import cli
from pfl.callbacks.divergence import run_rounds
from pfl.federation import checkpoint, records

kind, _, nth = os.environ.get("PFL_KILL_AT", "").partition(":")
calls = [0]

def half_and_die(path):
    os.truncate(path, os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)

if kind == "checkpoint":
    save = torch.save
    def killing_save(obj, f, *a, **k):
        save(obj, f, *a, **k)
        if str(f).endswith(".pt.tmp"):
            calls[0] += 1
            if calls[0] == int(nth):
                half_and_die(f)
    torch.save = killing_save
elif kind == "segment":
    write = records.SegmentBuffer.write
    def killing_write(self, path):
        calls[0] += 1
        if calls[0] == int(nth):
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as fh:
                fh.write(bytes(self.buf[:self.used // 2]))
            os.kill(os.getpid(), signal.SIGKILL)
        write(self, path)
    records.SegmentBuffer.write = killing_write
elif kind == "resume":
    read = checkpoint.read_checkpoint
    def killing_read(path):
        read(path)
        os.kill(os.getpid(), signal.SIGKILL)
    checkpoint.read_checkpoint = killing_read
sys.exit(cli.main(sys.argv[1:]))
"""


def child(args: list[str], kill_at: str = "") -> int:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "PFL_KILL_AT": kill_at}
    return subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True,
                          timeout=600).returncode


def final_state(ckpt: Path, rounds: int):
    """A simulator of the runs' config, continued from ``ckpt``."""
    sets = {**SETTINGS, "federation.rounds": str(rounds), "tracking.enabled": "false"}
    cfg = load(None, [f"{k}={v}" for k, v in sets.items()])
    sim = simulator_for(cfg)(cfg)
    load_checkpoint(sim, ckpt)
    return sim


def test_runs_killed_three_times_resume_to_the_uninterrupted_runs_bits(tmp_path):
    """Killed half-way through a checkpoint file (round 2's), half-way through a segment file, and
    while a resume loads; each time the job is started again with ``--resume-if-exists``. Its final
    checkpoint holds what the uninterrupted run's holds (server, every client's state, history and
    ledger), and no killed run's store folder is left."""
    rounds = 5
    straight, killed, stores = tmp_path / "straight.pt", tmp_path / "killed.pt", tmp_path / "stores"
    assert child(run_args(straight, tmp_path / "stores-straight", rounds)) == 0
    left = []   # the store folders on disk after each kill
    for kill_at in ("checkpoint:2", "segment:2", "resume"):
        assert child(run_args(killed, stores, rounds, "--resume-if-exists"), kill_at) == -signal.SIGKILL
        left.append(sorted(p.name for p in stores.glob("pfl-store-*")))
    # each killed run leaves its folder; the next one to open a store removes it (the third was
    # killed before its store opened, so the second's is still there)
    assert [len(names) for names in left] == [1, 1, 1] and left[0] != left[1] == left[2]
    assert child(run_args(killed, stores, rounds, "--resume-if-exists")) == 0
    assert not list(stores.glob("pfl-store-*"))          # removed by the run that finished
    a, b = final_state(straight, rounds), final_state(killed, rounds)
    assert a.executed == b.executed == rounds
    assert untimed(a.history) == untimed(b.history)
    same(encode(a.model_state()), encode(b.model_state()))
    assert a.ledger.state_dict() == b.ledger.state_dict()


# ---- store folders ------------------------------------------------------------------------------

def test_a_store_whose_owner_is_gone_is_removed_and_a_live_ones_kept(tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    import socket

    gone, live, legacy, foreign = (tmp_path / f"pfl-store-{n}" for n in ("gone", "live", "legacy", "foreign"))
    for folder in (gone, live, legacy, foreign):
        folder.mkdir()
        (folder / "seg-x-000000.pfls").write_bytes(b"\0" * 5000)
    (gone / OWNER).write_text(f"{socket.gethostname()} {dead} 1\n")
    (live / OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    (foreign / OWNER).write_text(f"another-host-{os.getpid()} {dead}\n")
    assert orphaned(gone) and not orphaned(live) and not orphaned(legacy) and not orphaned(foreign)
    freed = sweep(tmp_path)
    assert [p for p, _ in freed] == [gone] and freed[0][1] >= 5000
    assert not gone.exists() and live.exists() and legacy.exists() and foreign.exists()
    assert "removed 1 client-state folder" in caplog.text and str(gone) in caplog.text


# ---- durable writes -------------------------------------------------------------------------------

def disk_sim(rounds: int = 2):
    """The runs' config as a simulator after its first round."""
    sets = {**SETTINGS, "federation.rounds": str(rounds), "tracking.enabled": "false"}
    cfg = load(None, [f"{k}={v}" for k, v in sets.items()])
    sim = simulator_for(cfg)(cfg)
    run_rounds(sim, until=1)
    return sim


def test_a_checkpoint_reaches_the_device_before_its_name_does(tmp_path, monkeypatch):
    """The order databases use: the segments and the file synced, then the rename, then the folder
    synced — recorded from the system calls themselves."""
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("rename", str(dst)))
        real_replace(src, dst)

    sim = disk_sim()
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_checkpoint(sim, tmp_path / "c.pt")
    rename = calls.index(("rename", str(tmp_path / "c.pt")))
    before = [path for op, path in calls[:rename] if op == "fsync"]
    assert str(tmp_path / "c.pt.tmp") in before                                  # the file's bytes
    assert any(p.startswith(str(clients_dir(tmp_path / "c.pt")) + "/seg-") for p in before)   # its segments
    assert ("fsync", str(tmp_path)) in calls[rename:]                           # the rename itself
    sim.store.close()


def test_a_background_checkpoint_that_fails_is_reported_and_the_previous_one_stands(tmp_path, monkeypatch):
    from pfl.federation import checkpoint
    from pfl.federation.store import StoreError

    sim = disk_sim(3)
    save_checkpoint(sim, tmp_path / "c.pt")
    first = (tmp_path / "c.pt").read_bytes()
    run_rounds(sim, until=2)

    def full(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "sync_file", full)
    save_checkpoint(sim, tmp_path / "c.pt", background=True)        # returns: the sync runs on a thread
    with pytest.raises(StoreError, match=rf"{tmp_path / 'c.pt'}: No space left"):
        wait_checkpoint(tmp_path / "c.pt")
    assert (tmp_path / "c.pt").read_bytes() == first and not (tmp_path / "c.pt.tmp").exists()
    assert read_checkpoint(tmp_path / "c.pt")["run"]["executed"] == 1
    sim.store.close()
