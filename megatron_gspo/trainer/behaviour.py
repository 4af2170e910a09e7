"""The behaviour phase: each row's behaviour (old-policy) log-probs as the step's
``BehaviourPlan`` says (the engine's, or the trainer's forward-only pass, with routes recorded
or replayed), the reference policy's, and the rollout correction of the engine's sampling."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_gspo.algorithms.behaviour import BehaviourPlan, plan_behaviour
from megatron_gspo.algorithms.correction import rollout_weights, weighted_advantages
from megatron_gspo.batch.layout import forward_only_layouts
from megatron_gspo.batch.rollout_batch import RolloutBatch
from megatron_gspo.config import AlgoConfig, JobConfig
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.trainer.batching import (engine_routes, micro_batches_of, minibatch_layouts,
                                            unpack)
from megatron_gspo.trainer.passes import logprob_pass
from megatron_gspo.trainer.run import Run
from moe.instrument import local_layers_of


def step_plan(run: Run, batch: RolloutBatch) -> BehaviourPlan:
    """The step's ``BehaviourPlan`` (the drift probe could read the pass of padded rows)."""
    probe = run.drift is not None and run.drift.reads_old_pass(batch)
    return plan_behaviour(run.job, run.ctx.device.type, records_routes=run.policy.replay is not None,
                          probe_would_read_pass=probe)


def behaviour_logprobs(run: Run, batch: RolloutBatch, plan: BehaviourPlan) -> Optional[list]:
    """Fill ``batch.old_logp_BS`` (and ``trainer_logp_BS``, ``pending_B``, ``ref_logp_BS``) as
    ``plan`` says; returns the routes of each micro-batch's forward in the order the updates
    consume them (recorded by the pass for R2, the engine's for R3), or None."""
    job, ctx, policy = run.job, run.ctx, run.policy
    per_k = minibatch_layouts(job, batch)
    layouts = [layout for per in per_k for layout in per]
    skip = len(per_k[0]) if plan.first_from_update else 0
    pending = torch.zeros(batch.rows, dtype=torch.bool)
    pending[[row for layout in layouts[:skip] for row in layout.rows]] = True
    layers = run.drift.layers if run.drift else local_layers_of(job.model, ctx)
    r3 = engine_routes(batch, layouts, layers=layers, ctx=ctx) if plan.replay == "r3" else None
    pad_id, temp = run.prompts.tokenizer.pad_id, job.rollout.temperature
    routes, batch.trainer_rows_B = r3, None
    if not plan.runs_pass:
        batch.old_logp_BS = batch.engine_logp_BS.clone()
        # the trainer's own log-probs: the first update's forward gives those of its rows
        batch.trainer_logp_BS = torch.zeros_like(batch.old_logp_BS) if skip else None
        batch.trainer_rows_B = pending.clone() if skip else None
    else:
        # Routes recorded or replayed follow the updates' micro-batches; log-probs alone need not.
        passed = layouts[skip:]
        if not plan.record_routes and r3 is None:
            passed = forward_only(job, ctx, passed)
        logp = []
        if passed:
            logp, recorded = logprob_pass(policy.ddp, micro_batches_of(batch, passed, pad_id),
                                          ctx, temperature=temp, replay=policy.replay,
                                          record=plan.record_routes,
                                          targets=r3[skip:] if r3 is not None else None)
            routes = r3 if r3 is not None else recorded
        batch.old_logp_BS = batch.trainer_logp_BS = unpack(batch, passed, logp)
    for layout in layouts[:skip]:  # not known until the first update: 0, and marked pending
        layout.scatter(batch.old_logp_BS, torch.zeros_like(layout.gather(batch.old_logp_BS)))
    if policy.ref_model is not None:  # (its regrouped micro-batches read no behaviour values)
        ref_layouts = forward_only(job, ctx, layouts)
        ref, _ = logprob_pass(policy.ref_model, micro_batches_of(batch, ref_layouts, pad_id), ctx,
                              temperature=temp)
        batch.ref_logp_BS = unpack(batch, ref_layouts, ref)
    batch.pending_B = pending if skip else None
    return routes


def forward_only(job: JobConfig, ctx: ParallelContext, layouts: list) -> list:
    """Forward-only passes regroup consecutive packed micro-batches (``forward_only_layouts``)."""
    return forward_only_layouts(layouts, job.trainer.max_tokens_per_micro_batch, ep=ctx.ep,
                                pp=ctx.pp)


def correct_for_the_engine(algo: AlgoConfig, ctx: ParallelContext, batch: RolloutBatch) -> dict:
    """Rollout correction (``algo.rollout_correction``): importance weights of the old policy
    over the engine's sampling, carried by the advantages; returns the step's metrics of it."""
    if algo.rollout_correction == "none":
        return {}
    weights, m = rollout_weights(batch.old_logp_BS.double(), batch.engine_logp_BS.double(),
                                 batch.mask_BS, mode=algo.rollout_correction,
                                 cap=algo.rollout_correction_cap, low=algo.rollout_correction_low,
                                 high=algo.rollout_correction_high, per_token=algo.name != "gspo")
    batch.advantages_B = weighted_advantages(algo.name, batch.advantages_B.double(), weights,
                                             batch.mask_BS).float()
    tokens = float(batch.mask_BS.sum())
    seqs = float((batch.mask_BS.sum(-1) > 0).sum())
    weight_sum, token_sum, masked, seq_sum = comm.reduce_values(
        [m["mean_weight"] * tokens, tokens, m["masked_fraction"] * seqs, seqs],
        device=ctx.device, group=ctx.dp_group)
    return {"train/rollout_correction/mean_weight": weight_sum / max(token_sum, 1.0),
            "train/rollout_correction/masked_fraction": masked / max(seq_sum, 1.0)}
