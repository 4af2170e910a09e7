"""Synthetic verifiable tasks that a tiny model learns on a CPU, generated deterministically from
a seed, scored by the rewards of ``rewards.text``.

- ``add``: "a+b=" -> the decimal sum (operands up to ``max_value``)
- ``reverse``: "rev:xyz=" -> "zyx" (lower-case letters, ``min_len`` to ``max_len`` of them)
- ``sort``: "sort:3141=" -> "1134" (digits, ``min_len`` to ``max_len`` of them): long responses
  for the routing experiments; ``char_match`` gives partial credit per position
"""

from __future__ import annotations

import random
import string

from megatron_gspo.data.prompts import PromptRecord


TASKS = ("add", "reverse", "sort")


def make_task(name: str, n: int, *, seed: int, max_value: int = 9, max_len: int = 4,
              min_len: int = 1) -> list[PromptRecord]:
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; valid: {', '.join(TASKS)}")
    rng = random.Random(f"{name}:{seed}")
    out = []
    for i in range(n):
        if name == "add":
            a, b = rng.randint(0, max_value), rng.randint(0, max_value)
            prompt, answer = f"{a}+{b}=", str(a + b)
        elif name == "sort":
            digits = "".join(rng.choice(string.digits)
                             for _ in range(rng.randint(min_len, max_len)))
            prompt, answer = f"sort:{digits}=", "".join(sorted(digits))
        else:
            word = "".join(rng.choice(string.ascii_lowercase)
                           for _ in range(rng.randint(min_len, max_len)))
            prompt, answer = f"rev:{word}=", word[::-1]
        out.append(PromptRecord(prompt=prompt, messages=None, answer=answer,
                                metadata={"task": name}, source=f"{name}:{seed}:{i}"))
    return out
