"""Reward functions for the pool tests (importable by worker processes)."""

import time

from megatron_gspo.rewards import RewardResult, register_reward


def length_reward(sample):
    return RewardResult(float(len(sample.response)))


def flaky_reward(sample):
    if sample.response == "raise":
        raise RuntimeError("bad input")
    if sample.response == "hang":
        time.sleep(60)
    return RewardResult(1.0)


PROGRAMS = {  # what a policy might write for "print the number doubled"
    "right": "print(2 * int(input()))",
    "loops forever": "while True:\n    pass",
}


@register_reward("scripted_code")
def scripted_code(sample):
    """The code reward on a program picked from the (random) response: the right program, one
    that loops forever (the sandbox kills it), or no program at all and the reward raises; a
    sample whose response starts with '~' hangs the reward itself past any timeout."""
    from megatron_gspo.rewards.code import score_program

    kind = sum(sample.response.encode()) % 3 if sample.response else 0
    if sample.response.startswith("~"):
        time.sleep(600)
    if kind == 2:
        raise RuntimeError("the verifier crashed")
    program = PROGRAMS["right" if kind == 0 else "loops forever"]
    return score_program(program, sample.tests, timeout_s=1.0)


def number_reward(sample):
    """A user's reward returning a bare number: the response's length over 10, or a string (not
    a score) for the response "text", or NaN for "nan"."""
    if sample.response == "text":
        return "1.0"
    if sample.response == "nan":
        return float("nan")
    return len(sample.response) / 10
