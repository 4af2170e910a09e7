"""From generated samples to the trainer's batch: padded rows, response masks, advantages, the
engine's log-probs and routes, cut into mini-batches and micro-batches.

The batch itself stays in padded rows on the host (every per-token value of the step, whatever
the layout of the passes, lives at ``[row, position]``). A ``Layout`` says which rows one
micro-batch feeds and how: as padded rows ``[B, S]``, or packed back to back in one THD row
``[1, N]`` (``trainer.packing``). Micro-batches are built from their layout (``micro_batch``),
values computed per micro-batch go back to the batch through it (``Layout.scatter``), and with
packing the rows first move between data-parallel ranks (``exchange_rows``, after
``packing.plan_step``).

Legend: ``B`` rows on this data-parallel rank (prompts x group), ``S`` padded row width (tokens fed
to the model; targets are the next tokens), ``N`` tokens of a packed row, ``L`` MoE layers, ``K``
top-k.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_gspo import comm
from megatron_gspo.forward import MicroBatch
from megatron_gspo.packing import StepPlan, minibatch_rows, round_up, unit_cost, units_of
from megatron_gspo.rollout.types import Sample
from megatron_gspo.seqshard import packed_zigzag_index, seq_index_from_cu_seqlens, zigzag_index
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
    prompt_lengths_B: torch.Tensor  # prompt tokens per row
    routes: Optional[list] = None  # per row, moe.records.RoutingRecord of the engine (or None)
    # Behaviour log-probs: filled before the updates, but for the first mini-batch's rows when
    # ``first_minibatch_pending`` (NaN until its update, on the old policy, fills them).
    old_logp_BS: Optional[torch.Tensor] = None
    first_minibatch_pending: bool = False
    ref_logp_BS: Optional[torch.Tensor] = None  # reference policy (KL term)
    # The trainer's log-probs on the old policy: its pass's (NaN on the rows the pass skips
    # until their update's forward fills them in); None without a pass or such a forward.
    recomputed_logp_BS: Optional[torch.Tensor] = None
    # The rows that have them (None: every row). With engine behaviour log-probs and no pass,
    # only the first mini-batch's, from its update's forward.
    recomputed_rows_B: Optional[torch.Tensor] = None
    informative_B: Optional[torch.Tensor] = None  # 1.0 where the row's group rewards differ
    # Micro-batches of each mini-batch (None: padded rows, ``padded_layouts``).
    layouts: Optional[list] = None
    # The batch's rows by where the rollout put them ((dp rank, index)); after a packing exchange
    # they come from several ranks.
    origin: Optional[list] = None

    @property
    def rows(self) -> int:
        return self.tokens_BS1.shape[0]

    @property
    def width(self) -> int:
        return self.tokens_BS1.shape[1] - 1

    def num_response_tokens(self) -> int:
        return int(self.mask_BS.sum())

    def logprob_mismatch(self) -> tuple:
        """(sum of |engine - trainer| log-prob, tokens compared) over the response tokens whose
        rows have trainer log-probs (``recomputed_rows_B``); (0, 0) without any. A non-finite
        trainer log-prob in those rows makes the sum so."""
        if self.recomputed_logp_BS is None:
            return 0.0, 0.0
        compared = self.mask_BS > 0
        if self.recomputed_rows_B is not None:
            compared = compared & self.recomputed_rows_B[:, None]
        diff = torch.where(compared, self.engine_logp_BS - self.recomputed_logp_BS, 0.0)
        return float(diff.abs().sum()), float(compared.sum())


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
    rows, log_probs = [], []
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p + r > width + 1:
            raise ValueError(f"sample {i} has {p + r} tokens, the batch is {width + 1} wide")
        if p == 0:
            raise ValueError(f"sample {i} has an empty prompt (a response needs a token before it)")
        if len(s.logprobs_R) != r:
            raise ValueError(f"sample {i} has {r} response tokens and {len(s.logprobs_R)} "
                             "log-probs")
        rows.append([*s.prompt_ids, *s.response_ids, *[pad_id] * (width + 1 - p - r)])
        log_probs.append(s.logprobs_R.float().reshape(-1))
    tokens = torch.tensor(rows, dtype=torch.long).reshape(b, width + 1)
    prompt_lengths = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
    response_lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
    lengths = prompt_lengths + response_lengths - 1
    # a response's targets: positions P-1 .. P+R-2, row by row in order (as the log-probs come)
    first = (prompt_lengths - 1)[:, None]
    position = torch.arange(width)[None, :]
    targets = (position >= first) & (position < first + response_lengths[:, None])
    mask = torch.zeros(b, width)
    mask[targets] = 1.0
    engine_logp = torch.zeros(b, width)
    if log_probs:
        engine_logp[targets] = torch.cat(log_probs)
    routes = ([RoutingRecord.from_indices(s.routes_TLK, num_experts) for s in samples]
              if samples and samples[0].routes_TLK is not None else None)
    return RolloutBatch(tokens, mask, engine_logp, advantages_B.float(), rewards_B.float(), lengths,
                        prompt_lengths, routes)


def prompt_shares(batch: RolloutBatch) -> list:
    """Per row ``(key, n)`` for ``packing.plan_step``: rows with equal keys hold the same prompt
    and may feed its first ``n`` = prompt - 1 tokens once (the last prompt token stays in each
    row's own segment: it predicts the row's first response token). The key is the first row
    with the same prompt tokens and, when the batch has the engine's routes (R3, drift), the
    same routes on those ``n`` tokens: a shared token has one route."""
    keys, out = {}, []
    for i in range(batch.rows):
        n = int(batch.prompt_lengths_B[i]) - 1
        key = (tuple(batch.tokens_BS1[i, :n + 1].tolist()),
               None if batch.routes is None else batch.routes[i].indices()[:n].numpy().tobytes())
        out.append((keys.setdefault(key, i), n))
    return out


# ---------------------------------------------------------------------------------------------
# Layouts: which rows a micro-batch feeds, padded or packed.
# ---------------------------------------------------------------------------------------------

class _Segment(NamedTuple):
    """One segment of a packed row: tokens from ``row``'s position ``first`` on (``real`` of
    them, the rest padding), attending to segment ``prefix`` first (-1: none); ``owner``: the row
    whose sequence it is (-1: a shared prefix or the padding)."""

    row: int
    first: int
    tokens: int
    real: int
    prefix: int = -1
    owner: int = -1


@dataclass(frozen=True)
class Layout:
    """One micro-batch's rows of the batch. Padded: ``[len(rows), S]``. Packed: one row of
    ``N`` tokens, row ``rows[i]``'s fed tokens in a segment of its own (rounded up to
    ``seq_multiple`` with padding), a trailing padding segment making ``N`` a multiple of
    ``row_multiple``; ``row_N`` / ``pos_N`` name each token's source (row -1: the padding
    segment).

    Shared prompts: consecutive rows of one unit (equal ``prefixes`` keys, two rows or more)
    feed their first ``n`` tokens once, as a prefix segment (taken from the unit's first row);
    each row's segment then holds its tokens from position ``n`` on and attends to the prefix
    (``prefix_of``), as if the prefix were its own first tokens. ``segment_rows`` names each
    segment's row (-1: a prefix or the padding)."""

    rows: tuple
    cu_seqlens: Optional[torch.Tensor] = None  # packed only, int32 [segments + 1]
    row_N: Optional[torch.Tensor] = None
    pos_N: Optional[torch.Tensor] = None
    valid_N: Optional[torch.Tensor] = None  # a real token of a row (not padding)
    segment_rows: tuple = ()  # packed: each segment's row, -1 for a shared prefix or padding
    prefix_of: tuple = ()  # packed: each segment's shared-prefix segment, -1 for none

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def shares_prompts(self) -> bool:
        return any(p >= 0 for p in self.prefix_of)

    @staticmethod
    def packed_rows(rows: Sequence[int], lengths: Sequence[int], *, seq_multiple: int = 1,
                    row_multiple: int = 1, length: int = 0, prefixes=None) -> "Layout":
        """``rows`` (fed tokens ``lengths[i]`` each) packed; no rows: one padding segment. The
        padding segment makes the row at least ``length`` tokens long. ``prefixes[i] = (key,
        n)``: consecutive rows of equal keys share their first ``n`` fed tokens."""
        segments: list[_Segment] = []
        i = 0
        while i < len(rows):
            end = i + 1
            while prefixes is not None and end < len(rows) and prefixes[end][0] == prefixes[i][0]:
                end += 1
            n = prefixes[i][1] if prefixes is not None and end - i > 1 else 0
            if n > 0:
                if seq_multiple != 1:
                    raise ValueError("shared prompts need seq_multiple 1 (no context parallelism)")
                segments.append(_Segment(rows[i], 0, n, n))  # the prefix, from the first row
                prefix = len(segments) - 1
                segments += [_Segment(rows[t], n, lengths[t] - n, lengths[t] - n, prefix, rows[t])
                             for t in range(i, end)]
            else:
                segments += [_Segment(rows[t], 0, round_up(lengths[t], seq_multiple), lengths[t],
                                      -1, rows[t]) for t in range(i, end)]
            i = end
        total = sum(seg.tokens for seg in segments)
        pad = round_up(max(total, length, 1), row_multiple) - total
        if pad:
            segments.append(_Segment(-1, 0, pad, 0))
        # per token: its segment's row, first position and real count, by whole-row operations
        tokens, row, first, real = torch.tensor(
            [(seg.tokens, seg.row, seg.first, seg.real) for seg in segments],
            dtype=torch.long).unbind(1)
        start = tokens.cumsum(0) - tokens
        local_N = torch.arange(int(tokens.sum())) - start.repeat_interleave(tokens)
        row_N = row.repeat_interleave(tokens)
        pos_N = first.repeat_interleave(tokens) + local_N
        valid_N = local_N < real.repeat_interleave(tokens)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), tokens]).cumsum(0).to(torch.int32)
        return Layout(tuple(rows), cu, row_N, pos_N, valid_N,
                      segment_rows=tuple(seg.owner for seg in segments),
                      prefix_of=tuple(seg.prefix for seg in segments))

    @staticmethod
    def concat(layouts: Sequence["Layout"]) -> "Layout":
        """Packed layouts back to back as one packed row: each keeps its segments, shared
        prefixes and padding (so the row's length stays a multiple of ``row_multiple``)."""
        if len(layouts) == 1:
            return layouts[0]
        cu, prefix_of, tokens, segments = [layouts[0].cu_seqlens[:1]], [], 0, 0
        for layout in layouts:
            cu.append(layout.cu_seqlens[1:] + tokens)
            prefix_of += [p + segments if p >= 0 else -1 for p in layout.prefix_of]
            tokens += int(layout.cu_seqlens[-1])
            segments += layout.num_segments
        cat = lambda name: torch.cat([getattr(layout, name) for layout in layouts])  # noqa: E731
        return Layout(sum((layout.rows for layout in layouts), ()), torch.cat(cu), cat("row_N"),
                      cat("pos_N"), cat("valid_N"),
                      segment_rows=sum((layout.segment_rows for layout in layouts), ()),
                      prefix_of=tuple(prefix_of))

    @property
    def num_segments(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens of the packed row (padding included)."""
        return int(self.cu_seqlens[-1])

    def segment_N(self) -> torch.Tensor:
        return seq_index_from_cu_seqlens(self.cu_seqlens.long())

    def gather(self, values_BS: torch.Tensor, fill=0) -> torch.Tensor:
        """The micro-batch's share of a per-token batch tensor: [len(rows), S] or [1, N]."""
        if not self.packed:
            return values_BS[torch.tensor(self.rows, dtype=torch.long)]
        width = values_BS.shape[1]
        out = values_BS[self.row_N.clamp(min=0), self.pos_N.clamp(max=width - 1)]
        return torch.where(self.valid_N, out, torch.full_like(out, fill))[None]

    def scatter(self, out_BS: torch.Tensor, values: torch.Tensor) -> None:
        """Write the micro-batch's per-token ``values`` (as ``gather`` returns them) back."""
        if not self.packed:
            out_BS[torch.tensor(self.rows, dtype=torch.long)] = values.to(out_BS.dtype)
            return
        v = self.valid_N
        out_BS[self.row_N[v], self.pos_N[v]] = values[0, v].to(out_BS.dtype)

    def fed_tokens(self, lengths_B: torch.Tensor) -> int:
        """Real tokens the micro-batch feeds (padding left out; a shared prefix once)."""
        if self.packed:
            return int(self.valid_N.sum())
        return int(lengths_B[torch.tensor(self.rows, dtype=torch.long)].sum())

    def valid(self, lengths_B: torch.Tensor, width: int) -> torch.Tensor:
        """[len(rows), S] or [1, N]: True on the real tokens."""
        if self.packed:
            return self.valid_N[None]
        rows = torch.tensor(self.rows, dtype=torch.long)
        return torch.arange(width)[None] < lengths_B[rows, None]


def padded_layouts(num_rows: int, minibatches: int, size: int, group_size: int = 0
                   ) -> list[list[Layout]]:
    """Padded micro-batches of ``size`` rows of each mini-batch (``packing.minibatch_rows``)."""
    return [[Layout(tuple(rows[i:i + size])) for i in range(0, len(rows), size)]
            for rows in minibatch_rows(num_rows, minibatches, group_size)]


def packed_layouts(plan: StepPlan, dp_rank: int, lengths: Sequence[Sequence[int]], *,
                   seq_multiple: int, row_multiple: int, across_ranks: bool = False,
                   same_length: bool = False, shares=None) -> list[list[Layout]]:
    """This rank's packed micro-batches of each mini-batch, its batch holding the plan's rows in
    the plan's order (``exchange_rows``); ``lengths[r][j]``: fed tokens of every rank's rows.
    ``across_ranks``: the k-th micro-batch of a mini-batch has one length on every
    data-parallel rank (expert parallelism's all-gather dispatcher exchanges equal token
    counts); ``same_length``: every micro-batch padded to the longest (pipeline stages exchange
    activations of one shape per pass)."""

    def natural(rows) -> int:
        total = sum(unit_cost(u, lengths, shares, seq_multiple) for u in units_of(rows, shares))
        return round_up(max(total, 1), row_multiple)

    target = [[natural(mb) for mb in per_k] for per_k in plan.micro[dp_rank]]
    if across_ranks:
        target = [[max(natural(plan.micro[r][k][i]) for r in range(len(plan.micro)))
                   for i in range(len(per_k))] for k, per_k in enumerate(target)]
    if same_length:
        longest = max(n for per_k in target for n in per_k)
        target = [[longest] * len(per_k) for per_k in target]
    out, start = [], 0
    for per_k, sizes in zip(plan.micro[dp_rank], target):
        layouts = []
        for rows, size in zip(per_k, sizes):
            local = list(range(start, start + len(rows)))
            prefixes = None if shares is None else [((src, shares[src][j][0]), shares[src][j][1])
                                                    for src, j in rows]
            layouts.append(Layout.packed_rows(local, [lengths[src][j] for src, j in rows],
                                              seq_multiple=seq_multiple,
                                              row_multiple=row_multiple, length=size,
                                              prefixes=prefixes))
            start += len(rows)
        out.append(layouts)
    return out


def forward_only_layouts(layouts: Sequence[Layout], budget: int, *, ep: int = 1, pp: int = 1
                         ) -> list[Layout]:
    """Packed micro-batches regrouped for a forward-only pass (log-probs; no routes recorded or
    replayed, which follow the updates' micro-batches): consecutive ones concatenated while the
    row stays within ``budget`` tokens, so the pass runs fewer, longer forwards (the updates'
    micro-batches are cut per mini-batch: four mini-batches of a 16 x 8 batch at 1-2k tokens
    each are four forwards, and on a small model each forward's cost is mostly per-operator, not
    per-token). Each rank regroups its own: only without expert parallelism (``ep``: its
    dispatch pairs micro-batches across ranks) or pipeline stages (``pp``: one shape per pass);
    otherwise, and for padded layouts, they stay as they are."""
    if ep > 1 or pp > 1 or not layouts or not all(layout.packed for layout in layouts):
        return list(layouts)
    groups, tokens = [[layouts[0]]], layouts[0].num_tokens  # tokens: the last group's
    for layout in layouts[1:]:
        if tokens + layout.num_tokens <= budget:
            groups[-1].append(layout)
            tokens += layout.num_tokens
        else:
            groups.append([layout])
            tokens = layout.num_tokens
    return [Layout.concat(group) for group in groups]


def layouts_of(batch: RolloutBatch, minibatches: int, size: int, group_size: int = 0
               ) -> list[list[Layout]]:
    if batch.layouts is not None:
        return batch.layouts
    return padded_layouts(batch.rows, minibatches, size, group_size)


def micro_batch(batch: RolloutBatch, layout: Layout, pad_id: int) -> MicroBatch:
    """A micro-batch with what the passes and losses need, from the batch's rows."""
    old = None if batch.old_logp_BS is None else layout.gather(batch.old_logp_BS)
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


# ---------------------------------------------------------------------------------------------
# Packing's exchange of rows between data-parallel ranks.
# ---------------------------------------------------------------------------------------------

def exchange_rows(batch: RolloutBatch, plan: StepPlan, lengths: Sequence[Sequence[int]], ctx, *,
                  num_experts: int = 0) -> RolloutBatch:
    """This rank's rows of ``plan`` (from every data-parallel rank that generated them), in the
    plan's order: three all-to-alls over the data-parallel group on the run's device (token ids;
    float values; routes when the batch has them), each rank sending only the rows another needs.
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
    has_info = batch.informative_B is not None
    scalars = [batch.advantages_B, batch.rewards_B, batch.lengths_B,
               batch.informative_B if has_info else torch.zeros(batch.rows),
               batch.prompt_lengths_B]  # [B, 2 * width + 5]: mask, engine log-probs, scalars
    floats = torch.cat([batch.mask_BS.float(), batch.engine_logp_BS.float(),
                        torch.stack([x.float() for x in scalars], 1)], 1)
    vals = exchange(send, recv, rows_of(floats), one, torch.float32, (2 * width + 5,))
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
    w = width
    return dataclasses.replace(
        batch, tokens_BS1=ids, mask_BS=vals[:, :w].contiguous(),
        engine_logp_BS=vals[:, w:2 * w].contiguous(), advantages_B=vals[:, 2 * w].contiguous(),
        rewards_B=vals[:, 2 * w + 1].contiguous(), lengths_B=vals[:, 2 * w + 2].long(),
        informative_B=vals[:, 2 * w + 3].contiguous() if has_info else None,
        prompt_lengths_B=vals[:, 2 * w + 4].long(), routes=routes,
        origin=list(wanted[me]))


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
