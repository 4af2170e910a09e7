"""Rewards of a batch of responses, scored once per model replica."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.rewards.registry import RewardInput
from megatron_gspo.rollout.share import share_values
from megatron_gspo.rollout.types import Sample


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
