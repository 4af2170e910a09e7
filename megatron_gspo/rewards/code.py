"""CodeForces-style code rewards: run the response's program on each test in the sandbox and
score the fraction of tests passed, or 1/0 for all-or-nothing."""

from __future__ import annotations

import re

from megatron_gspo.rewards.registry import RewardInput, RewardResult, register_reward
from megatron_gspo.rewards.sandbox import run


_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_program(response: str) -> str:
    """The last fenced code block, or the whole response when there is none."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _same_output(got: str, expected: str) -> bool:
    return got.split() == str(expected).split()


def score_program(program: str, tests: list, *, all_or_nothing: bool = False,
                  timeout_s: float = 2.0, memory_mb: int = 256) -> RewardResult:
    passed, reasons = 0, []
    for stdin, expected in tests:
        result = run(program, stdin, timeout_s=timeout_s, memory_mb=memory_mb)
        if result.error is not None:
            reasons.append(result.error)
        elif _same_output(result.stdout, expected):
            passed += 1
        else:
            reasons.append("wrong output")
    total = len(tests)
    score = float(passed == total) if all_or_nothing else passed / max(total, 1)
    details = {"passed": passed, "total": total}
    if reasons:
        details["reason"] = reasons[0]
    return RewardResult(score, details)


@register_reward("code")
def code_reward(sample: RewardInput) -> RewardResult:
    if not sample.tests:
        return RewardResult(0.0, {"reason": "no tests"})
    return score_program(extract_program(sample.response or ""), sample.tests,
                         all_or_nothing=bool(sample.meta.get("all_or_nothing", False)),
                         timeout_s=float(sample.meta.get("timeout_s", 2.0)))
