"""The client-state stores: a run computes the same bits whether client state lives in memory or on
disk, a disk run resumes exactly (into either store), checkpoints link only what changed, snapshots
are indexes that later rounds cannot change, and a store that cannot write says where and why.

The memory store is the reference: it keeps the very objects a client step leaves, so any
difference a disk round trip makes (a bit, a dtype, an alias, a key order) shows up as a
difference between the two runs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import matrix, method_config, method_names, same, small_config, untimed
from pfl.callbacks.divergence import run_rounds
from pfl.federation.checkpoint import clients_dir, load_checkpoint, save_checkpoint
from pfl.federation.diskstore import DiskSnapshot, DiskStore
from pfl.federation.drivers import simulator_for
from pfl.federation.records import pack, unpack
from pfl.federation.state import encode
from pfl.federation.store import StoreError
from pfl.federation.wire import Stage
from pfl.schema import ConfigError

METHODS = method_names(composed=True)
#: in the quick loop: a personal model (Ditto), a control variate (SCAFFOLD), ALA's flags and
#: weights, FedPD's three models from the first step (non-empty fresh states)
FAST = ("ditto", "scaffold", "fedavg+ala", "fedpd")


def build(cfg, store: str, flush_bytes: int = 0):
    """A simulator of ``cfg`` with its client states in ``store``; a disk store writes a segment
    at every save (flush_bytes 0), so every step goes through the files."""
    cfg.federation.client_store = store
    sim = simulator_for(cfg)(cfg)
    assert sim.store.kind == store
    if store == "disk":
        sim.store.flush_bytes = flush_bytes
    return sim


def assert_same_run(a, b) -> None:
    assert untimed(a.history) == untimed(b.history)
    same(encode(a.model_state()), encode(b.model_state()))
    assert a.ledger.state_dict() == b.ledger.state_dict()


# ---- bit for bit ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", matrix(METHODS, FAST))
def test_disk_store_computes_what_the_memory_store_computes(name):
    cfg = method_config(name, federation__rounds=3, federation__momentum=0.5)
    memory = build(cfg, "memory")
    run_rounds(memory)
    disk = build(method_config(name, federation__rounds=3, federation__momentum=0.5), "disk")
    run_rounds(disk)
    assert_same_run(disk, memory)
    assert memory.last_client_table == disk.last_client_table


@pytest.mark.parametrize("settings", [
    # the client keeps error-feedback memories and downlink replicas in its state
    dict(method__name="fedavg", compression__uplink={"name": "topk", "ratio": 0.2}, compression__error_feedback=True,
         compression__downlink={"name": "qsgd", "s": 3}, compression__min_numel=32),
    # the asynchronous driver loads and saves one device at a time, with messages in flight
    dict(method__name="fpfc", federation__driver="async", federation__rounds=4),
    # the batched cohort: states loaded and saved a part at a time
    dict(method__name="ditto", federation__cohort="vectorized"),
    # newcomers join after training (their own exchange)
    dict(method__name="ditto", newcomers__fraction=0.2, newcomers__finetune_rounds=2),
])
def test_disk_store_equals_memory_on_the_other_paths(settings):
    memory = build(small_config(**settings), "memory")
    run_rounds(memory)
    disk = build(small_config(**settings), "disk")
    run_rounds(disk)
    assert_same_run(disk, memory)


def test_a_record_keeps_dtypes_aliases_and_plain_values():
    shared = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    state = {"w": {"a": shared, "b": shared}, "half": torch.tensor([1.5, -0.0], dtype=torch.bfloat16),
             "flags": (True, None, "x"), "n": 3, "lr": -0.0, "arr": np.arange(4, dtype=np.int16),
             "empty": torch.zeros(0, 5), "scalar": torch.tensor(2.5)}
    back = unpack(pack(state), torch.device("cpu"))
    same(encode(back), encode(state))
    assert back["w"]["a"] is back["w"]["b"]                 # one tensor under two names, as it was
    assert back["half"].dtype == torch.bfloat16 and str(back["lr"]) == "-0.0"
    assert isinstance(back["arr"], np.ndarray) and back["arr"].dtype == np.int16
    assert torch.equal(back["half"].view(torch.int16), state["half"].view(torch.int16))  # -0.0 kept
    back["w"]["a"].add_(1)                                  # the loaded copy is the step's own
    assert torch.equal(shared, torch.arange(6, dtype=torch.float64).reshape(2, 3))


def test_fresh_and_unchanged_clients_cost_no_disk(tmp_path):
    cfg = small_config(method__name="ditto", data__num_clients=40, federation__clients_per_round=4,
                       federation__rounds=2, federation__client_store_dir=str(tmp_path))
    sim = build(cfg, "disk")
    run_rounds(sim)                          # 2 rounds × 4 clients trained, everyone evaluated twice
    trained = {c for r in range(2) for c in sim.sample(r)}
    recorded = set(np.flatnonzero(sim.store.index["client"] >= 0).tolist())
    assert recorded == trained               # evaluation (no state change) wrote nothing
    assert sim.store.root.parent == tmp_path


# ---- resume ---------------------------------------------------------------------------------------

def stopped_and_resumed(cfg_of, first: str, then: str, tmp_path, stop_at: int = 2):
    sim = build(cfg_of(), first)
    run_rounds(sim, until=stop_at)
    save_checkpoint(sim, tmp_path / "ckpt.pt")
    resumed = build(cfg_of(), then)
    load_checkpoint(resumed, tmp_path / "ckpt.pt")
    run_rounds(resumed)
    return resumed


@pytest.mark.parametrize("name", matrix(METHODS, ("ditto", "fedavg+ala")))
def test_a_resumed_disk_run_equals_the_uninterrupted_one(tmp_path, name):
    def cfg():
        return method_config(name, federation__rounds=4, federation__momentum=0.5)
    straight = build(cfg(), "memory")
    run_rounds(straight)
    assert_same_run(stopped_and_resumed(cfg, "disk", "disk", tmp_path), straight)


def test_an_interrupted_disk_run_resumes_from_its_checkpoint_as_the_uninterrupted_run(tmp_path):
    """The way a user meets it: ``run_experiment`` with checkpoints every 2 rounds is cut off by
    Ctrl-C in round 3 (states saved after the checkpoint sit in its store, some unflushed); a new
    run resumes from the checkpoint (round 2) in a store folder of its own and ends where a run on
    the memory store that was never interrupted ends, in the same MLflow run."""
    from pfl.federation.loop import Callback
    from pfl.runner import run_experiment
    from pfl.tracking import client

    class CtrlC(Callback):
        def on_round(self, loop, metrics):
            if loop.sim.executed == 3:
                raise KeyboardInterrupt

    def cfg(store, **kw):
        return small_config(method__name="ditto", federation__rounds=5, federation__checkpoint_every=2,
                            federation__client_store=store, federation__client_store_dir=str(tmp_path / "states"),
                            **kw)

    ckpt = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg("disk", tracking__enabled=True), progress=None, checkpoint=ckpt, callbacks=[CtrlC()])
    assert torch.load(ckpt, weights_only=True)["run"]["executed"] == 2
    resumed = run_experiment(cfg("disk", tracking__enabled=True), progress=None, checkpoint=ckpt, resume=True)
    # tracked too: logging the final model is an evaluation exchange, counted in the ledger
    straight = run_experiment(cfg("memory", tracking__enabled=True), progress=None)
    assert resumed.status == straight.status == "FINISHED"
    assert resumed.extra["simulator"].store.kind == "disk"
    assert_same_run(resumed.extra["simulator"], straight.extra["simulator"])
    runs = client().search_runs(client().search_experiments()[0].experiment_id)
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}  # resumed into the run it was cut off in


@pytest.mark.parametrize("first,then", [("disk", "memory"), ("memory", "disk")])
def test_a_checkpoint_resumes_into_the_other_store(tmp_path, first, then):
    def cfg():
        return small_config(method__name="scaffold", federation__rounds=4)
    straight = build(cfg(), "memory")
    run_rounds(straight)
    assert_same_run(stopped_and_resumed(cfg, first, then, tmp_path), straight)


def test_a_checkpoint_links_only_the_segments_written_since_the_last_one(tmp_path):
    sim = build(small_config(method__name="ditto", federation__rounds=4), "disk", flush_bytes=2**40)
    path = tmp_path / "ckpt.pt"
    run_rounds(sim, until=1)
    save_checkpoint(sim, path)
    folder = clients_dir(path)
    first = {f.name: f.stat().st_ino for f in folder.iterdir()}
    assert first and all(os.stat(sim.store.root / n).st_ino == ino for n, ino in first.items())  # links, not copies
    run_rounds(sim, until=2)
    save_checkpoint(sim, path)
    second = {f.name: f.stat().st_ino for f in folder.iterdir()}
    written = {n for n in sim.store.names if n} - set(first)
    assert set(second) - set(first) == written and len(written) == 1  # round 2's one segment
    assert all(second[n] == first[n] for n in set(first) & set(second))  # the others untouched
    manifest = torch.load(path, weights_only=True)["model"]["clients"]
    assert set(second) == set(manifest["segments"].values())            # nothing stale is kept


# ---- snapshots ------------------------------------------------------------------------------------

def test_a_disk_snapshot_is_an_index_that_later_rounds_cannot_change():
    sim = build(small_config(method__name="ditto", federation__rounds=6), "disk")
    ref = build(small_config(method__name="ditto", federation__rounds=6), "memory")
    for s in (sim, ref):
        run_rounds(s, until=2)
    snap, ref_snap = sim.snapshot(), ref.snapshot()
    assert isinstance(snap["clients"], DiskSnapshot)
    index_bytes = sum(a.nbytes for part in (snap["clients"].index, snap["clients"].spans) for a in part.values())
    assert index_bytes == 28 * sim.num_clients   # segment and span per client: no state is copied
    for s in (sim, ref):
        run_rounds(s, until=5)               # enough saves for stale segments to be deleted
    assert all((sim.store.root / sim.store.names[n]).is_file() for n in snap["clients"].segments())
    sim.restore(snap)
    ref.restore(ref_snap)
    same(encode(sim.model_state()), encode(ref.model_state()))
    for s in (sim, ref):
        run_rounds(s)
    same(encode(sim.model_state()), encode(ref.model_state()))


@pytest.mark.slow
def test_the_lambda_path_on_a_disk_store_resumes_mid_path(tmp_path):
    """FPFC's λ path keeps finalists as snapshots inside its checkpointed state: on a disk store
    they are indexes whose segments go with the checkpoint, and the resumed path equals the
    uninterrupted one run on the memory store."""
    from pfl.callbacks import Checkpointer, StopOnDivergence
    from pfl.federation.loop import Callback, RoundLoop
    from pfl.tune.lambda_path import LambdaPath, PathSettings

    class Interrupt(Callback):
        def on_round(self, loop, metrics):
            if loop.sim.executed == 13:
                raise KeyboardInterrupt

    settings = PathSettings(lambdas=[0.2, 0.4, 0.6], eval_every=2, stage_cap=4, window=1, tolerance=1.0,
                            residual_tol=0.0, patience=5, extend=0, finalists=2, playoff_rounds=2, budget=12)

    def loop(store, extra=()):
        sim = build(small_config(method__name="fpfc", data__val_fraction=0.2, federation__rounds=12), store)
        return RoundLoop(sim, [StopOnDivergence(), LambdaPath(settings),
                               Checkpointer(tmp_path / store / "path.pt", every=1), *extra])

    straight = loop("memory")
    straight.run(until=math.inf)
    with pytest.raises(KeyboardInterrupt):
        loop("disk", [Interrupt()]).run(until=math.inf)
    resumed = loop("disk")
    resumed.load(tmp_path / "disk" / "path.pt")
    assert resumed.run(until=math.inf).status == "FINISHED"

    def timeless(summary):  # times are measured, not replayed
        return {k: v for k, v in summary.items() if k not in ("fpfc/trial_wall_s", "fpfc/compute_s", "fpfc/cpu_s")}

    assert timeless(resumed.summary) == timeless(straight.summary)
    assert_same_run(resumed.sim, straight.sim)


# ---- server-side per-client memories --------------------------------------------------------------

@pytest.mark.parametrize("store", ["memory", "disk"])
def test_a_client_memory_is_kept_snapshotted_and_checkpointed_with_the_states(tmp_path, store):
    sim = build(small_config(method__name="fedavg"), store)
    mirrors = sim.store.memory("mirror")
    assert mirrors.load(3) == {}
    mirrors.save(3, {"w": torch.ones(4), "sent": 1})
    snap = sim.snapshot()
    mirrors.save(3, {"w": mirrors.load(3)["w"] * 5, "sent": 2})
    save_checkpoint(sim, tmp_path / "c.pt")
    other = build(small_config(method__name="fedavg"), "disk" if store == "memory" else "memory")
    load_checkpoint(other, tmp_path / "c.pt")
    same(encode(other.model_state()["memories"]), encode({"mirror": {3: {"w": torch.full((4,), 5.0), "sent": 2}}}))
    sim.restore(snap)
    same(encode(sim.model_state()["memories"]), encode({"mirror": {3: {"w": torch.ones(4), "sent": 1}}}))
    mirrors.save(3, {})                      # nothing kept: the entry goes
    assert "memories" not in sim.model_state()


class CountingStage(Stage):
    """A server-side stage with a per-client memory, as a downlink mirror is: how many training
    downlinks each client got, and the first tensor of the last one."""

    key = "counting"

    def bind_store(self, store):
        self.memory = store.memory("counting")

    def send_down(self, phase, cid, msg):
        if phase.kind == "train":
            kept = self.memory.load(cid)
            first = next(iter(msg.tensors().values()))
            self.memory.save(cid, {"count": kept.get("count", 0) + 1, "last": first.detach().clone()})
        return msg


def with_stage(cfg, store):
    sim = build(cfg, store)
    stage = CountingStage()
    sim.wire.stages.stages.append(stage)
    stage.bind_store(sim.store)
    return sim


def test_a_wire_stage_keeps_its_per_client_memory_in_the_store(tmp_path):
    def cfg():
        return small_config(method__name="ditto", federation__rounds=4)
    memory = with_stage(cfg(), "memory")
    run_rounds(memory)
    disk = with_stage(cfg(), "disk")
    run_rounds(disk, until=2)
    save_checkpoint(disk, tmp_path / "c.pt")
    resumed = with_stage(cfg(), "disk")
    load_checkpoint(resumed, tmp_path / "c.pt")
    run_rounds(resumed)
    counts = {c: sum(c in memory.sample(r) for r in range(4)) for c in range(memory.num_clients)}
    kept = memory.model_state()["memories"]["counting"]
    assert {c: v["count"] for c, v in kept.items()} == {c: n for c, n in counts.items() if n}
    assert_same_run(resumed, memory)         # the memories included


def test_compaction_rewrites_sparse_segments_and_spares_snapshots():
    store = DiskStore(None, 6, lambda cid: {}, torch.device("cpu"), flush_bytes=0)
    for step in range(5):                    # every save its own segment; older versions die
        for cid in range(6):
            store.save(cid, {"w": torch.full((1000,), float(step * 10 + cid))})
    snap = store.snapshot()
    store.save(0, {"w": torch.zeros(3)})     # one more segment, so segment 0..29 are mostly dead
    before = store.states()
    assert sum(n is not None for n in store.names) == 7   # 6 live (one per client) + the newest
    store._maybe_compact(min_dead=0)
    same(encode(store.states()), encode(before))
    pinned = snap.segments()
    assert all(store.names[n] is not None for n in pinned)     # the snapshot's segments stay
    store.restore(snap)
    assert float(store.load(0)["w"][0]) == 40.0
    store.close()
    assert not store.root.exists()


# ---- bad input and failing disks -------------------------------------------------------------------

def test_a_budget_too_small_for_one_round_names_the_key_and_the_size():
    cfg = small_config(method__name="ditto", federation__client_store="disk", federation__client_memory_gb=0.0001)
    with pytest.raises(ConfigError) as err:
        simulator_for(cfg)(cfg)
    assert err.value.field == "federation.client_memory_gb"
    assert "need" in str(err.value) and "at least" in str(err.value)


def test_the_cli_exits_2_when_the_budget_cannot_hold_a_round(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pfl", "run", "--no-track", "--set", "federation.rounds=1",
                           "--set", "federation.client_store=disk", "--set", "federation.client_memory_gb=0.0001"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 2, proc.stderr
    assert "federation.client_memory_gb" in proc.stderr and "GiB" in proc.stderr


def test_an_unwritable_store_folder_fails_the_run_naming_it(tmp_path):
    from pfl.runner import run_experiment
    from pfl.tracking import client

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's folder should be")
    cfg = small_config(method__name="ditto", federation__client_store="disk",
                       federation__client_store_dir=str(blocker / "store"), tracking__enabled=True)
    with pytest.raises(StoreError) as err:
        run_experiment(cfg, progress=None, checkpoint=tmp_path / "ckpt.pt")
    assert str(blocker) in str(err.value)
    run = client().search_runs(client().search_experiments()[0].experiment_id)[0]
    assert run.info.status == "FAILED" and str(blocker) in run.data.tags["pfl.failure"]
    assert not (tmp_path / "ckpt.pt").exists()


def test_the_cli_names_an_unwritable_store_folder_and_exits_1(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    proc = subprocess.run([sys.executable, "-m", "pfl", "run", "--no-track", "--set", "federation.rounds=1",
                           "--set", "federation.client_store=disk", "--set",
                           f"federation.client_store_dir={blocker / 'store'}"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: cannot write client states to {blocker}")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 4 MiB tmpfs (needs root and a kernel that lets this container mount)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a small file system here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_fails_the_run_and_keeps_the_last_checkpoint(tmp_path, tiny_disk):
    """Round 1 is checkpointed on the big disk; the resumed run keeps its states on a 4 MiB disk,
    which ten 220 kB personal models a round fill within two rounds. The run fails naming the
    disk, MLflow marks it FAILED, and the last checkpoint it wrote is whole: resumed on a big disk
    it ends where the uninterrupted run ends."""
    from pfl.runner import run_experiment
    from pfl.tracking import client

    def cfg(rounds, **kw):
        return small_config(method__name="ditto", data__num_clients=40, federation__clients_per_round=10,
                            model__params__hidden=[200, 200], federation__rounds=rounds, federation__eval_every=8,
                            federation__checkpoint_every=1, federation__client_store="disk", **kw)

    ckpt = tmp_path / "ckpt.pt"
    first = build(cfg(8), "disk")
    run_rounds(first, until=1)
    save_checkpoint(first, ckpt)
    with pytest.raises(StoreError) as err:
        run_experiment(cfg(8, tracking__enabled=True, federation__client_store_dir=str(tiny_disk)), progress=None,
                       checkpoint=ckpt, resume=True)
    assert str(tiny_disk) in str(err.value) and "No space left" in str(err.value)
    run = client().search_runs(client().search_experiments()[0].experiment_id)[0]
    assert run.info.status == "FAILED" and "No space left" in run.data.tags["pfl.failure"]
    resumed = build(cfg(8), "disk")
    load_checkpoint(resumed, ckpt)
    assert 1 <= resumed.round < 8
    run_rounds(resumed)
    straight = build(cfg(8), "memory")
    run_rounds(straight)
    assert_same_run(resumed, straight)


# ---- the record format and the writer ----------------------------------------------------------------

def test_a_record_that_names_code_is_refused_when_read(tmp_path):
    """A segment's headers are read by an unpickler that admits no global: a record naming a
    function (here os.system, which a plain pickle would call) fails to load instead of running it."""
    import pickle

    from pfl.federation.records import Record, SegmentBuffer, read_record, unpack

    class Call:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "ran"),))

    evil = Record(pickle.dumps(({"w": Call()}, []), protocol=5), b"")
    buffer = SegmentBuffer()
    span = buffer.append_record(evil)
    buffer.write(tmp_path / "seg.pfls")
    rec = read_record(tmp_path / "seg.pfls", *span)
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        unpack(rec, torch.device("cpu"))
    assert not (tmp_path / "ran").exists()


def test_a_damaged_segment_fails_naming_the_file(tmp_path):
    store = DiskStore(tmp_path, 4, lambda cid: {}, torch.device("cpu"), flush_bytes=0)
    store.save(2, {"w": torch.arange(100.0)})
    store.flush()
    path = store.path(int(store.index["client"][2]))
    with open(path, "r+b") as fh:       # the record's tag overwritten
        fh.write(b"XXXX")
    with pytest.raises(StoreError, match=str(path)):
        store.load(2)
    os.truncate(path, 100)              # and cut short
    with pytest.raises(StoreError, match=str(path)):
        store.load(2)
    store.close()


def test_an_unchanged_state_is_found_by_its_bytes():
    """Loaded and saved back as it was: nothing is written. A change in a tensor's bits only (0.0 to
    −0.0, equal as numbers) or in a plain value is a change."""
    store = DiskStore(None, 3, lambda cid: {"w": torch.zeros(4)}, torch.device("cpu"), flush_bytes=0)
    store.save(0, store.load(0))                              # the fresh state, unchanged
    assert not store.names
    state = store.load(1)
    state["w"][0] = -0.0                                      # == 0.0, other bits
    store.save(1, state)
    assert len(store.names) == 1 and store.index["client"][1] == 0
    again = store.load(1)
    assert str(float(again["w"][0])) == "-0.0"
    store.save(1, again)                                      # as it was read: no new segment
    store.save(2, {"w": torch.zeros(4), "loss": 0.5})         # a new plain value
    store.flush()
    assert len(store.names) == 2
    back = store.load(2)
    store.save(2, {**back, "loss": 0.25})
    store.flush()
    assert len(store.names) == 3 and store.load(2)["loss"] == 0.25
    store.close()


def test_records_are_read_from_a_segment_while_it_is_being_written(tmp_path, monkeypatch):
    """The writer thread writes a full segment while the clients' steps go on: a client saved into it
    loads from memory until the file is in place, and what a flush returns is on disk."""
    import threading

    from pfl.federation.records import SegmentBuffer

    gate = threading.Event()
    write = SegmentBuffer.write

    def slow_write(self, path):
        gate.wait(timeout=30)
        write(self, path)

    monkeypatch.setattr(SegmentBuffer, "write", slow_write)
    store = DiskStore(tmp_path, 4, lambda cid: {}, torch.device("cpu"), flush_bytes=0)
    store.save(1, {"w": torch.full((50,), 7.0)})              # a segment of its own, handed to the writer
    num = int(store.index["client"][1])
    assert not store.path(num).exists()                       # not on disk yet
    assert torch.equal(store.load(1)["w"], torch.full((50,), 7.0))
    gate.set()
    store.flush()
    assert store.path(num).is_file() and torch.equal(store.load(1)["w"], torch.full((50,), 7.0))
    store.close()


def test_a_failed_background_write_fails_the_next_flush(tmp_path, monkeypatch):
    from pfl.federation.records import SegmentBuffer

    def full_disk(self, path):
        raise StoreError(f"cannot write client states to {path.parent}: No space left on device")

    store = DiskStore(tmp_path, 4, lambda cid: {}, torch.device("cpu"), flush_bytes=0)
    monkeypatch.setattr(SegmentBuffer, "write", full_disk)
    store.save(0, {"w": torch.ones(10)})                      # handed to the writer: no error yet
    with pytest.raises(StoreError, match="No space left"):
        store.flush()
    store.close()


def test_a_checkpoint_of_an_earlier_disk_format_is_refused_naming_it(tmp_path):
    from pfl.federation.checkpoint import CheckpointError
    from pfl.federation.durable import seal

    sim = build(small_config(method__name="ditto", federation__rounds=3), "disk")
    run_rounds(sim, until=1)
    save_checkpoint(sim, tmp_path / "c.pt")
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    raw["model"]["clients"]["format"] = 1
    torch.save(raw, tmp_path / "c.pt")
    seal(tmp_path / "c.pt")   # whole, as that pfl would have written it
    for store in ("disk", "memory"):
        with pytest.raises(CheckpointError, match="disk format 1"):
            load_checkpoint(build(small_config(method__name="ditto", federation__rounds=3), store), tmp_path / "c.pt")


# ---- the compression stage's downlink mirrors --------------------------------------------------------

def compressed_down(**kw):
    return small_config(method__name="fedavg", federation__rounds=4, compression__downlink={"name": "qsgd", "s": 3},
                        compression__min_numel=32, **kw)


def test_the_downlink_mirrors_live_in_the_store_not_in_the_stage(tmp_path):
    """The server's copy of each client's replica is a memory of the client store: on disk with a
    disk store, absent from the stage's (checkpointed, in-memory) state, equal to the replica."""
    sim = build(compressed_down(), "disk")
    run_rounds(sim)
    assert "stages" not in sim.lineage_state()                     # nothing per client in the stage
    mirrors = sim.store.memories()["compression/mirror"]
    assert set(mirrors) == {c for r in range(4) for c in sim.sample(r)}
    sim.store.flush()
    assert (sim.store.index["compression/mirror"] >= 0).sum() == len(mirrors)   # written to segments
    for cid, mirror in mirrors.items():
        replica = sim.store.load(cid)["compression"]["replica"]
        assert mirror.keys() == replica.keys() and all(torch.equal(mirror[k], replica[k]) for k in mirror)


def test_a_checkpoint_with_the_mirrors_in_the_stage_state_resumes_exactly(tmp_path):
    """Checkpoints written before the mirrors moved into the store kept them in the stage's state:
    such a checkpoint resumes, and ends where the uninterrupted run ends."""
    from pfl.federation.durable import seal

    straight = build(compressed_down(), "memory")
    run_rounds(straight)
    first = build(compressed_down(), "memory")
    run_rounds(first, until=2)
    save_checkpoint(first, tmp_path / "c.pt")
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    part = raw["model"]["clients"]                                 # back to the earlier layout
    raw["model"]["stages"] = {"compression": {"mirrors": part["memories"].pop("compression/mirror")}}
    raw["model"]["clients"] = part["states"]
    torch.save(raw, tmp_path / "c.pt")
    seal(tmp_path / "c.pt")
    for store in ("memory", "disk"):
        resumed = build(compressed_down(), store)
        load_checkpoint(resumed, tmp_path / "c.pt")
        run_rounds(resumed)
        assert_same_run(resumed, straight)
