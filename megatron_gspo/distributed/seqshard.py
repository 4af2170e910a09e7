"""Sequences split into shards: packing, context-parallel zigzag, and the per-sequence reduction.

Legend: ``N`` tokens held by this rank, ``S`` sequences in the batch, ``K`` statistics per sequence,
``B`` rows of a padded batch, ``T`` tokens per row.

A sequence-level quantity (GSPO's ratio, a per-sequence token mean) needs sums over all of a
sequence's tokens. Each rank sums what it holds per sequence (``sequence_sums``), and one all-reduce of
the ``[K, S]`` table over the context-parallel group completes them: O(S) values, independent of
sequence length, instead of all-gathering O(N) per-token log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class TokenShard:
    """The tokens of a batch that one rank holds, flattened, each tagged with its sequence.

    ``seq_N`` is the global sequence index in ``[0, num_seqs)``; the same index on different ranks
    (context-parallel chunks) or micro-batches refers to the same sequence.
    """

    logp_N: torch.Tensor  # current policy, differentiable
    old_logp_N: torch.Tensor  # behaviour policy (old or rollout engine)
    mask_N: torch.Tensor  # 1.0 on response tokens, 0.0 elsewhere
    seq_N: torch.Tensor  # int64 sequence index
    num_seqs: int
    advantages_S: Optional[torch.Tensor] = None  # one per sequence, or
    advantages_N: Optional[torch.Tensor] = None  # one per token (gspo_token, grpo)
    ref_logp_N: Optional[torch.Tensor] = None  # reference policy for the KL term
    entropy_N: Optional[torch.Tensor] = None  # for the entropy bonus

    def token_advantages(self) -> torch.Tensor:
        if self.advantages_N is not None:
            return self.advantages_N
        return self.advantages_S[self.seq_N]

    @staticmethod
    def from_dense(logp_BT, old_logp_BT, advantages, mask_BT, *, ref_logp_BT=None, entropy_BT=None
                   ) -> "TokenShard":
        """A padded [B, T] batch: row b is sequence b. ``advantages`` is [B] or [B, T]."""
        if logp_BT.dim() != 2:
            raise ValueError(f"logprobs must be [B, T], got {tuple(logp_BT.shape)}")
        b, t = logp_BT.shape
        for name, x in (("old_logprobs", old_logp_BT), ("mask", mask_BT),
                        ("ref_logprobs", ref_logp_BT), ("entropy", entropy_BT)):
            if x is not None and tuple(x.shape) != (b, t):
                raise ValueError(f"{name} has shape {tuple(x.shape)}, expected [B, T] = {(b, t)}")
        if tuple(advantages.shape) not in ((b,), (b, t)):
            raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected [B] = ({b},) "
                             f"or [B, T] = {(b, t)}")
        seq = torch.arange(b, device=logp_BT.device).repeat_interleave(t)
        flat = (lambda x: None if x is None else x.reshape(-1))
        per_token = advantages.dim() == 2
        return TokenShard(
            logp_N=logp_BT.reshape(-1), old_logp_N=old_logp_BT.reshape(-1),
            mask_N=mask_BT.reshape(-1).to(logp_BT.dtype), seq_N=seq, num_seqs=b,
            advantages_S=None if per_token else advantages,
            advantages_N=advantages.reshape(-1) if per_token else None,
            ref_logp_N=flat(ref_logp_BT), entropy_N=flat(entropy_BT))

    @staticmethod
    def from_packed(logp_1N, old_logp_1N, advantages, mask_1N, seq_1N, num_seqs: int, *,
                    ref_logp_1N=None, entropy_1N=None) -> "TokenShard":
        """A packed row [1, N] (or this rank's share of it) whose tokens belong to sequences
        ``seq_1N`` in ``[0, num_seqs)``; ``advantages`` is [num_seqs] or per token [1, N]."""
        flat = (lambda x: None if x is None else x.reshape(-1))
        per_token = advantages.dim() == 2
        return TokenShard(
            logp_N=flat(logp_1N), old_logp_N=flat(old_logp_1N),
            mask_N=flat(mask_1N).to(logp_1N.dtype), seq_N=flat(seq_1N).long(), num_seqs=num_seqs,
            advantages_S=None if per_token else advantages,
            advantages_N=flat(advantages) if per_token else None,
            ref_logp_N=flat(ref_logp_1N), entropy_N=flat(entropy_1N))

    def select(self, index_N: torch.Tensor) -> "TokenShard":
        """The shard holding only tokens ``index_N`` (a CP chunk, a micro-batch's tokens)."""
        pick = (lambda x: None if x is None else x[index_N])
        return TokenShard(self.logp_N[index_N], self.old_logp_N[index_N], self.mask_N[index_N],
                          self.seq_N[index_N], self.num_seqs, self.advantages_S,
                          pick(self.advantages_N), pick(self.ref_logp_N), pick(self.entropy_N))


def sequence_sums(rows_KN: torch.Tensor, seq_N: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[K, S] per-sequence sums of the [K, N] token rows (differentiable)."""
    out = torch.zeros(rows_KN.shape[0], num_seqs, dtype=rows_KN.dtype, device=rows_KN.device)
    return out.index_add(1, seq_N, rows_KN)


class _SumAcrossShards(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward.

    Every rank of the group then computes the same sequence-level loss from the completed sums, and
    each rank's backward reaches only its own tokens; summing parameter gradients over the group
    (as data/context-parallel gradient reduction does) yields the gradient of that loss.
    """

    @staticmethod
    def forward(ctx, stats, group):
        out = stats.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SequenceReducer:
    """Completes per-sequence statistics over the ranks that hold parts of the same sequences.

    ``values_sent`` counts the elements this reducer has all-reduced (for the O(S) guarantee).
    ``group=None`` means no other rank holds parts of these sequences (a pure, local call); a
    group, even of one rank, is always reduced over, so that one device runs the code path of many.
    """

    def __init__(self, group=None):
        self.group = group
        self.values_sent = 0

    @property
    def active(self) -> bool:
        return self.group is not None

    def sum(self, stats_KS: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return stats_KS
        self.values_sent += stats_KS.numel()
        return _SumAcrossShards.apply(stats_KS, self.group)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise max over the group; no gradient (for metrics such as ratio min/max)."""
        if not self.active:
            return values
        out = values.detach().clone()
        self.values_sent += out.numel()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out


def zigzag_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Token positions that context-parallel rank ``rank`` holds of one sequence.

    Megatron's load balancing splits a sequence into 2*cp chunks and gives rank r chunks r and
    2*cp-1-r, so every rank holds an equal share of early (cheap) and late (costly) causal rows.
    """
    if cp == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def packed_zigzag_index(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Zigzag positions of every sequence in a packed (THD) batch, each padded to 2*cp chunks."""
    starts, ends = cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()
    return torch.cat([s + zigzag_index(e - s, cp, rank) for s, e in zip(starts, ends)])


def seq_index_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[N] sequence index of every token of a packed batch from its cumulative lengths."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.arange(len(lengths), device=cu_seqlens.device).repeat_interleave(lengths)


@dataclass
class PackedTokens:
    """Sequences packed back to back in one row (THD): inputs predict targets within a sequence."""

    tokens_1N: torch.Tensor
    targets_1N: torch.Tensor
    position_ids_1N: torch.Tensor
    cu_seqlens: torch.Tensor  # int32 [S + 1], including a padding segment when one was needed
    seq_N: torch.Tensor  # sequence index per token (padding tokens: index S_real)
    valid_N: torch.Tensor  # False on padding


def pack_sequences(sequences: list[torch.Tensor], multiple_of: int = 1, pad_id: int = 0,
                   seq_multiple_of: int = 1) -> PackedTokens:
    """Pack token sequences (each predicts its own next tokens) into one row, padded with one
    extra segment to a length divisible by ``multiple_of`` (TP for sequence parallelism). Under
    context parallelism every sequence is split in 2 x cp chunks: ``seq_multiple_of`` pads each
    sequence (inside its own segment, at its end) to a multiple of it."""
    inputs, targets, valid = [], [], []
    for s in sequences:
        n = len(s) - 1
        if n < 1:
            raise ValueError("every packed sequence needs at least two tokens")
        extra = (-n) % seq_multiple_of
        inputs.append(torch.cat([s[:-1], torch.full((extra,), pad_id, dtype=s.dtype)]))
        targets.append(torch.cat([s[1:], torch.full((extra,), pad_id, dtype=s.dtype)]))
        valid.append(torch.arange(n + extra) < n)
    lengths = [len(x) for x in inputs]
    pad = (-sum(lengths)) % multiple_of
    if pad:
        inputs.append(torch.full((pad,), pad_id, dtype=inputs[0].dtype))
        targets.append(torch.full((pad,), pad_id, dtype=targets[0].dtype))
        lengths.append(pad)
        valid.append(torch.zeros(pad, dtype=torch.bool))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedTokens(
        tokens_1N=torch.cat(inputs)[None], targets_1N=torch.cat(targets)[None],
        position_ids_1N=torch.cat([torch.arange(n) for n in lengths])[None], cu_seqlens=cu,
        seq_N=seq_index_from_cu_seqlens(cu), valid_N=torch.cat(valid))
