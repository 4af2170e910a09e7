"""Verifiable rewards, registered by name: each maps a ``RewardInput`` to a ``RewardResult``.

``get_reward(name)`` returns the function (an unknown name lists the valid ones); ``RewardPool``
scores many samples in bounded worker processes, turning exceptions and timeouts into reward 0
with the reason counted.
"""

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


def get_reward(name: str) -> Callable[[RewardInput], RewardResult]:
    from megatron_gspo.data import synthetic  # noqa: F401  (registration)
    from megatron_gspo.rewards import code, math  # noqa: F401

    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]
