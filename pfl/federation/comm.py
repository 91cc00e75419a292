"""Communication accounting: every delivered message is counted here, nowhere else.

Training traffic (``up``, ``down``) and evaluation traffic (``eval_up``, ``eval_down``: the models
a client needs to be evaluated, e.g. FedAvg's global model sent to every client at an evaluation,
IFCA's cluster choice sent back) are booked apart, so ``comm/up_bytes``, ``comm/down_bytes`` and
``comm/total_bytes`` compare methods by what training cost, whatever the evaluation schedule.
Every counter is cumulative over the run and never decreases: restoring an earlier model state
(the λ path's branches) does not touch the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .messages import Message

DIRECTIONS = ("up", "down", "eval_up", "eval_down", "join_up", "join_down")


@dataclass
class CommLedger:
    """Bytes and parameter counts delivered, per round and cumulative."""
    up_bytes: int = 0
    down_bytes: int = 0
    up_params: int = 0
    down_params: int = 0
    up_messages: int = 0
    down_messages: int = 0
    eval_up_bytes: int = 0
    eval_down_bytes: int = 0
    join_up_bytes: int = 0
    join_down_bytes: int = 0
    round_up_bytes: int = 0
    round_down_bytes: int = 0
    per_round: list[tuple[int, int]] = field(default_factory=list)  # (up, down) bytes per finished round

    def record(self, msg: Message | None, direction: str) -> None:
        if msg is None:
            return
        nbytes = msg.nbytes()
        if direction == "up":
            self.up_bytes += nbytes
            self.up_params += msg.num_params()
            self.up_messages += 1
            self.round_up_bytes += nbytes
        elif direction == "down":
            self.down_bytes += nbytes
            self.down_params += msg.num_params()
            self.down_messages += 1
            self.round_down_bytes += nbytes
        elif direction == "eval_up":
            self.eval_up_bytes += nbytes
        elif direction == "eval_down":
            self.eval_down_bytes += nbytes
        elif direction == "join_up":
            self.join_up_bytes += nbytes
        elif direction == "join_down":
            self.join_down_bytes += nbytes
        else:
            raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")

    def close_round(self) -> None:
        self.per_round.append((self.round_up_bytes, self.round_down_bytes))
        self.round_up_bytes = self.round_down_bytes = 0

    @property
    def total_bytes(self) -> int:
        return self.up_bytes + self.down_bytes

    def metrics(self) -> dict[str, float]:
        last_up, last_down = self.per_round[-1] if self.per_round else (0, 0)
        out = {
            "comm/up_bytes": float(self.up_bytes),
            "comm/down_bytes": float(self.down_bytes),
            "comm/total_bytes": float(self.total_bytes),
            "comm/params_sent": float(self.up_params + self.down_params),
            "comm/round_up_bytes": float(last_up),
            "comm/round_down_bytes": float(last_down),
            "comm/eval_up_bytes": float(self.eval_up_bytes),
            "comm/eval_down_bytes": float(self.eval_down_bytes),
        }
        if self.join_up_bytes or self.join_down_bytes:
            out["comm/join_up_bytes"] = float(self.join_up_bytes)
            out["comm/join_down_bytes"] = float(self.join_down_bytes)
        return out

    def state_dict(self) -> dict:
        return dict(self.__dict__, per_round=list(self.per_round))

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
