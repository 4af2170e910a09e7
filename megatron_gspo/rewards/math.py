"""Math answers: extract the final answer (last \\boxed{...}, else the last number) and check it
for mathematical equivalence with math-verify (fractions, decimals, LaTeX), not string equality."""

from __future__ import annotations

import re
from typing import Optional

from megatron_gspo.rewards.registry import RewardInput, RewardResult, register_reward


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> Optional[str]:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:  # \boxed 5
        m = re.match(r"\\boxed\s+(\S+)", text[start:])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a response: the last \\boxed{...}, else the last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _parse(text: str, as_math: bool):
    from math_verify import parse

    return parse(f"${text}$" if as_math and "$" not in text else text)


def equivalent(candidate: str, reference: str, *, candidate_is_math: bool = True) -> bool:
    """Mathematical equivalence (math-verify); never raises. ``candidate_is_math`` False lets
    math-verify find the final expression in free text itself."""
    from math_verify import verify

    try:
        gold = _parse(str(reference), True)
        pred = _parse(str(candidate), candidate_is_math)
        return bool(gold) and bool(pred) and bool(verify(gold, pred))
    except Exception:  # math-verify raises on some malformed LaTeX: that is a wrong answer
        return False


@register_reward("math")
def math_reward(sample: RewardInput) -> RewardResult:
    """1 when the final answer (the last \\boxed{...}; else what math-verify finds in the text;
    else the last number) equals the reference mathematically, else 0 with a reason."""
    text = sample.response or ""
    boxed = _last_boxed(text)
    if boxed is not None:
        ok, answer = equivalent(boxed, sample.answer), boxed
    else:
        answer = extract_answer(text)
        if answer is None and "\\" not in text:
            return RewardResult(0.0, {"reason": "no final answer"})
        ok = equivalent(text, sample.answer, candidate_is_math=False) or (
            answer is not None and equivalent(answer, sample.answer))
    return RewardResult(1.0 if ok else 0.0, {"extracted": answer,
                                             **({} if ok else {"reason": "wrong answer"})})
