"""Per-token log-probs and entropy from vocab-parallel logits.

Shapes: ``N`` tokens (any leading dims flattened), ``V`` this rank's vocab shard, ``C`` a token chunk,
``H`` hidden size.

The full vocabulary is never gathered: each TP rank holds logits for its shard of ``V`` and three
all-reduces of ``C`` values per chunk (max, sum of exp, target logit; one more for entropy) give exact
results. Tokens are processed in chunks, so temporaries are ``C x V``; the backward recomputes the
softmax per chunk from the saved logits and log-sum-exp.

Two entry points share the per-chunk math:
- ``token_logprobs(logits, target)``: from logits that exist (Megatron's output layer output);
- ``linear_token_logprobs(hidden, weight, target)``: fused with the output projection, so the
  ``[N, V]`` logits never exist at once (the backward recomputes each chunk's logits).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    """All-reduce over the vocab-parallel group; ``group=None`` is a local (pure) call. A group of
    one rank is reduced over all the same: one GPU runs the code path of many."""
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_forward(x_CV, target_C, vocab_start, group, with_entropy):
    """(logp, lse, entropy or None) of one chunk of (temperature-scaled) vocab-shard logits."""
    vocab = x_CV.shape[1]
    m_C = _all_reduce(x_CV.max(-1).values, dist.ReduceOp.MAX, group)
    e_CV = (x_CV - m_C[:, None]).exp_()  # one C x V temporary
    lse_C = m_C + torch.log(_all_reduce(e_CV.sum(-1), dist.ReduceOp.SUM, group))
    local_C = target_C - vocab_start
    in_shard_C = (local_C >= 0) & (local_C < vocab)
    picked_C = x_CV.gather(1, local_C.clamp(0, vocab - 1)[:, None])[:, 0]
    picked_C = _all_reduce(torch.where(in_shard_C, picked_C, 0.0), dist.ReduceOp.SUM, group)
    ent_C = None
    if with_entropy:  # H = lse - E_p[x]
        px_C = _all_reduce(e_CV.mul_(x_CV).sum(-1), dist.ReduceOp.SUM, group)
        ent_C = lse_C - px_C * torch.exp(m_C - lse_C)
    return picked_C - lse_C, lse_C, ent_C


def _chunk_backward(x_CV, target_C, lse_C, grad_logp_C, ent_C, grad_ent_C, vocab_start,
                    temperature):
    """Gradient w.r.t. the unscaled logits of one chunk: dlogp/dx = onehot - p,
    dH/dx = -p (log p + H); both divided by the temperature. Overwrites ``x_CV`` (a fresh,
    temperature-scaled copy) so that the chunk needs one C x V buffer (two with entropy)."""
    logq_CV = x_CV.sub_(lse_C[:, None])
    if grad_ent_C is not None:
        p_CV = torch.exp(logq_CV)
        g_CV = logq_CV.add_(ent_C[:, None]).mul_(p_CV).mul_(-grad_ent_C[:, None])
        g_CV.sub_(p_CV.mul_(grad_logp_C[:, None]))
    else:
        g_CV = logq_CV.exp_().mul_(-grad_logp_C[:, None])
    # + grad at each row's target in this shard (rows whose target is in another shard add 0 at
    # a clamped column: the same values, without a data-dependent row list, which would make a
    # GPU wait for the host)
    local_C = target_C - vocab_start
    in_shard_C = (local_C >= 0) & (local_C < x_CV.shape[1])
    g_CV.scatter_add_(1, local_C.clamp(0, x_CV.shape[1] - 1)[:, None],
                      torch.where(in_shard_C, grad_logp_C, 0.0).to(g_CV.dtype)[:, None])
    return g_CV.div_(temperature)


def _vocab_start(group, vocab_shard: int) -> int:
    rank = dist.get_rank(group) if group is not None else 0
    return rank * vocab_shard


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, target_N, group, chunk, temperature, with_entropy, inplace):
        n = logits_NV.shape[0]
        dtype = _compute_dtype(logits_NV.dtype)
        vocab_start = _vocab_start(group, logits_NV.shape[1])
        logp_N = torch.empty(n, dtype=dtype, device=logits_NV.device)
        lse_N = torch.empty_like(logp_N)
        ent_N = torch.empty_like(logp_N) if with_entropy else torch.zeros(0, dtype=dtype)
        for s in range(0, n, chunk):
            x_CV = logits_NV[s:s + chunk].to(dtype) / temperature
            logp_N[s:s + chunk], lse_N[s:s + chunk], ent_C = _chunk_forward(
                x_CV, target_N[s:s + chunk], vocab_start, group, with_entropy)
            if with_entropy:
                ent_N[s:s + chunk] = ent_C
        ctx.save_for_backward(logits_NV, target_N, lse_N, ent_N)
        ctx.args = (vocab_start, chunk, temperature, with_entropy, inplace)
        # An output outside the loss (the entropy, kept as a metric) gets no gradient: its
        # backward term is skipped rather than computed from zeros.
        ctx.set_materialize_grads(False)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, grad_logp_N, grad_ent_N):
        logits_NV, target_N, lse_N, ent_N = ctx.saved_tensors
        vocab_start, chunk, temperature, with_entropy, inplace = ctx.args
        dtype = lse_N.dtype
        if grad_logp_N is None:
            grad_logp_N = torch.zeros_like(lse_N)
        # In place: each chunk's logits are read before its gradient overwrites them, so the
        # backward needs no [N, V] buffer beyond the logits themselves.
        grad_NV = logits_NV if inplace else torch.empty_like(logits_NV)
        for s in range(0, logits_NV.shape[0], chunk):
            sl = slice(s, s + chunk)
            g_ent = grad_ent_N[sl] if with_entropy and grad_ent_N is not None else None
            grad_NV[sl] = _chunk_backward(
                logits_NV[sl].to(dtype) / temperature, target_N[sl], lse_N[sl], grad_logp_N[sl],
                ent_N[sl] if with_entropy else None, g_ent, vocab_start, temperature
            ).to(grad_NV.dtype)
        return grad_NV, None, None, None, None, None, None


class _LinearVocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, target_N, group, chunk, temperature):
        n = hidden_NH.shape[0]
        dtype = _compute_dtype(hidden_NH.dtype)
        vocab_start = _vocab_start(group, weight_VH.shape[0])
        logp_N = torch.empty(n, dtype=dtype, device=hidden_NH.device)
        lse_N = torch.empty_like(logp_N)
        for s in range(0, n, chunk):
            x_CV = (hidden_NH[s:s + chunk] @ weight_VH.t()).to(dtype).div_(temperature)
            logp_N[s:s + chunk], lse_N[s:s + chunk], _ = _chunk_forward(
                x_CV, target_N[s:s + chunk], vocab_start, group, False)
        ctx.save_for_backward(hidden_NH, weight_VH, target_N, lse_N)
        ctx.args = (group, vocab_start, chunk, temperature)
        # Megatron keeps a preallocated fp32 ``main_grad`` per parameter; accumulating into it
        # (as its fused linear layers do) avoids a second [V, H] buffer.
        ctx.main_grad = getattr(weight_VH, "main_grad", None)
        ctx.weight_param = weight_VH if ctx.main_grad is not None else None
        return logp_N

    @staticmethod
    def backward(ctx, grad_logp_N):
        hidden_NH, weight_VH, target_N, lse_N = ctx.saved_tensors
        group, vocab_start, chunk, temperature = ctx.args
        dtype = lse_N.dtype
        grad_h = torch.empty_like(hidden_NH)
        grad_w = ctx.main_grad if ctx.main_grad is not None else torch.zeros_like(weight_VH)
        for s in range(0, hidden_NH.shape[0], chunk):
            sl = slice(s, s + chunk)
            x_CV = (hidden_NH[sl] @ weight_VH.t()).to(dtype).div_(temperature)
            g_CV = _chunk_backward(x_CV, target_N[sl], lse_N[sl], grad_logp_N[sl], None, None,
                                   vocab_start, temperature).to(weight_VH.dtype)
            grad_h[sl] = g_CV @ weight_VH
            grad_w.addmm_(g_CV.t().to(grad_w.dtype), hidden_NH[sl].to(grad_w.dtype))
        # Each TP rank saw only its vocab shard: the hidden state's gradient is their sum.
        _all_reduce(grad_h, dist.ReduceOp.SUM, group)
        if ctx.main_grad is not None:
            ctx.weight_param.grad_added_to_main_grad = True
            return grad_h, None, None, None, None, None
        return grad_h, grad_w, None, None, None, None


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, *, group=None,
                   temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                   inplace_backward: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``target`` (and entropy) from this rank's vocab shard of ``logits``.

    logits: [..., V] (V = full vocab / TP size, this rank's contiguous shard, as Megatron's
    ColumnParallelLinear output layer gives it); target: [...] global token ids. Returns
    ``(logp[...], entropy[...] or None)`` in at least fp32; differentiable w.r.t. logits.

    ``inplace_backward`` writes the logits' gradient into the logits' own storage (no second
    [N, V] buffer); only for logits that nothing else reads after this backward, such as the output
    of Megatron's output layer, which saves its input and weight, not its output.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree "
                         "on the leading dims")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    lead = target.shape
    logp, ent = _VocabParallelLogProbs.apply(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), group, max(1, chunk_size),
        float(temperature), with_entropy, inplace_backward)
    return logp.reshape(lead), (ent.reshape(lead) if with_entropy else None)


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                          group=None, temperature: float = 1.0, chunk_size: int = 1024
                          ) -> torch.Tensor:
    """Log-probs of ``target`` under logits ``hidden @ weight.T`` without materialising them.

    hidden: [..., H] (the same on every TP rank); weight: [V, H], this rank's vocab shard of the
    output layer; target: [...]. Extra memory is one ``C x V`` chunk; the price is recomputing each
    chunk's logits in the backward. Gradients flow to ``hidden`` (summed over the TP group) and
    ``weight`` (added to ``weight.main_grad`` when it has one, as Megatron's DDP provides).
    """
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} disagree "
                         "on the leading dims")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    logp = _LinearVocabParallelLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), group,
        max(1, chunk_size), float(temperature))
    return logp.reshape(target.shape)
