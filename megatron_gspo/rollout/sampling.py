"""Sampling the next token: greedy, or from the tempered distribution truncated to top-k /
top-p, by inverting each row's distribution at a uniform number that is a pure function of the
row's seed and the step (``row_uniform``)."""

from __future__ import annotations

import torch

from megatron_gspo.rollout.types import SamplingParams


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 tensors x < 2^32 without overflowing int64 (c split in halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash with full avalanche (C. Wellons' "lowbias32")."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_uniform(row_seeds: torch.Tensor, step) -> torch.Tensor:
    """[B] uniform numbers in (0, 1) with 53 random bits (float64), a pure function of each row's
    seed and the decoding step (a counter-based hash, for the whole batch at once on the seeds'
    device): a row samples the same tokens whichever rank, batch or position in the batch
    generates it. ``step``: an int, or an int64 tensor on the seeds' device, a scalar (a decoding
    loop that keeps its counter there) or ``[W]`` steps, which gives ``[B, W]`` numbers (the
    same as ``W`` calls, hashed together)."""
    seeds = row_seeds.to(torch.int64)
    key = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) ^ 0x9E3779B9))
    if isinstance(step, torch.Tensor):
        counter = (step.to(torch.int64) * 0x632BE5AB + 1) & _MASK32
        key = key[:, None] if counter.dim() else key  # (the counters hashed once, broadcast)
    else:
        counter = torch.full_like(key, (step * 0x632BE5AB + 1) & _MASK32)
    key = _mix32(key ^ _mix32(counter))
    high = _mix32(key ^ 0x85EBCA6B) >> 5  # 27 bits
    low = _mix32(key ^ 0xC2B2AE35) >> 6  # 26 bits
    return ((high * 2 ** 26 + low).double() + 0.5) * (1.0 / 2 ** 53)


def sample_next(logits_BV: torch.Tensor, params: SamplingParams, generator=None, uniform_B=None):
    """(token [B], log-prob [B]) from last-position logits: greedy at temperature 0, else sampled
    from softmax(logits / T) restricted to top-k / top-p (with ``uniform_B``, by inverting each
    row's cumulative distribution, in float64, at its given uniform number: one random number per
    row, not per vocabulary entry). The log-prob is of the untruncated tempered distribution
    (T = 1 when greedy), which is what the trainer recomputes."""
    logits = logits_BV.float()
    if params.temperature == 0:
        token = logits.argmax(-1)
        logq = torch.log_softmax(logits, -1)
        return token, logq.gather(-1, token[:, None])[:, 0]
    logq = torch.log_softmax(logits / params.temperature, -1)
    filtered = logq
    # (masks applied with ``where``, not boolean assignment, which waits for the host on GPUs)
    if params.top_k > 0 and params.top_k < filtered.shape[-1]:
        kth = filtered.topk(params.top_k, -1).values[:, -1:]
        filtered = torch.where(filtered < kth, -float("inf"), filtered)
    if params.top_p < 1.0:
        sorted_lq, order = filtered.sort(-1, descending=True)
        cum = sorted_lq.exp().cumsum(-1)
        drop = cum - sorted_lq.exp() > params.top_p  # keep the smallest prefix reaching top_p
        sorted_lq = torch.where(drop, -float("inf"), sorted_lq)
        filtered = torch.full_like(filtered, -float("inf")).scatter(-1, order, sorted_lq)
    if uniform_B is not None:
        cdf = torch.softmax(filtered.double(), -1).cumsum(-1)
        # The first entry whose cumulative probability reaches u (scaled to the row's total, which
        # rounding keeps a hair from 1): never an entry of probability 0.
        point = uniform_B.to(cdf.device)[:, None] * cdf[:, -1:]
        token = torch.searchsorted(cdf, point)[:, 0].clamp_(max=cdf.shape[-1] - 1)
    else:
        token = torch.multinomial(torch.softmax(filtered, -1), 1, generator=generator)[:, 0]
    return token, logq.gather(-1, token[:, None])[:, 0]
