"""Layouts: which rows of the batch a micro-batch feeds, as padded rows or packed back to back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from megatron_gspo.batch.packing import StepPlan, minibatch_rows, round_up, unit_cost, units_of
from megatron_gspo.batch.rollout_batch import RolloutBatch
from megatron_gspo.distributed.seqshard import (seq_index_from_cu_seqlens)


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
