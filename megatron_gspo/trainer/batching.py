"""From the step's samples to the batch each rank trains: group advantages, the overlong policy,
and with packing the rows each data-parallel rank trains (balanced by tokens) in packed
micro-batches; the layouts of each mini-batch and their micro-batches."""

from __future__ import annotations

import torch

from megatron_gspo.algorithms.advantages import (group_advantages, informative_groups,
                                                 overlong_penalty)
from megatron_gspo.batch.exchange import exchange_rows
from megatron_gspo.batch.layout import layouts_of, packed_layouts
from megatron_gspo.batch.micro_batch import micro_batch, route_targets
from megatron_gspo.batch.packing import plan_step
from megatron_gspo.batch.rollout_batch import (RolloutBatch, build_batch, prompt_shares,
                                               row_width, width_multiple)
from megatron_gspo.config import JobConfig
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.models import te


def make_batch(job: JobConfig, ctx: ParallelContext, samples, rewards, *, pad_id: int):
    """The step's rows with group advantages, after ``rollout.overlong`` (soft penalty on the
    rewards, or no loss on truncated responses); with ``trainer.packing``, the rows each
    data-parallel rank trains (balanced by tokens) and their packed micro-batches. Returns the
    batch and the overlong metrics."""
    r, metrics = job.rollout, {}
    if r.overlong == "soft_penalty":
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        penalty = overlong_penalty(lengths, r.max_new_tokens, r.overlong_buffer).float()
        rewards = rewards + penalty
        metrics["rollout/overlong_penalty"] = dp_mean(ctx, float(penalty.sum()), len(samples))
    adv = group_advantages(rewards, r.group_size, scale=job.algo.scale_advantages)
    width = row_width(samples, device=ctx.device, multiple_of=width_multiple(ctx))
    batch = build_batch(samples, rewards, adv, width=width, pad_id=pad_id,
                        num_experts=job.model.num_experts)
    batch.informative_B = informative_groups(rewards, r.group_size).float()
    if r.overlong == "mask":
        cut = torch.tensor([s.finish_reason == "length" for s in samples])
        batch.mask_BS[cut] = 0.0
        metrics["rollout/overlong_masked"] = dp_mean(ctx, float(cut.sum()), len(samples))
    if job.trainer.packing:
        batch = pack_batch(job, ctx, batch)
    return batch, metrics


def shares_prompts(job: JobConfig, ctx: ParallelContext) -> bool:
    """``trainer.share_prompts`` where it applies: packed rows without context parallelism, on
    this project's SDPA attention (not Transformer Engine's)."""
    t = job.trainer
    return (t.packing and t.share_prompts and ctx.cp == 1
            and not te.use_te_spec(ctx.device.type))


def pack_batch(job: JobConfig, ctx: ParallelContext, batch: RolloutBatch) -> RolloutBatch:
    """Packing: every rank plans the step from all ranks' row lengths (and, sharing prompts,
    which rows hold the same prompt), receives its rows and cuts them into packed
    micro-batches (``batch.packing``)."""
    t = job.trainer
    lengths = comm.all_gather_vector(batch.lengths_B, device=ctx.device, group=ctx.dp_group)
    shares = None
    if shares_prompts(job, ctx):
        mine = torch.tensor(prompt_shares(batch), dtype=torch.long).reshape(-1)
        shares = [list(zip(v[0::2], v[1::2])) for v in
                  comm.all_gather_vector(mine, device=ctx.device, group=ctx.dp_group)]
    seq_multiple = 2 * ctx.cp if ctx.cp > 1 else 1
    row_multiple = width_multiple(ctx)
    plan = plan_step(lengths, minibatches=job.algo.minibatches,
                     budget=t.max_tokens_per_micro_batch, seq_multiple=seq_multiple,
                     row_multiple=row_multiple, shares=shares, group_size=split_groups(job))
    batch = exchange_rows(batch, plan, lengths, ctx, num_experts=job.model.num_experts)
    # Expert parallelism's all-gather dispatcher exchanges equal token counts: the k-th
    # micro-batch gets one length on every rank. Pipeline stages exchange activations of one
    # shape per pass (Megatron's variable sequence lengths need the all-to-all dispatcher):
    # there, all micro-batches share one length.
    batch.layouts = packed_layouts(plan, ctx.dp_rank, lengths, seq_multiple=seq_multiple,
                                   row_multiple=row_multiple, across_ranks=ctx.ep > 1,
                                   same_length=ctx.pp > 1, shares=shares)
    return batch


def dp_mean(ctx: ParallelContext, total: float, count: int) -> float:
    """A mean over every data-parallel rank's ``count`` items."""
    total, count = comm.reduce_values([total, count], device=ctx.device, group=ctx.dp_group)
    return total / max(count, 1.0)


def split_groups(job: JobConfig) -> int:
    """The group size when mini-batches take whole groups (``algo.minibatch_split``), else 0."""
    return job.rollout.group_size if job.algo.minibatch_split == "groups" else 0


def minibatch_layouts(job: JobConfig, batch: RolloutBatch) -> list:
    """The micro-batch layouts of each mini-batch (packed, or padded rows)."""
    return layouts_of(batch, job.algo.minibatches, job.trainer.micro_batch_size,
                      split_groups(job))


def micro_batches_of(batch: RolloutBatch, layouts, pad_id: int) -> list:
    return [micro_batch(batch, layout, pad_id) for layout in layouts]


def engine_routes(batch: RolloutBatch, layouts, *, layers, ctx: ParallelContext) -> list:
    """Engine routes of each micro-batch for this rank's routers (``layers``: its MoE layers;
    R3 and rollout/train drift)."""
    return [route_targets(batch, layout, layers=layers, ctx=ctx) for layout in layouts]


def unpack(batch: RolloutBatch, layouts, values: list) -> torch.Tensor:
    """Per-micro-batch values back in the batch's [B, S] rows."""
    out = torch.zeros(batch.rows, batch.width)
    for layout, v in zip(layouts, values):
        layout.scatter(out, v)
    return out
