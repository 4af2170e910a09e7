"""Reward functions for the pool tests (importable by worker processes)."""

import time

from megatron_gspo.rewards import RewardResult


def length_reward(sample):
    return RewardResult(float(len(sample.response)))


def flaky_reward(sample):
    if sample.response == "raise":
        raise RuntimeError("bad input")
    if sample.response == "hang":
        time.sleep(60)
    return RewardResult(1.0)
