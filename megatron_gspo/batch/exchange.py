"""Packing's exchange of rows between data-parallel ranks."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_gspo.batch.packing import StepPlan
from megatron_gspo.batch.rollout_batch import RolloutBatch
from moe.records import RoutingRecord


# The batch's per-row fields that travel with a row ([B, S] or [B]; exchanged as float32, which
# holds their values exactly: 0/1 masks, log-probs, advantages, rewards and counts).
ROW_FIELDS = ("mask_BS", "engine_logp_BS", "advantages_B", "rewards_B", "lengths_B",
              "informative_B", "prompt_lengths_B")


def exchange_rows(batch: RolloutBatch, plan: StepPlan, lengths: Sequence[Sequence[int]], ctx, *,
                  num_experts: int = 0) -> RolloutBatch:
    """This rank's rows of ``plan`` (from every data-parallel rank that generated them), in the
    plan's order: three all-to-alls over the data-parallel group on the run's device (token ids;
    the ``ROW_FIELDS`` values; routes when the batch has them), each rank sending only the rows another needs.
    ``lengths[r][j]``: every rank's fed tokens per row (gathered for the plan). The padded
    width is the same on every rank (``row_width``)."""
    me, ranks, device = ctx.dp_rank, ctx.dp, ctx.device
    width = batch.width
    wanted = [plan.rows_of(r) for r in range(ranks)]  # every rank's rows, in its order
    send = [[j for (src, j) in wanted[dst] if src == me] for dst in range(ranks)]
    recv = [[row for row in wanted[me] if row[0] == src] for src in range(ranks)]

    def exchange(rows_out: list, rows_in: list, pack, unit, dtype, inner=()):
        """``pack(rows)``: the rows' values, concatenated along dim 0."""
        out_sizes = [sum(unit(me, j) for j in rows) for rows in rows_out]
        in_sizes = [sum(unit(src, j) for _, j in rows) for src, rows in enumerate(rows_in)]
        flat_out = (pack([j for rows in rows_out for j in rows]) if any(rows_out)
                    else torch.zeros((0, *inner), dtype=dtype))
        buf_in = torch.empty((sum(in_sizes), *inner), dtype=dtype, device=device)
        dist.all_to_all_single(buf_in, flat_out.to(device=device, dtype=dtype).contiguous(),
                               output_split_sizes=in_sizes, input_split_sizes=out_sizes,
                               group=ctx.dp_group)
        return buf_in.cpu()

    def rows_of(table: torch.Tensor):  # fixed-size rows: one gather of the whole batch's table
        return lambda js: table.index_select(0, torch.tensor(js, dtype=torch.long))

    one = (lambda src, j: 1)
    ids = exchange(send, recv, rows_of(batch.tokens_BS1), one, torch.int64, (width + 1,))
    fields = [name for name in ROW_FIELDS if getattr(batch, name) is not None]
    columns = [getattr(batch, name).float().reshape(batch.rows, -1) for name in fields]
    floats = torch.cat(columns, 1)  # every field of a row, in one float32 row
    vals = exchange(send, recv, rows_of(floats), one, torch.float32, (floats.shape[1],))
    routes = None
    if batch.routes is not None:
        layers, top_k = batch.routes[0].experts_TLK.shape[1:]
        got = exchange(send, recv,
                       lambda js: torch.cat([batch.routes[j].indices()[:int(batch.lengths_B[j])]
                                             .to(torch.int32) for j in js]),
                       lambda src, j: int(lengths[src][j]), torch.int32, (layers, top_k))
    # Received rows arrive grouped by source; put them in the plan's order.
    position, at = {}, 0
    for src, rows in enumerate(recv):
        for row in rows:
            position[row] = at
            at += 1
    order = torch.tensor([position[row] for row in wanted[me]], dtype=torch.long)
    ids, vals = ids[order], vals[order]
    if batch.routes is not None:
        starts, at = {}, 0
        for src, rows in enumerate(recv):
            for row in rows:
                starts[row] = at
                at += int(lengths[src][row[1]])
        routes = [RoutingRecord.from_indices(got[starts[row]:starts[row] + int(lengths[row[0]][row[1]])]
                                             .long(), num_experts) for row in wanted[me]]
    received, at = {}, 0
    for name, column in zip(fields, columns):
        part = vals[:, at:at + column.shape[1]]
        at += column.shape[1]
        like = getattr(batch, name)
        received[name] = (part if like.dim() == 2 else part[:, 0]).to(like.dtype).contiguous()
    return dataclasses.replace(batch, tokens_BS1=ids, **received, routes=routes,
                               origin=list(wanted[me]))
