"""Survivors of pass ac: the communication ledger (``CommLedger.record`` and ``metrics``), the message
helpers (``copy_entry``, ``entry_nbytes``, ``Message.tensors`` and ``Message.copy``) and the public
set's hint for a pooled source. The truths are hand counts of the bytes and values sent
(``numel × element_size`` of tensors the test builds, summed in the test), the cumulative and
per-direction contract of :mod:`pfl.federation.comm`, the copy rules of
:func:`pfl.federation.messages.copy_entry`'s docstring (a handed-over tensor no one kept passes as is,
anything else is copied), the documented errors (naming the field and its allowed values), and the
public set's advice for a pooled partition (fewer pooled samples, with the pool's size)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from pfl.federation.comm import DIRECTIONS, CommLedger
from pfl.federation.messages import Message, Model, Scalars, Update, copy_entry, entry_nbytes
from pfl.training import HANDED_OVER, handed_over


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---- the ledger ---------------------------------------------------------------------------------------

def test_the_ledger_adds_up_every_direction_over_several_messages():
    """Two messages of different sizes in each direction: every counter is the sum (cumulative),
    params_sent counts the values of both training directions, the message counts count messages."""
    a = torch.zeros(3, 4)                       # 12 values, 48 bytes
    b = torch.zeros(5, dtype=torch.float64)     # 5 values, 40 bytes
    c = torch.zeros(7, dtype=torch.float16)     # 7 values, 14 bytes
    small, big = Message.model({"c": c}), Message.model({"a": a, "b": b})
    ledger = CommLedger()
    for direction in DIRECTIONS:
        ledger.record(small, direction)
        ledger.record(big, direction)
    ledger.record(small, "down")                 # a third downlink
    ledger.record(None, "down")                  # nothing delivered: nothing counted
    both = _nbytes(a, b, c)
    out = ledger.metrics()
    assert out["comm/up_bytes"] == both and out["comm/down_bytes"] == both + _nbytes(c)
    assert out["comm/eval_up_bytes"] == both and out["comm/eval_down_bytes"] == both
    assert out["comm/join_up_bytes"] == both and out["comm/join_down_bytes"] == both
    assert out["comm/params_sent"] == (12 + 5 + 7) + (12 + 5 + 7 + 7)
    assert ledger.up_params == 24 and ledger.down_params == 31
    assert ledger.up_messages == 2 and ledger.down_messages == 3
    ledger.close_round()
    assert ledger.per_round == [(both, both + _nbytes(c))]


def test_the_ledger_books_params_by_direction_whichever_came_first():
    """down_params / up_params each sum their own direction's messages (one up then two downs, and the
    other way round)."""
    one, three = Message.model({"w": torch.zeros(1)}), Message.model({"w": torch.zeros(3)})
    ledger = CommLedger()
    ledger.record(three, "up")
    ledger.record(one, "down")
    ledger.record(three, "down")
    ledger.record(one, "up")
    assert (ledger.up_params, ledger.down_params) == (4, 4)
    assert (ledger.up_messages, ledger.down_messages) == (2, 2)
    assert ledger.metrics()["comm/params_sent"] == 8.0


def test_a_ledger_with_no_finished_round_reports_zero_last_round_bytes():
    ledger = CommLedger()
    out = ledger.metrics()
    assert out["comm/round_up_bytes"] == 0.0 and out["comm/round_down_bytes"] == 0.0
    ledger.record(Message.model({"w": torch.zeros(2)}), "up")  # in flight, not a finished round
    out = ledger.metrics()
    assert out["comm/round_up_bytes"] == 0.0 and out["comm/round_down_bytes"] == 0.0


@pytest.mark.parametrize("direction", ["join_up", "join_down"])
def test_join_bytes_in_one_direction_report_both_join_counters(direction):
    ledger = CommLedger()
    ledger.record(Message.model({"w": torch.zeros(6)}), direction)
    out = ledger.metrics()
    assert out[f"comm/{direction}_bytes"] == 24.0
    other = "join_down" if direction == "join_up" else "join_up"
    assert out[f"comm/{other}_bytes"] == 0.0


def test_an_unknown_direction_is_refused_naming_the_allowed_ones():
    ledger = CommLedger()
    with pytest.raises(ValueError) as err:
        ledger.record(Message.model({"w": torch.zeros(1)}), "sideways")
    assert str(err.value) == ("direction must be one of up, down, eval_up, eval_down, join_up, join_down, "
                              "got 'sideways'")


# ---- entries and messages ---------------------------------------------------------------------------

def test_an_entry_that_is_neither_tensor_nor_payload_is_refused_naming_its_type():
    with pytest.raises(TypeError, match=r"^message entries must be tensors or Payloads, got list$"):
        entry_nbytes([1.0, 2.0])
    with pytest.raises(TypeError, match=r"got ndarray$"):
        Message.model({"w": np.zeros(3)}).nbytes()


def test_tensors_of_a_message_with_several_parts_needs_the_part_named():
    msg = Message({"a": Model({"w": torch.ones(2)}), "b": Update({"v": torch.zeros(3)})})
    with pytest.raises(KeyError, match=r"the message has parts \['a', 'b'\]; name the one to read"):
        msg.tensors()
    assert torch.equal(msg.tensors("b")["v"], torch.zeros(3))
    assert Message().tensors() == {}
    only = Message({"s": Scalars({"k": torch.tensor([2])})})
    assert torch.equal(only.tensors()["k"], torch.tensor([2]))


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_a_handed_over_tensor_nobody_kept_passes_as_is_and_loses_its_mark():
    t = handed_over(torch.arange(4.0))
    out = copy_entry(t, kept=set())
    assert out is t and HANDED_OVER not in t.__dict__
    # the mark is spent: a second delivery of the same tensor copies it
    again = copy_entry(t, kept=set())
    assert again is not t and torch.equal(again, t) and not _shares_storage(again, t)


def test_a_handed_over_tensor_the_sender_kept_is_copied():
    t = handed_over(torch.arange(4.0))
    out = copy_entry(t, kept={t.untyped_storage().data_ptr()})
    assert out is not t and torch.equal(out, t) and not _shares_storage(out, t)


def test_a_tensor_never_handed_over_is_copied_whatever_kept_says():
    t = torch.arange(3.0)
    for kept in (None, set(), {12345}):
        out = copy_entry(t, kept=kept)
        assert out is not t and torch.equal(out, t) and not _shares_storage(out, t)


def test_message_copy_passes_kept_on_to_every_entry():
    """Message.copy(kept=...) follows copy_entry's rules: the handed-over tensor nobody kept is
    delivered as is, the kept one and the unmarked one are copied; info is a new dict."""
    fresh, kept_t, plain = handed_over(torch.ones(2)), handed_over(torch.zeros(2)), torch.full((2,), 3.0)
    msg = Message({"m": Model({"fresh": fresh, "kept": kept_t}), "u": Update({"plain": plain})}, {"n": 5})
    out = msg.copy(kept={kept_t.untyped_storage().data_ptr()})
    assert out["m"].entries["fresh"] is fresh
    assert out["m"].entries["kept"] is not kept_t and torch.equal(out["m"].entries["kept"], kept_t)
    assert out["u"].entries["plain"] is not plain and torch.equal(out["u"].entries["plain"], plain)
    assert out.info == {"n": 5} and out.info is not msg.info


# ---- the public set's hint -----------------------------------------------------------------------------

def test_a_source_with_writers_partitioned_by_dirichlet_hints_at_max_samples(tmp_path, caplog):
    """A file with a client column split by Dirichlet (not naturally) pools its rows: when every row
    went to a client, the hint is fewer pooled samples (the pool's size: 12 writers × 10 rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pfl.federation.simulator import Simulator
    from pfl.resolver import load

    rng = np.random.default_rng(3)
    n = 120
    feats = rng.normal(size=(n, 4))
    pq.write_table(pa.table({"client": [f"w{i % 12:02d}" for i in range(n)], "label": rng.integers(0, 3, n),
                             **{f"f{j}": feats[:, j] for j in range(4)}}), tmp_path / "writers.parquet")
    with caplog.at_level("WARNING"):
        Simulator(load(None, {
            "method.name": "perfed_ckt", "method.architectures": ["softmax_regression"],
            "model.name": "softmax_regression", "data.num_clients": 4, "federation.batch_size": 0,
            "federation.local_steps": 1, "tracking.enabled": False, "seed": 0, "data.cache": False,
            "data.source": "files", "data.params": {"path": str(tmp_path / "writers.parquet")},
            "data.partition.kind": "dirichlet", "data.partition.alpha": 0.5, "method.public_size": 20}))
    said = [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "public set" in r.getMessage()]
    assert len(said) == 1 and f"set data.max_samples below the pool size ({n}) or method.public_source" in said[0], said
