"""Communication accounting: every delivered message is counted here, nowhere else."""

from __future__ import annotations

from dataclasses import dataclass, field

from .messages import Message


@dataclass
class CommLedger:
    """Bytes and parameter counts delivered, per round and cumulative."""
    up_bytes: int = 0
    down_bytes: int = 0
    up_params: int = 0
    down_params: int = 0
    up_messages: int = 0
    down_messages: int = 0
    round_up_bytes: int = 0
    round_down_bytes: int = 0
    per_round: list[tuple[int, int]] = field(default_factory=list)  # (up, down) bytes per finished round

    def record(self, msg: Message | None, direction: str) -> None:
        if msg is None:
            return
        nbytes, nparams = msg.nbytes(), msg.num_params()
        if direction == "up":
            self.up_bytes += nbytes
            self.up_params += nparams
            self.up_messages += 1
            self.round_up_bytes += nbytes
        elif direction == "down":
            self.down_bytes += nbytes
            self.down_params += nparams
            self.down_messages += 1
            self.round_down_bytes += nbytes
        else:
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")

    def close_round(self) -> None:
        self.per_round.append((self.round_up_bytes, self.round_down_bytes))
        self.round_up_bytes = self.round_down_bytes = 0

    @property
    def total_bytes(self) -> int:
        return self.up_bytes + self.down_bytes

    def metrics(self) -> dict[str, float]:
        last_up, last_down = self.per_round[-1] if self.per_round else (0, 0)
        return {
            "comm/up_bytes": float(self.up_bytes),
            "comm/down_bytes": float(self.down_bytes),
            "comm/total_bytes": float(self.total_bytes),
            "comm/params_sent": float(self.up_params + self.down_params),
            "comm/round_up_bytes": float(last_up),
            "comm/round_down_bytes": float(last_down),
        }

    def state_dict(self) -> dict:
        return dict(self.__dict__, per_round=list(self.per_round))

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
