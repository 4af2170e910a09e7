"""Attention on CPU: short buckets of packed rows and decoding steps as batched matmuls and a
softmax, forward and backward written out, where SDPA's CPU kernel has a fixed cost per
(sequence, head) that dominates at a few tens of keys.

Shapes: ``B`` rows, ``N`` attention heads on this rank, ``G`` query groups on this rank, ``D``
head dim, ``T`` packed tokens or a row's positions, ``S`` keys.
"""

from __future__ import annotations

import torch

from megatron_gspo.models.layers import SDPAttention, attend_buckets


# The float types that the CPU paths written out here (RMSNorm's backward, short buckets' and
# decoding's attention) compute in their own precision; bf16 / fp16 stay on torch's kernels
# (SDPA's CPU kernel accumulates them in fp32).
FULL_PRECISION = (torch.float32, torch.float64)


# Buckets of at most this many key slots run as ``_MatmulBuckets`` on CPU in full precision; longer
# ones through SDPA's kernel, which is faster there (``benchmarks/step_parts.py``).
MATMUL_MAX_KEYS = 64


class _MatmulBuckets(torch.autograd.Function):
    """Causal attention of short buckets (``Bucket``) as batched matmuls and a softmax, forward and
    backward written out: ``[T, N, D]`` out, zero at rows in no bucket.

    SDPA's CPU kernel runs one task per (sequence, head) with a fixed cost each, which dominates at
    a few tens of keys; here a bucket is two batched products per KV group. Layout ``[G, T, r, D]``
    (``r = N / G`` query heads of a group) is made once per call, so a bucket's gather
    (``index_select`` on the token dim) is already the kernel's ``[G x b, m x r, D]``: its ``r``
    heads stacked along the positions, interleaved (row ``j r + h``: position ``j``, head ``h``),
    sharing one product with the group's keys. Scores are kept keys-first, ``[G b, m, m r]``, so
    the softmax runs over a strided dim (torch's kernel over a last dim of 15 keys takes about 6x
    as long). A query's output gradient is zeroed where it is no output (padding, a shared
    prefix's slots), so their rows add nothing to the key and value gradients."""

    @staticmethod
    def forward(ctx, q_TND, k_TGD, v_TGD, plan, scale):
        t, n, d = q_TND.shape
        g = k_TGD.shape[1]
        r = n // g
        q_GTrD = q_TND.view(t, g, r, d).transpose(0, 1).contiguous()
        k_GTD, v_GTD = (x.transpose(0, 1).contiguous() for x in (k_TGD, v_TGD))
        out_GTrD = q_TND.new_zeros(g, t, r, d)
        saved = []
        for bucket in plan:
            b, m = bucket.index.shape
            q = q_GTrD.index_select(1, bucket.keys).view(g * b, m * r, d)
            k, v = (x.index_select(1, bucket.keys).view(g * b, m, d) for x in (k_GTD, v_GTD))
            query_pos = torch.arange(m, device=q.device).repeat_interleave(r)
            future = torch.arange(m, device=q.device)[:, None] > query_pos[None, :]
            bias_mR = q.new_zeros(m, m * r).masked_fill_(future, float("-inf"))
            p_BmR = torch.baddbmm(bias_mR, k, q.transpose(1, 2), alpha=scale).softmax(1)
            o = torch.bmm(p_BmR.transpose(1, 2), v).view(g, b * m, r, d)
            out_GTrD.index_copy_(1, bucket.rows, o.index_select(1, bucket.outputs))
            saved += [q, k, v, p_BmR]
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.scale, ctx.groups = plan, scale, g
        return out_GTrD.transpose(0, 1).reshape(t, n, d)

    @staticmethod
    def backward(ctx, dout_TND):
        t, n, d = dout_TND.shape
        saved, g = ctx.saved_tensors, ctx.groups
        r = n // g
        dout_GTrD = dout_TND.reshape(t, g, r, d).transpose(0, 1).contiguous()
        dq_GTrD = dout_TND.new_zeros(g, t, r, d)
        dk_GTD, dv_GTD = dout_TND.new_zeros(g, t, d), dout_TND.new_zeros(g, t, d)
        for i, bucket in enumerate(ctx.plan):
            q, k, v, p_BmR = saved[4 * i:4 * i + 4]
            b, m = bucket.index.shape
            real = bucket.real.reshape(1, b * m, 1, 1).to(dout_TND.dtype)
            do = dout_GTrD.index_select(1, bucket.keys).mul_(real).view(g * b, m * r, d)
            dv = torch.bmm(p_BmR, do)
            ds_BmR = torch._softmax_backward_data(torch.bmm(v, do.transpose(1, 2)), p_BmR, 1,
                                                  p_BmR.dtype)
            dq = torch.bmm(ds_BmR.transpose(1, 2), k).mul_(ctx.scale)
            dk = torch.bmm(ds_BmR, q).mul_(ctx.scale)
            dq_GTrD.index_add_(1, bucket.keys, dq.view(g, b * m, r, d))  # 0 off the outputs
            dk_GTD.index_add_(1, bucket.keys, dk.view(g, b * m, d))
            dv_GTD.index_add_(1, bucket.keys, dv.view(g, b * m, d))
        return (dq_GTrD.transpose(0, 1).reshape(t, n, d), dk_GTD.transpose(0, 1).contiguous(),
                dv_GTD.transpose(0, 1).contiguous(), None, None)


def decode_attention(q_BNTD, k_BGSD, v_BGSD, masked_B1TS=None, scale=None):
    """The last ``T`` positions' queries of each row (decoding with a KV cache: ``T`` = 1; the
    local engine's direct prefill: the padded prompt) against ``S`` keys, as two batched matmuls
    and a softmax, ``[B, N, T, D]`` out; ``masked``: True where a key is hidden (causal rule, left
    padding). SDPA's CPU kernel costs about 1.7x this on the compute shape's decoding steps (128
    rows, 8 heads / 4 groups, 12-33 keys: 318-353 against 194-216 us). The ``r = N / G`` query
    heads of a group are stacked along the positions and share one product with the group's
    keys. A query that sees no key at all (a prefill's padding position, whose output nothing
    reads: its key is hidden from every real query) attends to every key evenly instead of
    taking the NaN of a softmax over nothing, which its key and value would carry into the real
    rows' attention (0 x NaN); a decoding step's query always sees its own key."""
    b, n, t, d = q_BNTD.shape
    g, s = k_BGSD.shape[1], k_BGSD.shape[2]
    scale = d ** -0.5 if scale is None else scale
    q = q_BNTD.reshape(b * g, n // g * t, d)
    k = k_BGSD.transpose(-1, -2).reshape(b * g, d, s)
    v = v_BGSD.reshape(b * g, s, d)
    if masked_B1TS is None:
        p = torch.softmax(torch.bmm(q, k).mul_(scale), dim=-1)
    else:
        hidden = masked_B1TS if t == 1 else masked_B1TS & ~masked_B1TS.all(-1, keepdim=True)
        bias = torch.zeros(masked_B1TS.shape, dtype=q.dtype, device=q.device).masked_fill_(
            hidden, float("-inf"))
        bias = bias.unsqueeze(2).expand(b, g, n // g, t, s).reshape(b * g, n // g * t, s)
        p = torch.softmax(torch.baddbmm(bias, q, k, alpha=scale), dim=-1)
    return torch.bmm(p, v).view(b, n, t, d)


def cpu_packed_attention(q_TND, k_TGD, v_TGD, plan, *, scale=None, dropout_p=0.0,
                         matmul_max_keys=MATMUL_MAX_KEYS):
    """``models.layers.packed_causal_attention`` with, in full precision without dropout, the
    buckets of at most ``matmul_max_keys`` key slots as batched matmuls (``_MatmulBuckets``: 2x
    SDPA's speed forward + backward at 16 keys, 1.2-1.5x at 32-40, even at 64-96, slower from
    128); the others through ``scaled_dot_product_attention``."""
    scale = q_TND.shape[-1] ** -0.5 if scale is None else scale  # SDPA's default
    short = [] if (q_TND.dtype not in FULL_PRECISION or dropout_p != 0.0) else [
        i for i, bucket in enumerate(plan) if bucket.index.shape[1] <= matmul_max_keys]
    if short:
        out = _MatmulBuckets.apply(q_TND, k_TGD, v_TGD, tuple(plan[i] for i in short), scale)
    else:
        out = torch.empty_like(q_TND)
    rest = [plan[i] for i in range(len(plan)) if i not in short]
    return attend_buckets(q_TND, k_TGD, v_TGD, rest, out, scale=scale, dropout_p=dropout_p)


class CPUAttention(SDPAttention):
    """``SDPAttention`` with the CPU's matmul paths: packed rows' short buckets and decoding
    steps (one query per row) in full precision."""

    def packed_attention(self, q_TND, k_TGD, v_TGD, plan, *, scale, dropout_p):
        return cpu_packed_attention(q_TND, k_TGD, v_TGD, plan, scale=scale, dropout_p=dropout_p)

    def one_query_attention(self, q_BN1D, k_BGSD, v_BGSD, masked_B11S, dropout_p):
        if q_BN1D.dtype not in FULL_PRECISION or dropout_p != 0.0:
            return None
        return decode_attention(q_BN1D, k_BGSD, v_BGSD, masked_B11S, self.softmax_scale)
