"""The step's K mini-batch policy updates, the first on-policy, the later ones off-policy; the
drift probe measures around the first."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_gspo.algorithms.behaviour import BehaviourPlan
from megatron_gspo.batch.rollout_batch import RolloutBatch
from megatron_gspo.trainer.batching import micro_batches_of, minibatch_layouts
from megatron_gspo.trainer.passes import normalizer_for, policy_update
from megatron_gspo.trainer.run import Run


def update(run: Run, batch: RolloutBatch, plan: BehaviourPlan, routes: Optional[list]):
    """K mini-batch updates; the first is on-policy (ratio 1; against the engine's log-probs
    with ``algo.old_logprobs=engine``), later ones are off-policy. Under R2 / R3 each update
    replays its micro-batches' ``routes``. Returns the updates' results and the drift metrics."""
    job, ctx, policy = run.job, run.ctx, run.policy
    results, drift = [], {}
    step, done = run.step + 1, 0
    for k, layouts in enumerate(minibatch_layouts(job, batch)):
        mbs = micro_batches_of(batch, layouts, run.prompts.tokenizer.pad_id)
        if k == 0 and run.drift is not None:
            drift.update(run.drift.before_updates(batch, routes, step, plan.probe_reads_pass))
        targets = routes[done:done + len(mbs)] if plan.replays_routes else None
        done += len(mbs)
        policy.updates += 1
        on_policy = k == 0 and batch.has_pending  # its rows' behaviour log-probs: its own
        result = policy_update(
            policy.ddp, policy.optimizer, mbs, ctx, job.algo,
            temperature=job.rollout.temperature, normalizer=normalizer_for(job.algo, mbs, ctx),
            guard=policy.guard, where=f"update {policy.updates}", replay=policy.replay,
            targets=targets, inject_nan=policy.updates in job.trainer.nan_at_updates,
            on_policy=on_policy)
        if on_policy:
            fill_pending(batch, layouts, result.extra.pop("old_logp"))
        if result.applied:
            policy.scheduler.step(1)
        results.append(result)
        if k == 0 and run.drift is not None:
            drift.update(run.drift.after_first_update(step))
    return results, drift


def fill_pending(batch: RolloutBatch, layouts, values: list) -> None:
    """The pending rows' behaviour log-probs, from their on-policy update's forward (the
    trainer's own log-probs too)."""
    for layout, v in zip(layouts, values):
        layout.scatter(batch.old_logp_BS, v)
        if batch.trainer_logp_BS is not None:
            layout.scatter(batch.trainer_logp_BS, v)  # (maybe the same tensor)
    batch.pending_B = torch.zeros_like(batch.pending_B)
