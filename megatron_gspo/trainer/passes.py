"""The model passes of an RL step: behaviour (old) and reference log-probs, one policy update on a
mini-batch, a supervised step, and the non-finite guard around every optimizer step.

All passes go through ``forward.forward_backward`` (Megatron's schedules, so pipeline stages work).
Legend: ``B`` rows, ``S`` fed tokens per row.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_gspo.algorithms.logprobs import token_logprobs
from megatron_gspo.algorithms.losses import (combine_metrics, metric_kind, policy_loss,
                                             shard_policy_loss)
from megatron_gspo.batch.micro_batch import MicroBatch
from megatron_gspo.config import AlgoConfig
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.distributed.seqshard import SequenceReducer, TokenShard
from megatron_gspo.models import router_losses
from megatron_gspo.models.forward import forward_backward, last_stage_metrics
from megatron_gspo.trainer.faults import NonFiniteGuard, all_finite
from megatron_gspo.trainer.optim import zero_grads


def logprob_pass(model, mbs: list[MicroBatch], ctx: ParallelContext, *, temperature: float,
                 replay=None, record: bool = False, targets=None):
    """Forward-only log-probs of every micro-batch's targets: a list with one host tensor per
    micro-batch ([B, S] rows, or [1, N] packed), on every rank (pipeline stages and
    context-parallel ranks all hold the batch's behaviour log-probs). With ``record``, also the
    routes of each micro-batch's forward (this rank's tokens); with ``targets``, those routes are
    replayed."""

    def loss_fn(mb, logits):
        logp, _ = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group, temperature=temperature)
        return logp.sum() * 0.0, {"logp": logp.detach().float()}

    routes = None
    if targets is not None:
        cm = replay.replay(targets)
    elif record:
        cm = replay.record()
    else:
        cm = contextlib.nullcontext()
    with torch.no_grad(), cm as recorded:
        out = forward_backward(model, mbs, ctx, loss_fn, forward_only=True)
    if record and targets is None:
        routes = recorded.forwards
    return on_every_rank([o["logp"] for o in out], mbs, ctx), routes


def on_every_rank(values: list, mbs: list[MicroBatch], ctx: ParallelContext) -> list:
    """Per-token values of every micro-batch, computed on the last stage (``values``: one per
    micro-batch there, this context-parallel rank's share; empty elsewhere), as host tensors of
    the micro-batches' whole shape on every rank: one broadcast from the last stage, one
    all-gather over the context-parallel ranks (their shares are equal in size)."""
    shapes = [(mb.tokens_BS.shape[0], mb.cp_index(ctx.cp, ctx.cp_rank).numel()) for mb in mbs]
    flat = (torch.cat([v.reshape(-1).float() for v in values]).to(ctx.device) if values
            else torch.zeros(sum(b * c for b, c in shapes), device=ctx.device))
    comm.broadcast_tensor(flat, src_in_group=ctx.pp - 1, group=ctx.pp_group)
    parts = [torch.empty_like(flat) for _ in range(ctx.cp)]
    dist.all_gather(parts, flat.contiguous(), group=ctx.cp_group)
    parts = [p.cpu() for p in parts]
    values, at = [], 0
    for mb, (b, c) in zip(mbs, shapes):
        full = torch.empty(b, mb.tokens_BS.shape[1], dtype=flat.dtype)
        for rank, part in enumerate(parts):
            full[:, mb.cp_index(ctx.cp, rank)] = part[at:at + b * c].reshape(b, c)
        values.append(full)
        at += b * c
    return values


@dataclass
class UpdateResult:
    metrics: dict  # loss metrics of the mini-batch (combined over micro-batches and DP ranks)
    grad_norm: float
    applied: bool
    extra: dict = field(default_factory=dict)


def combine_over_data_parallel(metrics: dict, algo: str, ctx: ParallelContext) -> dict:
    """The metrics of the whole mini-batch from every data-parallel rank's share (see
    ``losses.metric_kind``): one all-reduce of sums and count-weighted sums, one of maxima (minima
    negated), on the run's device."""
    keys = sorted(metrics)
    kinds = [metric_kind(algo, k) for k in keys]

    def stacked(values) -> torch.Tensor:
        return torch.stack([v.detach().double().reshape(()).to(ctx.device) for v in values])

    sums = comm.reduce_tensor(stacked([metrics[k] * metrics[kind] if kind.startswith("num_")
                                       else metrics[k] for k, kind in zip(keys, kinds)]),
                              group=ctx.dp_group)
    maxima = comm.reduce_tensor(stacked([-metrics[k] if kind == "min" else metrics[k]
                                         for k, kind in zip(keys, kinds)]),
                                group=ctx.dp_group, op="max")
    total = dict(zip(keys, sums))
    out = {}
    for k, kind, high in zip(keys, kinds, maxima):
        if kind in ("min", "max"):
            out[k] = -high if kind == "min" else high
        else:
            out[k] = total[k] if kind == "sum" else total[k] / total[kind].clamp_min(1e-12)
    return out


def policy_update(ddp, optimizer, mbs: list[MicroBatch], ctx: ParallelContext, algo: AlgoConfig, *,
                  temperature: float, normalizer: float, guard: NonFiniteGuard, where: str,
                  replay=None, targets=None, inject_nan: bool = False,
                  on_policy: bool = False) -> UpdateResult:
    """One optimizer update on a mini-batch: the policy loss on every micro-batch (routes replayed
    from ``targets`` under R2 / R3), then the step, skipped on every rank if anything is
    non-finite. ``normalizer`` is the mini-batch's global count of sequences (or tokens, for
    token_mean) over every data-parallel rank, so that each rank's loss is its share of the
    mini-batch loss; the gradient is scaled by dp against DDP's average over the ranks.
    Sequence-level statistics are completed over the context-parallel group (O(sequences)).

    ``on_policy``: the weights are still the behaviour policy's (the step's first mini-batch),
    so the behaviour log-probs are this forward's own, detached (the ratio is exactly 1), and
    the micro-batches' ``old_logp_BS`` are not read; they are returned in
    ``extra["old_logp"]`` (as ``logprob_pass`` returns them), which spares their own pass."""
    options = algo.loss_options()
    reducer = SequenceReducer(ctx.cp_group)
    behaviour = []  # on_policy: each micro-batch's detached log-probs (last stage)

    def loss_fn(mb, logits):
        logp, ent = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group, temperature=temperature,
                                   with_entropy=True)
        old = mb.old_logp_BS
        if on_policy:
            old = logp.detach()
            behaviour.append(old.float())
        if not options.get("entropy_coef"):
            ent = ent.detach()  # a metric only: no entropy gradient to compute in the backward
        kwargs = dict(clip_low=algo.clip_low, clip_high=algo.clip_high, normalizer=normalizer,
                      reducer=reducer, **options)
        if mb.packed:  # the row's segments are the sequences
            shard = TokenShard.from_packed(logp, old, mb.advantages_B, mb.loss_mask_BS,
                                           mb.seq_BS, mb.num_seqs, ref_logp_1N=mb.ref_logp_BS,
                                           entropy_1N=ent)
            loss, metrics = shard_policy_loss(algo.name, shard, **kwargs)
        else:
            loss, metrics = policy_loss(algo.name, logp, old, mb.advantages_B,
                                        mb.loss_mask_BS, ref_logprobs=mb.ref_logp_BS, entropy=ent,
                                        **kwargs)
        return loss * ctx.dp, metrics

    zero_grads(ddp, optimizer)
    router_losses.reset()
    cm = replay.replay(targets) if targets is not None else contextlib.nullcontext()
    with cm:
        out = forward_backward(ddp, mbs, ctx, loss_fn, aux_mask=True)
    extra = {"old_logp": on_every_rank(behaviour, mbs, ctx)} if on_policy else {}
    metrics = last_stage_metrics(out, ctx, functools.partial(combine_metrics, algo.name))
    metrics = combine_over_data_parallel(metrics, algo.name, ctx)
    metrics["policy_loss"] = metrics["loss"]
    metrics.update(router_losses.collect(ddp.module.config, ctx, len(mbs)))
    metrics["loss"] = metrics["policy_loss"] + metrics["aux_loss"]
    if inject_nan and ctx.rank == 0:  # fault injection: one rank's gradient goes bad
        _grad_buffers(ddp)[0].view(-1)[0] = float("nan")
    finite = all_finite(metrics.get("loss"), _grad_buffers(ddp), device=ctx.device)
    if not guard.check(finite, where):
        zero_grads(ddp, optimizer)
        return UpdateResult(metrics, float("nan"), False,
                            extra={"cp_values_sent": reducer.values_sent, **extra})
    _, grad_norm, _ = optimizer.step()
    return UpdateResult(metrics, float(grad_norm) if grad_norm is not None else 0.0, True,
                        extra={"cp_values_sent": reducer.values_sent, **extra})


def _grad_buffers(ddp) -> list:
    buffers = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    return [b.grad_data for b in buffers]


def sft_update(ddp, optimizer, mbs: list[MicroBatch], ctx: ParallelContext, *, normalizer: float,
               guard: NonFiniteGuard, where: str) -> tuple[float, float]:
    """One supervised update: token-mean negative log-likelihood of the masked (answer) tokens;
    ``normalizer`` is the global count of those tokens over every data-parallel rank. Returns
    (loss, accuracy): the fraction of rows whose answer tokens are all the model's most likely
    next tokens (teacher-forced, before the update)."""

    def loss_fn(mb, logits):
        logp, _ = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group)
        # Each context-parallel rank sums its own tokens: a partial sum of the row's loss.
        nll = -(logp * mb.loss_mask_BS).sum()
        # A row is right when its target is the most likely token at every answer position.
        best = logits.detach().max(-1).values
        comm.reduce_tensor(best, group=ctx.tp_group, op="max")
        target_logit = _target_logits(logits.detach(), mb.targets_BS, ctx)
        wrong = ((target_logit < best) & (mb.loss_mask_BS > 0)).any(-1).to(torch.int64)
        comm.reduce_tensor(wrong, group=ctx.cp_group, op="max")
        right = (wrong == 0).sum().to(logp.dtype)
        rows = torch.tensor(float(len(wrong)), device=logp.device)
        # Row counts are complete on every CP rank: count them on CP rank 0 only (the metrics are
        # summed over the data x context-parallel ranks).
        first = float(ctx.cp_rank == 0)
        return nll / normalizer * ctx.dp, {"nll": nll.detach(), "tokens": mb.loss_mask_BS.sum(),
                                           "rows": rows * first, "right": right * first}

    zero_grads(ddp, optimizer)
    router_losses.reset()
    out = forward_backward(ddp, mbs, ctx, loss_fn, aux_mask=True)
    m = last_stage_metrics(out, ctx, lambda parts: {k: torch.stack([p[k] for p in parts]).sum()
                                                    for k in parts[0]})
    router_losses.reset()
    nll, tokens, right, rows = comm.reduce_values([m["nll"], m["tokens"], m["right"], m["rows"]],
                                                  device=ctx.device, group=ctx.dp_cp_group)
    loss = nll / max(tokens, 1.0)
    accuracy = right / max(rows, 1.0)
    if not guard.check(all_finite(torch.tensor(loss), _grad_buffers(ddp), device=ctx.device), where):
        zero_grads(ddp, optimizer)
        return loss, accuracy
    optimizer.step()
    return loss, accuracy


def _target_logits(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, ctx: ParallelContext):
    """The logit of each target token, with the vocabulary split over the TP ranks."""
    v = logits_BSV.shape[-1]
    start = ctx.tp_rank * v
    local = targets_BS - start
    inside = (local >= 0) & (local < v)
    picked = logits_BSV.gather(-1, local.clamp(0, v - 1)[..., None])[..., 0]
    picked = torch.where(inside, picked, torch.full_like(picked, -float("inf")))
    return comm.reduce_tensor(picked, group=ctx.tp_group, op="max")


def sft_micro_batches(prompt_ids: list, answer_ids: list, *, eos_id: int, pad_id: int, size: int,
                      width: Optional[int] = None) -> list[MicroBatch]:
    """Prompt + answer + eos rows, right-padded (to ``width`` tokens if given); the loss covers
    the answer and eos."""
    rows = [list(p) + list(a) + [eos_id] for p, a in zip(prompt_ids, answer_ids)]
    width = width or max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    for i, (r, p) in enumerate(zip(rows, prompt_ids)):
        tokens[i, :len(r)] = torch.tensor(r)
        mask[i, len(p) - 1:len(r) - 1] = 1.0
    return [MicroBatch(tokens[i:i + size, :-1], tokens[i:i + size, 1:], loss_mask_BS=mask[i:i + size])
            for i in range(0, len(rows), size)]


def normalizer_for(algo: AlgoConfig, mbs: list[MicroBatch], ctx: ParallelContext) -> float:
    """The mini-batch's global count of sequences (or tokens, for token_mean) over every
    data-parallel rank: each rank divides its loss by it, so that the ranks' losses are shares
    of the mini-batch loss."""
    if algo.aggregation == "seq_mean":
        local = sum(float((mb.response_counts() > 0).sum()) for mb in mbs)
    else:
        local = sum(float(mb.loss_mask_BS.sum()) for mb in mbs)
    return max(comm.reduce_sum(local, device=ctx.device, group=ctx.dp_group), 1.0)
