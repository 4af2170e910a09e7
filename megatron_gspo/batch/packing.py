"""Packing plan of an RL step: which rows each data-parallel rank trains, and how its rows of each
mini-batch are packed (THD) into micro-batches under a token budget. Pure functions of the rows'
lengths: every rank computes the same plan from the same all-gathered lengths, so no rank has to
tell another what it will do.

The plan keeps the padded mode's mini-batches (``minibatch_rows``: row ``j`` of every rank's
rollout batch belongs to mini-batch ``j mod M``, or with whole groups of G rows to ``(j // G) mod
M``), so packed and padded updates see the same responses. Within a mini-batch:

1. its rows (units, below) are split over the data-parallel ranks so that their token counts
   balance (sorted greedy: longest first, each to the rank with the fewest tokens so far;
   advantages are computed before, so a group may be split);
2. each rank's share is packed first-fit-decreasing into micro-batches of at most
   ``budget`` tokens (a longer row gets a micro-batch of its own);
3. every rank runs the same number of micro-batches (the largest count, so that expert-parallel
   all-to-alls pair up): a rank with fewer spreads its rows over that many, balanced, when they
   fit the budget, and otherwise adds empty (padding-only) micro-batches.

Costs are the tokens a row occupies once packed: its fed tokens rounded up to ``seq_multiple``
(2 x cp under context parallelism, each sequence split in 2 x cp zigzag chunks).

Shared prompts (``shares``): the rows of one rank and mini-batch that hold the same prompt are a
*unit*, planned and packed together; its rows feed the prompt's first tokens once (a prefix
segment the rows' segments attend to, ``rl_batch.Layout.packed_rows``), so the unit costs the
shared tokens once plus each row's rest. A unit over the token budget is cut into units that fit
it (each feeding the shared tokens once); units are never split further (over ranks or
micro-batches); without ``shares`` every row is a unit of its own.

Legend: ``R`` data-parallel ranks, ``M`` mini-batches. A row is named ``(rank, index)`` by where
the rollout put it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


Row = tuple[int, int]  # (data-parallel rank that generated it, its index there)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def minibatch_rows(num_rows: int, minibatches: int, group_size: int = 0) -> list[list[int]]:
    """The rows of a rank's batch in each mini-batch (one optimizer update each), a pure
    function of the row's index, so that a mini-batch holds the same responses on any
    data-parallel split of the batch (each rank holds a contiguous block of whole groups):

    - interleaved (``group_size`` 0): every ``minibatches``-th row, so each mini-batch holds
      G / ``minibatches`` rows of every prompt's G;
    - whole groups (``group_size`` G, ``algo.minibatch_split=groups``): the rows of every
      ``minibatches``-th group (as verl and slime split a batch), the split under which a
      group's prompt is fed once for all its rows (``trainer.share_prompts``)."""
    if group_size:
        return [[j for j in range(num_rows) if (j // group_size) % minibatches == k]
                for k in range(minibatches)]
    return [list(range(k, num_rows, minibatches)) for k in range(minibatches)]


def balanced_partition(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``costs`` in ``parts`` groups of balanced sums (longest-processing-time greedy:
    largest first, each to the group with the smallest sum, then fewest items, then lowest index).
    Each group lists its indices in increasing order."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = min(range(parts), key=lambda p: (sums[p], len(groups[p]), p))
        groups[g].append(i)
        sums[g] += costs[i]
    return [sorted(g) for g in groups]


def first_fit_bins(costs: Sequence[int], budget: int, row_multiple: int = 1) -> list[list[int]]:
    """Indices of ``costs`` in bins whose total, rounded up to ``row_multiple``, stays within
    ``budget`` (first fit, largest first); an item over the budget alone gets its own bin. Bins in
    order of creation, each listing its indices in increasing order."""
    bins: list[list[int]] = []
    sums: list[int] = []
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        for b in range(len(bins)):
            if round_up(sums[b] + costs[i], row_multiple) <= budget:
                bins[b].append(i)
                sums[b] += costs[i]
                break
        else:
            bins.append([i])
            sums.append(costs[i])
    return [sorted(b) for b in bins]


def micro_batch_bins(costs: Sequence[int], budget: int, count: int, row_multiple: int = 1
                     ) -> list[list[int]]:
    """Exactly ``count`` bins (``count`` >= the first-fit number): balanced over ``count`` when
    that respects the budget, else first fit plus empty bins."""
    fit = first_fit_bins(costs, budget, row_multiple)
    if len(fit) > count:
        raise ValueError(f"{len(fit)} bins needed, {count} allowed")
    spread = balanced_partition(costs, count)
    if all(round_up(sum(costs[i] for i in b), row_multiple) <= budget or len(b) <= 1
           for b in spread):
        return spread
    return fit + [[] for _ in range(count - len(fit))]


@dataclass(frozen=True)
class StepPlan:
    """What every data-parallel rank trains in one step.

    ``micro[r][k]`` lists rank ``r``'s micro-batches of mini-batch ``k``, each a list of rows; the
    rank's batch after the exchange holds its rows in that order (mini-batch after mini-batch,
    micro-batch after micro-batch), so each micro-batch is a contiguous run of its rows.
    """

    micro: tuple  # [R][M] -> list of micro-batches -> list of Row

    def rows_of(self, rank: int) -> list[Row]:
        return [row for per_k in self.micro[rank] for mb in per_k for row in mb]

    def micro_batch_sizes(self, rank: int) -> list[list[int]]:
        """[M] -> rows per micro-batch of ``rank``."""
        return [[len(mb) for mb in per_k] for per_k in self.micro[rank]]


def units_of(rows: Sequence[Row], shares=None) -> list[list[Row]]:
    """``rows`` grouped into units: the rows of one rank whose ``shares[r][j]`` keys are equal
    (in order of first appearance, each unit's rows in their order); singletons without
    ``shares`` and for rows that share no token (``n`` = 0: a one-token prompt), which then
    balance over ranks and micro-batches as rows do without sharing."""
    if shares is None:
        return [[row] for row in rows]
    units: dict = {}
    for r, j in rows:
        key, n = shares[r][j]
        units.setdefault((r, key) if n > 0 else (r, None, j), []).append((r, j))
    return list(units.values())


def within_budget(units: list, lengths, shares, budget: int, row_multiple: int = 1) -> list:
    """``units`` with each one over ``budget`` (its packed length rounded up to ``row_multiple``)
    cut, in order, into units that fit it (each feeding the shared tokens once: greedy, a row
    over the budget alone). Pieces of one unit may later share a micro-batch; its layout then
    feeds their prompt only once for all of them (``units_of`` over the micro-batch's rows), so
    the plan's costs are an upper bound of what it feeds."""

    def fits(unit) -> bool:
        return round_up(unit_cost(unit, lengths, shares), row_multiple) <= budget

    out = []
    for unit in units:
        if len(unit) < 2 or fits(unit):
            out.append(unit)
            continue
        piece = []
        for row in unit:
            if piece and not fits(piece + [row]):
                out.append(piece)
                piece = []
            piece.append(row)
        out.append(piece)
    return out


def unit_cost(unit: Sequence[Row], lengths, shares=None, seq_multiple: int = 1) -> int:
    """Tokens a unit occupies once packed: with two rows or more and ``n`` > 0 shared tokens
    (``shares[r][j] = (key, n)``), ``n`` once plus each row's other tokens; otherwise each row's
    fed tokens rounded up to ``seq_multiple``."""
    n = shares[unit[0][0]][unit[0][1]][1] if shares is not None and len(unit) > 1 else 0
    if n > 0:
        if seq_multiple != 1:
            raise ValueError("shared prompts need seq_multiple 1 (no context parallelism)")
        return n + sum(lengths[r][j] - n for r, j in unit)
    return sum(round_up(lengths[r][j], seq_multiple) for r, j in unit)


def plan_step(lengths: Sequence[Sequence[int]], *, minibatches: int, budget: int,
              seq_multiple: int = 1, row_multiple: int = 1, shares=None,
              group_size: int = 0) -> StepPlan:
    """The plan for rows of ``lengths[r][j]`` fed tokens on data-parallel rank ``r`` (see the
    module's docstring). ``row_multiple``: what a packed micro-batch's length is rounded up to.
    ``shares[r][j] = (key, n)``: rows of one rank with equal keys share their first ``n`` fed
    tokens (a unit); None: no sharing. ``group_size``: whole groups per mini-batch
    (``minibatch_rows``)."""
    ranks = len(lengths)
    per_rank: list[list[list[list[Row]]]] = [[] for _ in range(ranks)]
    members = [minibatch_rows(len(lengths[r]), minibatches, group_size) for r in range(ranks)]
    for k in range(minibatches):
        rows = [(r, j) for r in range(ranks) for j in members[r][k]]
        units = units_of(rows, shares)
        if shares is not None:
            units = within_budget(units, lengths, shares, budget, row_multiple)
        costs = [unit_cost(u, lengths, shares, seq_multiple) for u in units]
        parts = balanced_partition(costs, ranks)
        counts = [len(first_fit_bins([costs[i] for i in s], budget, row_multiple)) for s in parts]
        count = max(max(counts), 1)
        for r, part in enumerate(parts):
            bins = micro_batch_bins([costs[i] for i in part], budget, count, row_multiple)
            per_rank[r].append([[row for i in b for row in units[part[i]]] for b in bins])
    return StepPlan(tuple(tuple(x) for x in per_rank))
