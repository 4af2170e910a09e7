"""Scoring responses and evaluating a policy on prompt records: accuracy and pass@k.

Used by the trainer (held-out accuracy) and by ``tools/evaluate.py`` (any checkpoint, any prompt
file), so that both compute the same numbers the same way: records split over data-parallel
ranks, chunks of 64 prompts, rewards scored once per model replica (its leader), sums reduced
over the world with each replica counted once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.rollout.types import SamplingParams
from megatron_gspo.trainer.generation import generate, score
from megatron_gspo.trainer.run import Run


CHUNK = 64  # prompts per generation call


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator (Chen et al., 2021) of one prompt with ``c`` right answers
    among ``n`` samples: 1 - C(n - c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class EvalResult:
    accuracy: float  # mean reward over every response
    pass_at: dict = field(default_factory=dict)  # k -> mean pass@k over prompts (right = reward 1)
    prompts: int = 0
    rows: list = field(default_factory=list)  # this rank's prompts: responses and rewards


def evaluate_records(records: Sequence, *, ctx: ParallelContext, generate: Callable,
                     score: Callable, render: Callable, params: SamplingParams,
                     samples: int = 1, decode: Callable = str) -> EvalResult:
    """``samples`` responses per record (``generate(ids, samples, params, first_row=...)``),
    scored with ``score(records, samples)``. Every rank calls; the result is the same on all."""
    if not records:
        return EvalResult(float("nan"))
    per_rank = -(-len(records) // ctx.dp)
    mine = list(records[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank])
    real = len(mine)
    mine = mine + [records[0]] * (per_rank - real)  # equal rows on every rank (lockstep decoding)
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= samples]
    right, count, passed, rows = 0.0, 0.0, [0.0] * len(ks), []
    for i in range(0, len(mine), CHUNK):
        part = mine[i:i + CHUNK]
        ids = [render(p) for p in part]
        first_row = (ctx.dp_rank * per_rank + i) * samples
        out = generate(ids, samples, params, first_row=first_row)
        rewards = score([part[s.prompt_index] for s in out], out)[0]
        keep = max(0, real - i) * samples  # padding rows are not counted
        right += float(rewards[:keep].sum())
        count += len(rewards[:keep])
        for j, rec in enumerate(part[:max(0, real - i)]):
            got = rewards[j * samples:(j + 1) * samples]
            correct = int((got >= 1.0).sum())
            for slot, k in enumerate(ks):
                passed[slot] += pass_at_k(samples, correct, k)
            rows.append({"prompt": rec.prompt, "answer": rec.answer,
                         "responses": [decode(s.response_ids)
                                       for s in out[j * samples:(j + 1) * samples]],
                         "rewards": got.tolist()})
    # Every rank of a replica holds the same scores: count them once, on the leader.
    lead = ctx.is_replica_leader
    totals = comm.reduce_values([x if lead else 0.0 for x in (right, count, len(rows), *passed)],
                                device=ctx.device)
    right, count, prompts = totals[:3]
    return EvalResult(right / count, {k: p / prompts for k, p in zip(ks, totals[3:])},
                      int(prompts), rows)


def evaluate(run: Run) -> float:
    """Held-out accuracy: greedy responses to the held-out prompts, mean reward (split over DP)."""
    tok, ctx = run.prompts.tokenizer, run.ctx
    params = SamplingParams(max_new_tokens=run.job.rollout.max_new_tokens, temperature=0.0,
                            stop_token_ids=(tok.eos_id,))
    return evaluate_records(
        run.prompts.held_out, ctx=ctx, params=params,
        generate=functools.partial(generate, run.engine, ctx),
        score=functools.partial(score, run.prompts, ctx),
        render=lambda p: tok.render_prompt(p.prompt, p.messages)).accuracy
