"""Verifiable rewards, registered by name: each maps a ``RewardInput`` to a ``RewardResult``.

``get_reward(name)`` returns the function (an unknown name lists the valid ones); the built-in
rewards are ``text`` (exact_match, char_match: the synthetic tasks), ``math`` and ``code``;
``pool.RewardPool`` scores many samples in bounded worker processes, turning exceptions and
timeouts into reward 0 with the reason counted; ``scoring`` scores a step's responses once per
model replica.
"""

from __future__ import annotations

from typing import Callable

from megatron_gspo.rewards import code, math, text  # noqa: F401  (the built-in rewards register)
from megatron_gspo.rewards.registry import REWARDS, RewardInput, RewardResult, register_reward

__all__ = ["REWARDS", "RewardInput", "RewardResult", "get_reward", "register_reward"]


def get_reward(name: str) -> Callable[[RewardInput], RewardResult]:
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]
