"""Pipeline-aware forward (and backward) of a GPTModel over micro-batches.

Every layout goes through Megatron's ``get_forward_backward_func``, so the same call runs without
pipelining and with 1F1B pipeline schedules. Shapes: ``B`` micro-batch size, ``S`` sequence length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_gspo.parallel import ParallelContext


@dataclass
class MicroBatch:
    """One micro-batch of token ids and the ids they predict (next tokens)."""

    tokens_BS: torch.Tensor
    targets_BS: torch.Tensor
    position_ids_BS: Optional[torch.Tensor] = None
    # For policy losses: behaviour log-probs and response mask of the targets, per-row advantages.
    old_logp_BS: Optional[torch.Tensor] = None
    loss_mask_BS: Optional[torch.Tensor] = None
    advantages_B: Optional[torch.Tensor] = None
    ref_logp_BS: Optional[torch.Tensor] = None  # reference policy, for the KL term
    # Packed sequences (B = 1, THD): cumulative sequence lengths of the row.
    cu_seqlens: Optional[torch.Tensor] = None

    def packed_seq_params(self):
        if self.cu_seqlens is None:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        cu = self.cu_seqlens.to(torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=longest, max_seqlen_kv=longest)

    def positions(self) -> torch.Tensor:
        if self.position_ids_BS is not None:
            return self.position_ids_BS
        b, s = self.tokens_BS.shape
        return torch.arange(s, device=self.tokens_BS.device).expand(b, s)


# loss_fn(micro_batch, logits_BSV) -> (scalar loss, metrics dict); runs on the last stage only.
# Each micro-batch's loss is its share of the batch loss: the batch loss is their sum.
LossFn = Callable[[MicroBatch, torch.Tensor], tuple]


def forward_backward(gpt, micro_batches: list[MicroBatch], ctx: ParallelContext, loss_fn: LossFn,
                     *, forward_only: bool = False) -> list[dict]:
    """Run all micro-batches through ``gpt``; returns each micro-batch's metrics on the last stage
    (an empty list elsewhere). Gradients accumulate in ``.grad`` / ``.main_grad`` unless
    ``forward_only``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n_mb = len(micro_batches)

    def summed(mb, logits):
        loss, metrics = loss_fn(mb, logits)
        return loss * n_mb, metrics  # Megatron divides each micro-batch's loss by their number

    def step(data_iter, model):
        mb = next(data_iter)
        logits = model(mb.tokens_BS.to(ctx.device), mb.positions().to(ctx.device),
                       attention_mask=None, packed_seq_params=mb.packed_seq_params())
        return logits, functools.partial(summed, mb)

    b, s = micro_batches[0].tokens_BS.shape
    run = get_forward_backward_func(pp_size=ctx.pp)
    extra = {}
    if ctx.pp > 1:  # the pipelined schedule takes its p2p communicator explicitly with the groups
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        extra["p2p_communicator"] = P2PCommunicator(ctx.pp_group, gpt.config)
    return run(forward_step_func=step, data_iterator=iter(micro_batches), model=[gpt],
               num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b,
               forward_only=forward_only, pg_collection=ctx.pg, **extra)


def last_stage_metrics(out: list[dict], ctx: ParallelContext,
                       combine: Callable[[list[dict]], dict]) -> dict:
    """Combine the last stage's per-micro-batch metrics with ``combine`` and broadcast the result
    to every pipeline stage, so that all ranks log and agree on the same numbers."""
    import torch.distributed as dist

    combined = combine(out) if out else {}
    if ctx.pp == 1:
        return combined
    last = dist.get_global_rank(ctx.pp_group, ctx.pp - 1)
    holder = [sorted(combined)]
    dist.broadcast_object_list(holder, src=last, group=ctx.pp_group)
    keys = holder[0]
    values = (torch.stack([combined[k].detach().double().reshape(()) for k in keys]) if combined
              else torch.zeros(len(keys), dtype=torch.float64))
    dist.broadcast(values, src=last, group=ctx.pp_group)
    return dict(zip(keys, values))
