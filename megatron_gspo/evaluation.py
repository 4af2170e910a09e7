"""Scoring responses and evaluating a policy on prompt records: accuracy and pass@k.

Used by the trainer (held-out accuracy) and by ``tools/evaluate.py`` (any checkpoint, any prompt
file), so that both compute the same numbers the same way: records split over data-parallel
ranks, chunks of 64 prompts, rewards scored once per model replica (its leader), sums reduced
over the world with each replica counted once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from megatron_gspo import comm
from megatron_gspo.parallel import ParallelContext
from megatron_gspo.rewards import RewardInput
from megatron_gspo.rollout.share import share_values
from megatron_gspo.rollout.types import Sample, SamplingParams

CHUNK = 64  # prompts per generation call


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator (Chen et al., 2021) of one prompt with ``c`` right answers
    among ``n`` samples: 1 - C(n - c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def score_samples(records, samples: Sequence[Sample], *, decode: Callable, scorer,
                  ctx: ParallelContext) -> tuple[torch.Tensor, int]:
    """Rewards of ``samples`` (the i-th answering ``records[i]``), scored once per replica by its
    leader with ``scorer`` (``rewards.pool.make_scorer``) and broadcast to the replica's other
    ranks: a host float32 tensor on every rank, and the number of rewards that raised or timed
    out (scored 0) on the leader (0 elsewhere)."""
    out, failed = None, 0
    if ctx.is_replica_leader:
        results, failures = scorer.score([
            RewardInput(response=decode(s.response_ids), answer=rec.answer, tests=rec.tests,
                        meta=rec.metadata or {}) for rec, s in zip(records, samples)])
        out = torch.tensor([r.score for r in results], dtype=torch.float32)
        failed = sum(failures.values())
    return share_values(out, len(samples), group=ctx.replica_group, device=ctx.device), failed


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
