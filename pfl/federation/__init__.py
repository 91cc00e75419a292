"""Simulator, messages and communication accounting."""

from .comm import CommLedger
from .messages import Encoded, LowRank, Message, Payload

__all__ = ["CommLedger", "Encoded", "LowRank", "Message", "Payload"]
