"""Verifiable rewards, registered by name: each maps a ``RewardInput`` to a ``RewardResult``.

``get_reward(name)`` returns the function (an unknown name lists the valid ones), or imports
``MODULE:FUNCTION`` (a reward of the user's own: a module on the path); the built-in rewards are ``text`` (exact_match, char_match: the synthetic tasks), ``math`` and ``code``;
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
    """The registered reward ``name``, or ``MODULE:FUNCTION`` imported. A user's function may
    return a ``RewardResult`` or a number."""
    if ":" in name:
        return _imported(name)
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(sorted(REWARDS))} or "
                         "MODULE:FUNCTION")
    return REWARDS[name]


def _imported(name: str) -> Callable[[RewardInput], RewardResult]:
    import importlib

    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"reward {name!r}: cannot import {module!r} ({e})") from None
    except AttributeError:
        raise ValueError(f"reward {name!r}: {module!r} has no {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {attr!r} is not callable")
    return fn
