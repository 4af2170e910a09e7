"""Micro-batches: what one forward of the model feeds and what its loss reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_gspo.batch.layout import Layout
from megatron_gspo.batch.rollout_batch import RolloutBatch
from megatron_gspo.distributed.seqshard import (packed_zigzag_index, zigzag_index)
from moe.records import padded_routes, rank_targets


def micro_batch(batch: RolloutBatch, layout: Layout, pad_id: int) -> MicroBatch:
    """A micro-batch with what the passes and losses need, from the batch's rows. Rows whose
    behaviour log-probs are pending (``batch.pending_B``) give a micro-batch without them
    (``old_logp_BS`` None: only an on-policy update, which makes its own, may take it)."""
    pending = batch.pending_B is not None and bool(batch.pending_B[list(layout.rows)].any())
    if pending and not bool(batch.pending_B[list(layout.rows)].all()):
        raise ValueError("a micro-batch mixes rows whose behaviour log-probs are pending with "
                         "rows whose are known")
    old = None if batch.old_logp_BS is None or pending else layout.gather(batch.old_logp_BS)
    ref = None if batch.ref_logp_BS is None else layout.gather(batch.ref_logp_BS)
    if not layout.packed:
        rows = torch.tensor(layout.rows, dtype=torch.long)
        t = batch.tokens_BS1[rows]
        return MicroBatch(t[:, :-1], t[:, 1:], old_logp_BS=old, loss_mask_BS=batch.mask_BS[rows],
                          advantages_B=batch.advantages_B[rows], ref_logp_BS=ref)
    inputs = layout.gather(batch.tokens_BS1[:, :-1], fill=pad_id)
    targets = layout.gather(batch.tokens_BS1[:, 1:], fill=pad_id)
    adv = batch.advantages_B
    if adv.dim() == 2:  # per-token advantages (token-level rollout correction)
        adv = layout.gather(adv)
    else:  # one per segment; shared prefixes and the padding segment get 0
        rows = torch.tensor(layout.segment_rows, dtype=torch.long)
        adv = torch.where(rows >= 0, batch.advantages_B[rows.clamp(min=0)], 0.0).to(adv.dtype)
    return MicroBatch(inputs, targets, position_ids_BS=layout.pos_N[None].clone(),
                      old_logp_BS=old, loss_mask_BS=layout.gather(batch.mask_BS),
                      advantages_B=adv, ref_logp_BS=ref, cu_seqlens=layout.cu_seqlens,
                      seq_BS=layout.segment_N()[None],
                      prefix_of=layout.prefix_of if layout.shares_prompts else None)


def route_targets(batch: RolloutBatch, layout: Layout, *, layers, ctx) -> list:
    """The engine's routes of one micro-batch as this rank's routers see them (per local MoE
    layer, [N, K] in Megatron's [s, b] order): R3 targets and rollout/train drift."""
    lengths = [int(batch.lengths_B[i]) for i in layout.rows]
    records = [batch.routes[i] for i in layout.rows]
    if not layout.packed:
        routes = padded_routes(records, lengths, batch.width)
        return router_view(routes, layers, ctx)
    routes = padded_routes([batch.routes[0]], [0], layout.row_N.numel())  # fill routes
    if records:  # each real token's route: its row's at its position
        per_row = padded_routes(records, lengths, batch.width)
        local = torch.full((batch.rows,), -1, dtype=torch.long)
        local[torch.tensor(layout.rows, dtype=torch.long)] = torch.arange(len(layout.rows))
        v = layout.valid_N
        routes[0, v] = per_row[local[layout.row_N[v]], layout.pos_N[v]]
    return router_view(routes, layers, ctx, layout=layout)


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


def router_view(x_BSLK: torch.Tensor, layers, ctx, layout: Optional[Layout] = None) -> list:
    """Per-token values of whole rows ([B, S, L, K]; a packed row [1, N, L, K] with its
    ``layout``) as this rank's routers see them: its context-parallel zigzag share (per sequence
    when packed), then its sequence-parallel slice, per local MoE layer [N, K] in Megatron's
    [s, b] order."""
    if layout is not None and layout.packed and ctx.cp > 1:
        index = packed_zigzag_index(layout.cu_seqlens.long(), ctx.cp, ctx.cp_rank)
    else:
        index = zigzag_index(x_BSLK.shape[1], ctx.cp, ctx.cp_rank)
    return rank_targets(x_BSLK, layers=layers, cp=ctx.cp, cp_rank=ctx.cp_rank, cp_index=index,
                        tp=ctx.tp, tp_rank=ctx.tp_rank, sequence_parallel=ctx.sequence_parallel)


@dataclass
class PackedRows(PackedSeqParams):
    """Megatron's packed-sequence parameters, plus the sequence bounds on the host and a cache
    that the attention layers of one forward share (``layers.bucket_plan``).

    Shared prompts (``prefix_of``: each sequence's prefix sequence, -1 for none): a sequence
    with a prefix attends to it as to its own first tokens and its positions continue the
    prefix's. RoPE reads those positions from ``cu_seqlens_q.packed_positions`` (a [T] tensor on
    the device, set here: Megatron's attention hands RoPE only ``cu_seqlens``), and the bounds
    from ``packed_bounds`` on both ``cu_seqlens`` (host ints, so that it never reads the device);
    only this project's SDPA attention and cached RoPE honour them (``layers``)."""

    bounds: tuple = ()
    cache: dict = dataclasses.field(default_factory=dict)
    prefix_of: tuple = ()

    def __post_init__(self):
        for cu in (self.cu_seqlens_q, self.cu_seqlens_kv):  # RoPE's bounds without a read
            if cu is not None and self.bounds:
                cu.packed_bounds = self.bounds
        if any(p >= 0 for p in self.prefix_of):
            self.cu_seqlens_q.packed_positions = packed_positions(self.bounds, self.prefix_of).to(
                self.cu_seqlens_q.device)


def packed_positions(bounds, prefix_of) -> torch.Tensor:
    """[T] position of each token of a packed row: from 0 in each sequence, continuing its
    shared prefix's (``PackedRows``)."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat([torch.arange(n) + (lengths[p] if p >= 0 else 0)
                      for n, p in zip(lengths, prefix_of)])


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


# Per-token fields of a micro-batch ([B, S]); context parallelism splits each of them.
_TOKEN_FIELDS = ("tokens_BS", "targets_BS", "position_ids_BS", "old_logp_BS", "loss_mask_BS",
                 "ref_logp_BS", "seq_BS")
