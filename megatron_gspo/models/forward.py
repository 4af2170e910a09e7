"""Pipeline-aware forward (and backward) of a GPTModel over micro-batches.

Every layout goes through Megatron's ``get_forward_backward_func``, so the same call runs without
pipelining and with 1F1B pipeline schedules. Under context parallelism each rank feeds its zigzag
share of every micro-batch (``MicroBatch.for_cp_rank``) and the loss function sees that share.
Shapes: ``B`` micro-batch size, ``S`` sequence length, ``C`` tokens this CP rank holds of a row.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_gspo.batch.micro_batch import MicroBatch
from megatron_gspo.distributed import comm
from megatron_gspo.distributed.parallel import ParallelContext


# loss_fn(micro_batch, logits_BCV) -> (scalar loss, metrics dict); runs on the last stage only,
# on this context-parallel rank's share of the micro-batch. Each micro-batch's loss is its share
# of the rank's loss (their sum); Megatron's DDP averages the ranks' gradients over data-parallel
# ranks. Context-parallel ranks return the same (complete) loss, whose gradient flows through
# each rank's own tokens only: Megatron's x cp on the loss and its average over data x
# context-parallel ranks then sum the CP ranks' gradients exactly once.
LossFn = Callable[[MicroBatch, torch.Tensor], tuple]


def forward_backward(gpt, micro_batches: list[MicroBatch], ctx: ParallelContext, loss_fn: LossFn,
                     *, forward_only: bool = False, aux_mask: bool = False) -> list[dict]:
    """Run all micro-batches through ``gpt``; returns each micro-batch's metrics on the last stage
    (an empty list elsewhere). Gradients accumulate in ``.grad`` / ``.main_grad`` unless
    ``forward_only``. With ``aux_mask``, the MoE routers' auxiliary losses see only the tokens
    whose next token is in the loss (``loss_mask_BS`` > 0), never padding or prompt tokens."""
    n_mb = len(micro_batches)

    def summed(mb, logits):
        with torch.profiler.record_function("module:loss"):  # a range for profiles of the step
            loss, metrics = loss_fn(mb, logits)
        return loss * n_mb, metrics  # Megatron divides each micro-batch's loss by their number

    def step(data_iter, model):
        share = next(data_iter).for_cp_rank(ctx.cp, ctx.cp_rank)
        packed_seq_params = share.packed_seq_params(ctx.device)
        mb = share.to(ctx.device)
        padding = _aux_padding(mb, ctx) if aux_mask and mb.loss_mask_BS is not None else None
        logits = model(mb.tokens_BS, mb.positions(), attention_mask=None,
                       packed_seq_params=packed_seq_params, padding_mask=padding)
        return logits, functools.partial(summed, mb)

    b, s = micro_batches[0].tokens_BS.shape
    run = get_forward_backward_func(pp_size=ctx.pp)
    extra = {}
    if ctx.pp > 1:  # the pipelined schedule takes its p2p communicator explicitly with the groups
        extra["p2p_communicator"] = P2PCommunicator(ctx.pp_group, gpt.config)
    # seq_length is the whole row: the pipelined schedules divide it by cp (and tp under SP).
    return run(forward_step_func=step, data_iterator=iter(micro_batches), model=[gpt],
               num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b,
               forward_only=forward_only, pg_collection=ctx.pg, **extra)


def _aux_padding(mb: MicroBatch, ctx: ParallelContext) -> torch.Tensor:
    """[B, C] True where a token is left out of the routers' auxiliary losses. Megatron splits the
    mask for sequence parallelism on the first pipeline stage only; later stages get their share
    here."""
    padding = mb.loss_mask_BS <= 0
    if ctx.sequence_parallel and not ctx.is_first_stage:
        s = padding.shape[1] // ctx.tp
        padding = padding[:, ctx.tp_rank * s:(ctx.tp_rank + 1) * s]
    return padding.contiguous()


def last_stage_metrics(out: list[dict], ctx: ParallelContext,
                       combine: Callable[[list[dict]], dict]) -> dict:
    """Combine the last stage's per-micro-batch metrics with ``combine`` and broadcast the result
    (on the run's device) to every pipeline stage, so that all ranks agree on the same numbers."""
    combined = combine(out) if out else {}
    last = dist.get_global_rank(ctx.pp_group, ctx.pp - 1)
    holder = [sorted(combined)]
    dist.broadcast_object_list(holder, src=last, group=ctx.pp_group)
    keys = holder[0]
    values = (torch.stack([combined[k].detach().double().reshape(()).to(ctx.device) for k in keys])
              if combined else torch.zeros(len(keys), dtype=torch.float64, device=ctx.device))
    comm.broadcast_tensor(values, src_in_group=ctx.pp - 1, group=ctx.pp_group)
    return dict(zip(keys, values))
