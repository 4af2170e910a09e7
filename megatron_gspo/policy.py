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

from megatron_gspo.config import AlgoConfig
from megatron_gspo.faults import NonFiniteGuard, all_finite
from megatron_gspo.forward import MicroBatch, forward_backward, last_stage_metrics
from megatron_gspo.logprobs import token_logprobs
from megatron_gspo.losses import combine_metrics, policy_loss
from megatron_gspo.optim import zero_grads
from megatron_gspo.parallel import ParallelContext


def logprob_pass(model, mbs: list[MicroBatch], ctx: ParallelContext, *, temperature: float,
                 replay=None, record: bool = False, targets=None):
    """Forward-only log-probs of every micro-batch's targets, [B, S] on every pipeline stage (so
    that all ranks hold the batch's behaviour log-probs). With ``record``, also the routes of
    each micro-batch's forward; with ``targets``, those routes are replayed."""

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
    b = sum(mb.tokens_BS.shape[0] for mb in mbs)
    s = mbs[0].tokens_BS.shape[1]
    logp = torch.cat([o["logp"] for o in out]) if out else torch.zeros(b, s)
    if ctx.pp > 1:
        dist.broadcast(logp, group_src=ctx.pp - 1, group=ctx.pp_group)
    return logp, routes


@dataclass
class UpdateResult:
    metrics: dict  # loss metrics of the mini-batch (combined over micro-batches and DP ranks)
    grad_norm: float
    applied: bool
    extra: dict = field(default_factory=dict)


def _dp_combine(metrics: dict, algo: str, ctx: ParallelContext) -> dict:
    """The metrics of the whole mini-batch from every data-parallel rank's share."""
    if ctx.dp == 1 or not metrics:
        return metrics
    parts = [None] * ctx.dp
    dist.all_gather_object(parts, {k: v.detach().double() for k, v in metrics.items()},
                           group=ctx.dp_group)
    return combine_metrics(algo, parts)


def policy_update(ddp, optimizer, mbs: list[MicroBatch], ctx: ParallelContext, algo: AlgoConfig, *,
                  temperature: float, normalizer: float, guard: NonFiniteGuard, where: str,
                  replay=None, targets=None, inject_nan: bool = False) -> UpdateResult:
    """One optimizer update on a mini-batch: the policy loss on every micro-batch (routes replayed
    from ``targets`` under R2 / R3), then the step, skipped on every rank if anything is
    non-finite."""
    options = algo.loss_options()

    def loss_fn(mb, logits):
        logp, ent = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group, temperature=temperature,
                                   with_entropy=True)
        return policy_loss(algo.name, logp, mb.old_logp_BS, mb.advantages_B, mb.loss_mask_BS,
                           clip_low=algo.clip_low, clip_high=algo.clip_high, normalizer=normalizer,
                           ref_logprobs=mb.ref_logp_BS, entropy=ent, **options)

    zero_grads(ddp, optimizer)
    cm = replay.replay(targets) if targets is not None else contextlib.nullcontext()
    with cm:
        out = forward_backward(ddp, mbs, ctx, loss_fn)
    metrics = last_stage_metrics(out, ctx, functools.partial(combine_metrics, algo.name))
    metrics = _dp_combine({k: v.detach() for k, v in metrics.items()}, algo.name, ctx)
    if inject_nan and ctx.rank == 0:  # fault injection: one rank's gradient goes bad
        _grad_buffers(ddp)[0].view(-1)[0] = float("nan")
    finite = all_finite(metrics.get("loss"), _grad_buffers(ddp))
    if not guard.check(finite, where):
        zero_grads(ddp, optimizer)
        return UpdateResult(metrics, float("nan"), False)
    _, grad_norm, _ = optimizer.step()
    return UpdateResult(metrics, float(grad_norm) if grad_norm is not None else 0.0, True)


def _grad_buffers(ddp) -> list:
    buffers = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
    return [b.grad_data for b in buffers]


def sft_update(ddp, optimizer, mbs: list[MicroBatch], ctx: ParallelContext, *, normalizer: float,
               guard: NonFiniteGuard, where: str) -> tuple[float, float]:
    """One supervised update: token-mean negative log-likelihood of the masked (answer) tokens.
    Returns (loss, accuracy): the fraction of rows whose answer tokens are all the model's most
    likely next tokens (teacher-forced, before the update)."""

    def loss_fn(mb, logits):
        logp, _ = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group)
        nll = -(logp * mb.loss_mask_BS).sum()
        # A row is right when its target is the most likely token at every answer position.
        best = logits.detach().max(-1).values
        if ctx.tp > 1:
            dist.all_reduce(best, op=dist.ReduceOp.MAX, group=ctx.tp_group)
        target_logit = _target_logits(logits.detach(), mb.targets_BS, ctx)
        wrong = ((target_logit < best) & (mb.loss_mask_BS > 0)).any(-1)
        return nll / normalizer, {"nll": nll.detach(), "tokens": mb.loss_mask_BS.sum(),
                                  "rows": torch.tensor(float(len(wrong))),
                                  "right": (~wrong).sum().float()}

    zero_grads(ddp, optimizer)
    out = forward_backward(ddp, mbs, ctx, loss_fn)
    m = last_stage_metrics(out, ctx, lambda parts: {k: torch.stack([p[k] for p in parts]).sum()
                                                    for k in parts[0]})
    totals = torch.stack([m["nll"], m["tokens"], m["right"], m["rows"]]).double()
    if ctx.dp > 1:
        dist.all_reduce(totals, group=ctx.dp_group)
    loss = float(totals[0] / totals[1].clamp_min(1))
    accuracy = float(totals[2] / totals[3].clamp_min(1))
    if not guard.check(all_finite(totals, _grad_buffers(ddp)), where):
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
    if ctx.tp > 1:
        dist.all_reduce(picked, op=dist.ReduceOp.MAX, group=ctx.tp_group)
    return picked


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
    """What each rank divides its loss by so that the gradient, averaged by Megatron over the
    data-parallel ranks, is the whole mini-batch's: sequences (or tokens, for token_mean) of every
    rank, divided by the data-parallel size."""
    if algo.aggregation == "seq_mean":
        local = sum(float((mb.loss_mask_BS.sum(1) > 0).sum()) for mb in mbs)
    else:
        local = sum(float(mb.loss_mask_BS.sum()) for mb in mbs)
    total = torch.tensor([local], dtype=torch.float64)
    if ctx.dp > 1:
        dist.all_reduce(total, group=ctx.dp_group)
    return max(float(total) / ctx.dp, 1.0 / ctx.dp)


def attach_ref(mbs: list[MicroBatch], ref_logp_BS: Optional[torch.Tensor], rows: list) -> None:
    """Give each micro-batch its rows' reference log-probs (KL term)."""
    if ref_logp_BS is None:
        return
    start = 0
    for mb in mbs:
        n = mb.tokens_BS.shape[0]
        mb.ref_logp_BS = ref_logp_BS[torch.tensor(rows[start:start + n])]
        start += n
