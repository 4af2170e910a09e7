"""The reward registry: the records a reward reads and returns, and the names rewards are
registered under."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class RewardInput:
    response: str  # the decoded response
    answer: Any = None  # reference answer (math, synthetic tasks)
    tests: Optional[list] = None  # [(stdin, expected stdout), ...] (code)
    meta: dict = field(default_factory=dict)


@dataclass
class RewardResult:
    score: float
    details: dict = field(default_factory=dict)  # for logging; "reason" when the score is 0


REWARDS: dict[str, Callable[[RewardInput], RewardResult]] = {}


def register_reward(name: str):
    def wrap(fn):
        REWARDS[name] = fn
        return fn
    return wrap
