"""Pipeline-aware forward (and backward) of a GPTModel over micro-batches.

Every layout goes through Megatron's ``get_forward_backward_func``, so the same call runs without
pipelining and with 1F1B pipeline schedules. Under context parallelism each rank feeds its zigzag
share of every micro-batch (``MicroBatch.for_cp_rank``) and the loss function sees that share.
Shapes: ``B`` micro-batch size, ``S`` sequence length, ``C`` tokens this CP rank holds of a row.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from megatron_gspo import comm
from megatron_gspo.parallel import ParallelContext
from megatron_gspo.seqshard import packed_zigzag_index, zigzag_index

@dataclass
class PackedRows(PackedSeqParams):
    """Megatron's packed-sequence parameters, plus the sequence bounds on the host and a cache
    that the attention layers of one forward share (``layers.bucket_plan``).

    Shared prompts (``prefix_of``: each sequence's prefix sequence, -1 for none): a sequence
    with a prefix attends to it as to its own first tokens and its positions continue the
    prefix's. RoPE reads those positions from ``cu_seqlens_q.packed_positions`` (a [T] tensor on
    the device, set here: Megatron's attention hands RoPE only ``cu_seqlens``); only this
    project's SDPA attention and cached RoPE honour them (``layers``)."""

    bounds: tuple = ()
    cache: dict = dataclasses.field(default_factory=dict)
    prefix_of: tuple = ()

    def __post_init__(self):
        if any(p >= 0 for p in self.prefix_of):
            self.cu_seqlens_q.packed_positions = packed_positions(self.bounds, self.prefix_of).to(
                self.cu_seqlens_q.device)


def packed_positions(bounds, prefix_of) -> torch.Tensor:
    """[T] position of each token of a packed row: from 0 in each sequence, continuing its
    shared prefix's (``PackedRows``)."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat([torch.arange(n) + (lengths[p] if p >= 0 else 0)
                      for n, p in zip(lengths, prefix_of)])


# Per-token fields of a micro-batch ([B, S]); context parallelism splits each of them.
_TOKEN_FIELDS = ("tokens_BS", "targets_BS", "position_ids_BS", "old_logp_BS", "loss_mask_BS",
                 "ref_logp_BS", "seq_BS")


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
    # Packed sequences (B = 1, THD): cumulative sequence lengths of the whole row (also on a
    # context-parallel share, as Megatron's attention and RoPE expect them), and each token's
    # sequence (segment) index; ``advantages_B`` then holds one value per segment (or per token).
    cu_seqlens: Optional[torch.Tensor] = None
    seq_BS: Optional[torch.Tensor] = None
    # Shared prompts of a packed row: each segment's prefix segment, -1 for none
    # (``rl_batch.Layout``); None when no segment has one.
    prefix_of: Optional[tuple] = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_seqs(self) -> int:
        """Sequences of the loss: rows, or the segments of a packed row."""
        return len(self.cu_seqlens) - 1 if self.packed else self.tokens_BS.shape[0]

    def response_counts(self) -> torch.Tensor:
        """[sequences] response tokens of each sequence (of this share of it, under CP)."""
        if not self.packed:
            return self.loss_mask_BS.sum(1)
        out = torch.zeros(self.num_seqs, dtype=self.loss_mask_BS.dtype,
                          device=self.loss_mask_BS.device)
        return out.index_add(0, self.seq_BS.reshape(-1), self.loss_mask_BS.reshape(-1))

    def packed_seq_params(self, device: Optional[torch.device] = None):
        """Megatron's THD parameters of a packed row, made from the host copy of ``cu_seqlens``
        (call before ``to(device)``): the sequence bounds travel with them as Python ints, so
        that no layer reads them back from the device."""
        if self.cu_seqlens is None:
            return None
        bounds = tuple(self.cu_seqlens.tolist())
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        prefix_of = self.prefix_of or (-1,) * len(lengths)
        # a sequence with a shared prefix spans both (its keys, and its RoPE positions)
        longest = max(n + (lengths[p] if p >= 0 else 0) for n, p in zip(lengths, prefix_of))
        cu = self.cu_seqlens.to(device=device, dtype=torch.int32)
        return PackedRows(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=longest, max_seqlen_kv=longest, bounds=bounds,
                          prefix_of=prefix_of)

    def positions(self) -> torch.Tensor:
        if self.position_ids_BS is not None:
            return self.position_ids_BS
        b, s = self.tokens_BS.shape
        return torch.arange(s, device=self.tokens_BS.device).expand(b, s)

    def cp_index(self, cp: int, rank: int) -> torch.Tensor:
        """[C] positions of the row that context-parallel rank ``rank`` holds: Megatron's zigzag
        (chunks r and 2cp-1-r of 2cp), per sequence for a packed row."""
        if self.cu_seqlens is not None:
            return packed_zigzag_index(self.cu_seqlens.long(), cp, rank)
        return zigzag_index(self.tokens_BS.shape[1], cp, rank)

    def for_cp_rank(self, cp: int, rank: int) -> "MicroBatch":
        """This rank's share: every per-token field at ``cp_index`` (position ids made explicit,
        so that they stay global); per-row fields and ``cu_seqlens`` unchanged."""
        if cp == 1:
            return self
        if self.prefix_of is not None:
            raise ValueError("shared prompts cannot be split over context-parallel ranks")
        index = self.cp_index(cp, rank)
        fields = {name: getattr(self, name) for name in _TOKEN_FIELDS}
        fields["position_ids_BS"] = self.positions()
        sliced = {k: None if v is None else v[:, index] for k, v in fields.items()}
        adv = self.advantages_B
        if adv is not None and adv.dim() == 2:  # per-token advantages
            adv = adv[:, index]
        return dataclasses.replace(self, **sliced, advantages_B=adv)

    def to(self, device: torch.device) -> "MicroBatch":
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
            if torch.is_tensor(getattr(self, f.name))})


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
