"""Rewards of the synthetic tasks (``data.synthetic``): the response against the answer as text."""

from __future__ import annotations

from megatron_gspo.rewards.registry import RewardInput, RewardResult, register_reward


@register_reward("exact_match")
def exact_match(sample: RewardInput) -> RewardResult:
    """1 when the response (up to end of text, surrounding spaces ignored) equals the answer."""
    got = (sample.response or "").strip()
    ok = got == str(sample.answer).strip()
    return RewardResult(1.0 if ok else 0.0, {} if ok else {"reason": "wrong answer",
                                                           "got": got[:50]})


@register_reward("char_match")
def char_match(sample: RewardInput) -> RewardResult:
    """The fraction of the answer's characters that the response has at the same position (a
    response of another length loses the missing or extra positions): 1 only for an exact
    match."""
    got, want = (sample.response or "").strip(), str(sample.answer).strip()
    right = sum(a == b for a, b in zip(got, want))
    score = right / max(len(got), len(want), 1)
    return RewardResult(score, {} if score == 1.0 else {"reason": f"{right}/{len(want)} right"})
