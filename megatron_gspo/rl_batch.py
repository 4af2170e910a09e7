"""From generated samples to the trainer's batch: padded rows, response masks, advantages, the
engine's log-probs and routes, cut into mini-batches and micro-batches.

Legend: ``B`` rows on this data-parallel rank (prompts x group), ``S`` padded row width (tokens fed
to the model; targets are the next tokens), ``L`` MoE layers, ``K`` top-k, ``N`` router tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_gspo import comm
from megatron_gspo.forward import MicroBatch
from megatron_gspo.rollout.types import Sample
from megatron_gspo.seqshard import zigzag_index
from moe.records import RoutingRecord, padded_routes, rank_targets


@dataclass
class RolloutBatch:
    """This rank's responses of one step, as right-padded rows of prompt + response."""

    tokens_BS1: torch.Tensor  # [B, S + 1] token ids (inputs [:, :-1], targets [:, 1:])
    mask_BS: torch.Tensor  # [B, S] 1.0 where the target is a response token
    engine_logp_BS: torch.Tensor  # [B, S] the engine's log-probs at response targets, else 0
    advantages_B: torch.Tensor
    rewards_B: torch.Tensor
    lengths_B: torch.Tensor  # tokens fed per row (prompt + response - 1)
    routes: Optional[list] = None  # per row, moe.records.RoutingRecord of the engine (or None)
    old_logp_BS: Optional[torch.Tensor] = None  # behaviour log-probs, filled before the updates
    ref_logp_BS: Optional[torch.Tensor] = None  # reference policy (KL term)
    recomputed_logp_BS: Optional[torch.Tensor] = None  # the trainer's pass on the old policy

    @property
    def rows(self) -> int:
        return self.tokens_BS1.shape[0]

    @property
    def width(self) -> int:
        return self.tokens_BS1.shape[1] - 1

    def num_response_tokens(self) -> int:
        return int(self.mask_BS.sum())


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (sequence lengths under sequence
    parallelism, which splits the sequence over the TP ranks)."""
    return -(-n // multiple) * multiple


def width_multiple(ctx) -> int:
    """What a row width must divide by: 2 x cp zigzag chunks under context parallelism, times
    the TP size under sequence parallelism (which splits each rank's share again)."""
    return (2 * ctx.cp if ctx.cp > 1 else 1) * (ctx.tp if ctx.sequence_parallel else 1)


def row_width(samples: Sequence[Sample], *, device: torch.device, multiple_of: int = 1,
              group=None) -> int:
    """Tokens fed per row: the widest prompt + response - 1 over every rank (one all-reduce), so
    that each rank pads its rows the same way, rounded up to ``multiple_of``."""
    widest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return round_up(comm.reduce_max_int(widest, device=device, group=group) - 1, multiple_of)


def build_batch(samples: Sequence[Sample], rewards_B: torch.Tensor, advantages_B: torch.Tensor, *,
                width: int, pad_id: int, num_experts: int = 0) -> RolloutBatch:
    """Pad ``samples`` to ``width`` fed tokens; a response of R tokens after a prompt of P has its
    targets at positions P-1 .. P+R-2."""
    b = len(samples)
    tokens = torch.full((b, width + 1), pad_id, dtype=torch.long)
    mask = torch.zeros(b, width)
    engine_logp = torch.zeros(b, width)
    lengths = torch.zeros(b, dtype=torch.long)
    routes = [] if samples and samples[0].routes_TLK is not None else None
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p + r > width + 1:
            raise ValueError(f"sample {i} has {p + r} tokens, the batch is {width + 1} wide")
        tokens[i, :p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids))
        mask[i, p - 1:p - 1 + r] = 1.0
        engine_logp[i, p - 1:p - 1 + r] = s.logprobs_R.float()
        lengths[i] = p + r - 1
        if routes is not None:
            routes.append(RoutingRecord.from_indices(s.routes_TLK, num_experts))
    return RolloutBatch(tokens, mask, engine_logp, advantages_B.float(), rewards_B.float(), lengths,
                        routes)


def micro_batches(batch: RolloutBatch, rows: Sequence[int], size: int) -> list[MicroBatch]:
    """``rows`` of the batch as micro-batches of ``size`` rows, with what the losses need."""
    out = []
    for start in range(0, len(rows), size):
        idx = torch.tensor(list(rows[start:start + size]))
        t = batch.tokens_BS1[idx]
        out.append(MicroBatch(
            t[:, :-1], t[:, 1:],
            old_logp_BS=None if batch.old_logp_BS is None else batch.old_logp_BS[idx],
            loss_mask_BS=batch.mask_BS[idx], advantages_B=batch.advantages_B[idx]))
    return out


def minibatch_rows(num_rows: int, minibatches: int) -> list[list[int]]:
    """The rows of each mini-batch (one optimizer update each): every ``minibatches``-th row, so
    that a mini-batch holds the same responses on any data-parallel split of the batch (each rank
    holds a contiguous block of rows)."""
    return [list(range(k, num_rows, minibatches)) for k in range(minibatches)]


def update_order(num_rows: int, minibatches: int) -> list[int]:
    """Rows in the order the updates consume them (mini-batch after mini-batch): the old-policy
    pass runs its micro-batches in this order, so that its k-th micro-batch is the k-th of the
    updates (R2 replays its routes there)."""
    return [r for rows in minibatch_rows(num_rows, minibatches) for r in rows]


def router_view(x_BSLK: torch.Tensor, layers, ctx) -> list:
    """Per-token values of whole rows ([B, S, L, K]) as this rank's routers see them: its
    context-parallel zigzag share, then its sequence-parallel slice, per local MoE layer [N, K]
    in Megatron's [s, b] order."""
    return rank_targets(x_BSLK, layers=layers, cp=ctx.cp, cp_rank=ctx.cp_rank,
                        cp_index=zigzag_index(x_BSLK.shape[1], ctx.cp, ctx.cp_rank),
                        tp=ctx.tp, tp_rank=ctx.tp_rank, sequence_parallel=ctx.sequence_parallel)


def engine_route_targets(batch: RolloutBatch, rows: Sequence[int], size: int, *, layers, ctx
                         ) -> list:
    """The engine's routes of ``rows``, per micro-batch and local MoE layer, as this rank's routers
    see them ([N, K] in Megatron's [s, b] order): R3 targets and rollout/train drift."""
    out = []
    for start in range(0, len(rows), size):
        part = list(rows[start:start + size])
        routes = padded_routes([batch.routes[i] for i in part],
                               [int(batch.lengths_B[i]) for i in part], batch.width)
        out.append(router_view(routes, layers, ctx))
    return out
