"""Per-token log-probs and entropy from vocab-parallel logits.

Shapes: ``N`` tokens (any leading dims flattened), ``V`` this rank's vocab shard, ``C`` a token chunk.

The full vocabulary is never gathered: each TP rank holds logits for its shard of ``V`` and three
all-reduces of ``C`` values per chunk (max, sum of exp, target logit; one more for entropy) give exact
results. Tokens are processed in chunks so extra memory is ``C x V`` rather than ``N x V``; the
backward recomputes the softmax per chunk from the saved logits and log-sum-exp.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, target_N, vocab_start, group, chunk, temperature, with_entropy):
        n = logits_NV.shape[0]
        dtype = _compute_dtype(logits_NV.dtype)
        logp_N = torch.empty(n, dtype=dtype, device=logits_NV.device)
        lse_N = torch.empty_like(logp_N)
        ent_N = torch.empty_like(logp_N) if with_entropy else None
        vocab = logits_NV.shape[1]
        for s in range(0, n, chunk):
            x_CV = logits_NV[s:s + chunk].to(dtype) / temperature
            m_C = _all_reduce(x_CV.max(-1).values, dist.ReduceOp.MAX, group)
            e_CV = torch.exp(x_CV - m_C[:, None])
            lse_C = m_C + torch.log(_all_reduce(e_CV.sum(-1), dist.ReduceOp.SUM, group))
            local_C = target_N[s:s + chunk] - vocab_start
            in_shard_C = (local_C >= 0) & (local_C < vocab)
            picked_C = x_CV.gather(1, local_C.clamp(0, vocab - 1)[:, None])[:, 0]
            picked_C = _all_reduce(torch.where(in_shard_C, picked_C, 0.0), dist.ReduceOp.SUM, group)
            logp_N[s:s + chunk] = picked_C - lse_C
            lse_N[s:s + chunk] = lse_C
            if with_entropy:  # H = lse - sum_v p_v x_v
                px_C = _all_reduce((e_CV * x_CV).sum(-1), dist.ReduceOp.SUM, group)
                ent_N[s:s + chunk] = lse_C - px_C * torch.exp(m_C - lse_C)
        ctx.save_for_backward(logits_NV, target_N, lse_N, logp_N if ent_N is None else ent_N)
        ctx.args = (vocab_start, chunk, temperature, with_entropy)
        if with_entropy:
            return logp_N, ent_N
        return logp_N, torch.zeros(0, dtype=dtype, device=logits_NV.device)

    @staticmethod
    def backward(ctx, grad_logp_N, grad_ent_N):
        logits_NV, target_N, lse_N, ent_or_logp_N = ctx.saved_tensors
        vocab_start, chunk, temperature, with_entropy = ctx.args
        dtype = lse_N.dtype
        grad_NV = torch.empty_like(logits_NV)
        vocab = logits_NV.shape[1]
        for s in range(0, logits_NV.shape[0], chunk):
            x_CV = logits_NV[s:s + chunk].to(dtype) / temperature
            logq_CV = x_CV - lse_N[s:s + chunk, None]
            p_CV = torch.exp(logq_CV)
            g_CV = -p_CV * grad_logp_N[s:s + chunk, None]
            local_C = target_N[s:s + chunk] - vocab_start
            in_shard_C = (local_C >= 0) & (local_C < vocab)
            rows = torch.nonzero(in_shard_C)[:, 0]
            g_CV[rows, local_C[rows]] += grad_logp_N[s:s + chunk][rows]
            if with_entropy:  # dH/dx_v = -p_v (log p_v + H)
                h_C = ent_or_logp_N[s:s + chunk]
                g_CV -= grad_ent_N[s:s + chunk, None] * p_CV * (logq_CV + h_C[:, None])
            grad_NV[s:s + chunk] = (g_CV / temperature).to(grad_NV.dtype)
        return grad_NV, None, None, None, None, None, None


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, *, group=None,
                   temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``target`` (and entropy) from this rank's vocab shard of ``logits``.

    logits: [..., V] (V = full vocab / TP size, this rank's contiguous shard, as Megatron's
    ColumnParallelLinear output layer gives it); target: [...] global token ids. Returns
    ``(logp[...], entropy[...] or None)`` in at least fp32; differentiable w.r.t. logits.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree "
                         "on the leading dims")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    lead = target.shape
    vocab = logits.shape[-1]
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    logp, ent = _VocabParallelLogProbs.apply(
        logits.reshape(-1, vocab), target.reshape(-1), rank * vocab, group, max(1, chunk_size),
        float(temperature), with_entropy)
    return logp.reshape(lead), (ent.reshape(lead) if with_entropy else None)
