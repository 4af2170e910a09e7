"""Local (non-Transformer-Engine) layer pieces for the Qwen3-MoE layer spec.

Shapes: ``S`` sequence, ``B`` batch, ``N`` attention heads on this rank, ``G`` query groups on this
rank, ``D`` head dim, ``T`` packed tokens, ``Q`` this context-parallel rank's query positions,
``K`` key positions (all of them under context parallelism).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import attention as megatron_attention
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_gspo.seqshard import packed_zigzag_index, zigzag_index


class RMSNorm(torch.nn.RMSNorm):
    """RMSNorm that works under sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``; MoE with TP > 1 requires it. The
    norm itself is pointwise per token, so only its weight needs the ``sequence_parallel`` mark that
    makes ``finalize_model_grads`` sum its gradient over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dtype in FULL_PRECISION and self.weight is not None
                and self.weight.dtype == x.dtype and torch.is_grad_enabled()
                and (x.requires_grad or self.weight.requires_grad)):
            return _RMSNormCPU.apply(x, self.weight, self.eps)
        return super().forward(x)


class _RMSNormCPU(torch.autograd.Function):
    """``torch.rms_norm`` over the last dim with a weight, for autograd on CPU in fp32 / fp64:
    the forward is its CPU composite's, to the bit (``x * rsqrt(mean(x^2) + eps) * w``); the
    backward is written out, ``dx = rstd * (g w - x^ mean(g w x^))`` with ``x^ = x rstd``, and
    ``dw = sum(g x^)`` over the tokens, instead of autograd through the composite's ten
    elementwise operations (fwd + bwd of one norm of a compute-shape micro-batch, 1400 x 256:
    0.80 against 0.95 ms; of its q norm, 1400 x 8 heads x 32: 0.82 against 0.99 ms). Saves the
    input and the per-token ``rstd``, as the composite does."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, rstd, weight)
        return x * rstd * weight

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        xhat = x * rstd
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (grad * xhat).reshape(-1, x.shape[-1]).sum(0)
        gw = grad * weight
        mean = (gw * xhat).mean(-1, keepdim=True)
        dx = torch.addcmul(gw, xhat, mean, value=-1).mul_(rstd) if ctx.needs_input_grad[0] else None
        return dx, dw, None


def zigzag_causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor,
                       segment_q: Optional[torch.Tensor] = None,
                       segment_k: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[Q, K] bool mask (True = may attend) in global positions: a query at position p sees keys
    at positions <= p (of its own sequence, when packed), in whatever order the keys come."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if segment_q is not None:
        mask &= segment_q[:, None] == segment_k[None, :]
    return mask


def length_buckets(lengths: list, ratio: float = 2.0) -> list:
    """Sequence indices grouped for padded batches: longest first, a bucket takes sequences down
    to 1/``ratio`` of its longest. Padding a sequence of length L to its bucket's longest M costs
    at most (M / L)^2 = 4x its own attention work, on the short sequences whose work is small;
    the bucket count grows with log(longest / shortest), not with the number of sequences."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    buckets = []
    for i in order:
        if buckets and lengths[i] * ratio >= lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


@dataclass(frozen=True)
class Bucket:
    """Sequences of a packed row attended together: ``index`` [b, M] of each sequence's keys in
    the row (right-padded with its first key), ``real`` [b, M] True on its own tokens (its
    outputs); flat, as ``index_select`` / ``index_copy`` take them: ``keys`` = ``index``
    flattened, ``outputs`` the places in it of the real entries, ``rows`` their row tokens."""

    index: torch.Tensor
    real: torch.Tensor
    keys: torch.Tensor
    outputs: torch.Tensor
    rows: torch.Tensor


def bucket_plan(bounds, device, prefix_of=()) -> list:
    """The ``Bucket``s of a packed row (``bounds``: cumulative sequence lengths as Python ints),
    by length (``length_buckets``). A sequence with a shared prefix (``prefix_of[i]`` >= 0,
    ``forward.PackedRows``) has the prefix's tokens as its first keys, not as outputs (the prefix
    is a sequence of its own, which gives them). Each bucket is built by a few whole-bucket
    operations, not per sequence (this runs once per micro-batch, on the host)."""
    starts, lengths = bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    prefix_of = prefix_of or (-1,) * len(lengths)
    spans = [n + (lengths[p] if p >= 0 else 0) for n, p in zip(lengths, prefix_of)]
    plan = []
    for bucket in length_buckets(spans):
        own_start, own_len, pre_start, pre_len = torch.tensor(
            [(starts[i], lengths[i], starts[p] if p >= 0 else 0, lengths[p] if p >= 0 else 0)
             for i, p in ((i, prefix_of[i]) for i in bucket)], dtype=torch.long).unbind(1)
        j = torch.arange(spans[bucket[0]])[None, :]  # [b, M]: key slot j of each sequence
        in_prefix = j < pre_len[:, None]
        real = ~in_prefix & (j < (pre_len + own_len)[:, None])
        index = torch.where(in_prefix, pre_start[:, None] + j,
                            own_start[:, None] + j - pre_len[:, None])
        first = torch.where(pre_len > 0, pre_start, own_start)  # padding repeats the first key
        index = torch.where(in_prefix | real, index, first[:, None])
        outputs = real.reshape(-1).nonzero()[:, 0]
        plan.append(Bucket(*(t.to(device) for t in (index, real, index.reshape(-1), outputs,
                                                     index.reshape(-1)[outputs]))))
    return plan


def _plan_of(packed_seq_params, device) -> list:
    """The bucket plan of a packed row. Our ``forward.PackedRows`` carry the bounds on the host
    and a cache the layers of one forward share: made once per micro-batch, without reading the
    device; other packed parameters: from ``cu_seqlens``."""
    cache = getattr(packed_seq_params, "cache", None)
    if cache is None:
        return bucket_plan(packed_seq_params.cu_seqlens_q.tolist(), device)
    if "bucket_plan" not in cache:
        cache["bucket_plan"] = bucket_plan(packed_seq_params.bounds, device,
                                           packed_seq_params.prefix_of)
    return cache["bucket_plan"]


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


def packed_causal_attention(q_TND, k_TGD, v_TGD, plan, *, scale=None, dropout_p=0.0,
                            matmul_max_keys=MATMUL_MAX_KEYS):
    """[T, N, D] causal attention within each sequence of a packed row (``plan``: the row's
    ``bucket_plan``).

    Sequences of similar length are attended together, right-padded to the bucket's longest:
    under the causal rule a real query never sees a key after it, so padding changes no real
    output (padded queries are dropped and get no gradient; so are the queries of a shared
    prefix ahead of a sequence, whose keys it attends to). The work is about that of the
    sequences' own lengths (sum of L^2), not the packed row's (T^2) that a block-diagonal mask
    over the whole row would cost, in a few calls instead of one per sequence. On CPU in full
    precision without dropout, buckets of at most ``matmul_max_keys`` key slots run as batched
    matmuls (``_MatmulBuckets``: 2x SDPA's speed forward + backward at 16 keys, 1.2-1.5x at
    32-40, even at 64-96, slower from 128);
    the others, and every bucket elsewhere, through ``scaled_dot_product_attention``."""
    scale = q_TND.shape[-1] ** -0.5 if scale is None else scale  # SDPA's default
    short = [] if (q_TND.device.type != "cpu" or q_TND.dtype not in FULL_PRECISION
                   or dropout_p != 0.0) else [
        i for i, bucket in enumerate(plan) if bucket.index.shape[1] <= matmul_max_keys]
    if short:
        out = _MatmulBuckets.apply(q_TND, k_TGD, v_TGD, tuple(plan[i] for i in short), scale)
    else:
        out = torch.empty_like(q_TND)
    n, g = q_TND.shape[1], k_TGD.shape[1]
    for bucket in (plan[i] for i in range(len(plan)) if i not in short):
        b, m = bucket.index.shape  # (gathers and writes by index_select / index_copy: their
        q, k, v = (t.index_select(0, bucket.keys).view(b, m, *t.shape[1:]).permute(0, 2, 1, 3)
                   for t in (q_TND, k_TGD, v_TGD))  # backwards are index_add / index_select,
        o = F.scaled_dot_product_attention(  # far cheaper than advanced indexing's) [b, N, M, D]
            q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=(n != g))
        o = o.permute(0, 2, 1, 3).reshape(b * m, *q_TND.shape[1:])
        out.index_copy_(0, bucket.rows, o.index_select(0, bucket.outputs))
    return out


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


class SDPAttention(DotProductAttention):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Flash / memory-efficient kernels on GPU, an exact math kernel on CPU, GQA without materialising
    repeated K/V, causal, bottom-right causal (decoding with a KV cache) and packed (THD) rows
    (causal attention within each sequence: ``packed_causal_attention``).

    Context parallelism (Megatron's ``all_gather`` CP communication type): each rank holds the
    zigzag chunks r and 2cp-1-r of every sequence; K and V are all-gathered over the CP group
    (the backward reduce-scatters their gradients) and the mask is the causal rule in global
    positions. Megatron's local DotProductAttention refuses cp > 1, so the parent is built with a
    copy of the config that says cp = 1.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.config = config
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        self.context_parallel = self.cp_group is not None  # off while decoding (see below)

    def _gather_keys(self, key, value, packed_seq_params):
        """K and V of every CP rank along the sequence dim, and masks' global positions."""
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        # One collective for K and V together: two would each reduce-scatter in the backward,
        # and autograd may run those two backwards in a different order on different ranks
        # (mismatched exchanges of same-shaped tensors: silently wrong gradients).
        kv = torch.cat(dist_nn.all_gather(torch.stack([key, value]).contiguous(),
                                          group=self.cp_group), dim=1)
        keys, values = kv[0], kv[1]
        device = key.device
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.long)
            q_pos = packed_zigzag_index(cu, cp, rank).to(device)
            k_pos = torch.cat([packed_zigzag_index(cu, cp, r).to(device) for r in range(cp)])
            seg = lambda pos: torch.searchsorted(cu[1:], pos, right=True)  # noqa: E731
            return keys, values, zigzag_causal_mask(q_pos, k_pos, seg(q_pos), seg(k_pos))
        total = key.shape[0] * cp
        q_pos = zigzag_index(total, cp, rank, device=device)
        k_pos = torch.cat([zigzag_index(total, cp, r, device=device) for r in range(cp)])
        return keys, values, zigzag_causal_mask(q_pos, k_pos)

    def forward(self, query, key, value, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention bias")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # [T, N, D] -> [T, 1, N, D]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        mask, is_causal = None, False
        if self.context_parallel:
            if attention_mask is not None:
                raise ValueError("context-parallel attention takes no attention mask (causal only)")
            key, value, mask = self._gather_keys(key, value, packed_seq_params if thd else None)
        sq, b, n, d = query.shape
        sk, g = key.shape[0], key.shape[2]
        q_BNSD = query.permute(1, 2, 0, 3)
        k_BGSD = key.permute(1, 2, 0, 3)
        v_BGSD = value.permute(1, 2, 0, 3)

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        dropout = self.attention_dropout.p if self.training else 0.0
        if thd and not self.context_parallel:
            out_TND = packed_causal_attention(query[:, 0], key[:, 0], value[:, 0],
                                              _plan_of(packed_seq_params, query.device),
                                              scale=self.softmax_scale, dropout_p=dropout)
            return out_TND.reshape(sq, n * d)
        if (sq == 1 and not self.context_parallel and query.device.type == "cpu"
                and query.dtype in FULL_PRECISION and dropout == 0.0):
            # one query (decoding): it sees every key but the masked ones, whatever the mask type
            masked = None if attention_mask is None else attention_mask.bool().expand(b, 1, 1, sk)
            out_BN1D = decode_attention(q_BNSD, k_BGSD, v_BGSD, masked, self.softmax_scale)
            out = out_BN1D.permute(2, 0, 1, 3).reshape(sq, b, n * d)
            return out.squeeze(1) if thd else out
        if self.context_parallel:
            pass  # the mask in global positions, from _gather_keys
        elif attention_mask is not None:
            mask = ~attention_mask.bool()  # Megatron: True = masked out; SDPA: True = attend
        elif mask_type == AttnMaskType.causal:
            if sq == sk:
                is_causal = True
            else:  # queries are the last sq positions of sk (decoding with a KV cache)
                mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)

        out_BNSD = F.scaled_dot_product_attention(
            q_BNSD, k_BGSD, v_BGSD, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
            scale=self.softmax_scale, enable_gqa=(n != g))
        out = out_BNSD.permute(2, 0, 1, 3).reshape(sq, b, n * d)
        return out.squeeze(1) if thd else out


class RotatedCacheSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` whose static-batching KV cache holds keys already rotated.

    megatron-core 0.16 stores each step's keys unrotated and, after reading the cache back, rotates
    all ``[0, end)`` cached keys again in every decoding step of every layer (``k_pos_emb[:end]``):
    work and memory traffic that grow with the decoded length (on the compute shape of
    ``benchmarks/rl_step_vs_trl.py``, the roll alone: 0.6 ms for 33 cached positions of 128 rows
    against 30 us for the step's new key). Here the new keys are rotated at their own positions
    before they are stored, and the read-back keys are not rotated again. RoPE is elementwise per
    position, so the cached keys are the same values, bit for bit. Everything else (training,
    packed rows, dynamic batching, flash decoding) goes to the parent unchanged."""

    def _adjust_key_value_for_inference(self, inference_context, query, key, value,
                                        rotary_pos_emb, *args, inference_params=None, **kwargs):
        icx = inference_context if inference_context is not None else inference_params
        if (icx is None or not icx.is_static_batching() or rotary_pos_emb is None
                or self.config.flash_decode):
            return super()._adjust_key_value_for_inference(
                icx, query, key, value, rotary_pos_emb, *args, **kwargs)
        start = icx.sequence_len_offset
        key = megatron_attention.apply_rotary_pos_emb(
            key, rotary_pos_emb[1][start:start + key.size(0)], config=self.config,
            mscale=megatron_attention._yarn_get_concentration_factor_from_config(self.config),
            cp_group=self.pg_collection.cp)
        query, key, value, (q_pos_emb, _), mask_type, block_table = (
            super()._adjust_key_value_for_inference(icx, query, key, value, rotary_pos_emb,
                                                    *args, **kwargs))
        return query, key, value, (q_pos_emb, None), mask_type, block_table


@contextlib.contextmanager
def context_parallel_disabled(gpt):
    """Run ``gpt`` on whole sequences on every context-parallel rank (decoding with a KV cache,
    which feeds one token per row and cannot be split): attention stops gathering over the CP
    group and RoPE stops slicing its table for this rank. A no-op when the model has no CP."""
    attentions = [m for m in gpt.modules() if isinstance(m, SDPAttention) and m.context_parallel]
    ropes = [m for m in gpt.modules() if isinstance(m, RotaryEmbedding)]
    saved = [r.cp_group for r in ropes]
    if not attentions:
        if gpt.config.context_parallel_size > 1:  # Transformer Engine's CP attention
            raise NotImplementedError(
                "parallel.cp>1 with rollout.engine=local decodes whole rows, which Transformer "
                "Engine's context-parallel attention cannot; use rollout.engine=sglang, or the "
                "SDPA attention (an image without transformer_engine)")
        yield
        return
    # RotaryEmbedding.forward is lru_cached on its arguments, not on ``cp_group``: clear it on
    # both switches so that no sliced table is served to a whole-sequence forward or vice versa.
    RotaryEmbedding.forward.cache_clear()
    for a in attentions:
        a.context_parallel = False
    for r in ropes:
        r.cp_group = None
    try:
        yield
    finally:
        RotaryEmbedding.forward.cache_clear()
        for a in attentions:
            a.context_parallel = True
        for r, group in zip(ropes, saved):
            r.cp_group = group


# ---------------------------------------------------------------------------------------------
# Unfused RoPE: cos / sin computed once per table, not per layer and tensor.
# ---------------------------------------------------------------------------------------------

def _kept(owner: torch.Tensor, key: tuple, make):
    """``make()``, kept on ``owner`` (a tensor living as long as the value is valid: RoPE's table,
    or a micro-batch's ``cu_seqlens``) under ``key``; at most 8 values per owner."""
    cache = getattr(owner, "_rope_kept", None)
    if cache is None:
        cache = owner._rope_kept = {}
    value = cache.get(key)
    if value is None:
        while len(cache) >= 8:
            cache.pop(next(iter(cache)))
        value = cache[key] = make()
    return value


def _cos_sin(freqs: torch.Tensor, dtype) -> tuple:
    """Megatron's ``(cos(freqs) * mscale).to(dtype)`` and likewise sin (mscale 1), the sin with
    its first ``rot // 2`` entries negated (``_rotate`` multiplies it with the halves swapped).
    For a view of a contiguous table that keeps its last dim whole (decoding slices it per step)
    they are views of the whole table's, made once per table, version and dtype and kept on it
    (the same values as computed on the slice: elementwise but for the sign, which goes by the
    place in the last dim)."""
    def of(t):
        sin = (torch.sin(t) * 1.0).to(dtype)
        half = sin.shape[-1] // 2
        return (torch.cos(t) * 1.0).to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), -1)

    owner = freqs if freqs._base is None else freqs._base
    if (not owner.is_contiguous() or owner.dtype != freqs.dtype
            or freqs.shape[-1] != owner.shape[-1] or freqs.stride(-1) != 1):
        return of(freqs)
    cos, sin = _kept(owner, ("table", owner.dtype, owner._version, dtype), lambda: of(owner))
    if freqs is owner:
        return cos, sin
    at = freqs.storage_offset() - owner.storage_offset()
    return (cos.as_strided(freqs.shape, freqs.stride(), at),
            sin.as_strided(freqs.shape, freqs.stride(), at))


def _packed_cos_sin(freqs: torch.Tensor, cu_seqlens: torch.Tensor, dtype) -> tuple:
    """cos / sin of Megatron's packed (THD) table without context parallelism: each sequence's
    positions from 0 (continuing its shared prefix's, when ``cu_seqlens`` carries
    ``packed_positions``), or, when the table covers every packed token, their place in the pack;
    made once per micro-batch (its ``cu_seqlens`` keeps them, with the table, so that no other
    table can take its memory and its key while they are kept)."""
    positions = getattr(cu_seqlens, "packed_positions", None)  # shared prompts (PackedRows)

    def make():
        total = int(cu_seqlens[-1])
        if positions is not None:
            packed = freqs[positions.to(freqs.device)]
        elif freqs.size(0) == total:
            packed = freqs[:total]
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            index = torch.cat([torch.arange(n) for n in lengths]).to(freqs.device)
            packed = freqs[index]
        return (freqs,) + _cos_sin(packed, dtype)

    key = ("packed", freqs.data_ptr(), freqs.dtype, tuple(freqs.shape), tuple(freqs.stride()),
           freqs._version, cu_seqlens._version, dtype)
    return _kept(cu_seqlens, key, make)[1:]


def _rotate(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused, non-interleaved rotation ``t * cos + rotate_half(t) * sin`` with
    ``rotate_half(t) = cat(-x2, x1)`` (``x1, x2 = chunk(t, 2)``), as ``t * cos + roll(t) *
    signed_sin`` (rolling by ``rot // 2`` gives ``cat(x2, x1)``, odd widths too; the signed sin
    negates the entries that meet ``x2``): the same products up to the sign, which is exact,
    summed in the same order, so the same values and gradients in two elementwise operations
    fewer; dims past the table's passed through."""
    rot = cos.shape[-1]
    if t.shape[-1] != rot:
        return torch.cat((_rotate(t[..., :rot], cos, signed_sin), t[..., rot:]), dim=-1)
    return (t * cos) + (torch.roll(t, rot // 2, dims=-1) * signed_sin)


def cache_rope_tables() -> None:
    """megatron-core's unfused RoPE (``apply_rope_fusion`` off, as this project's layer spec
    sets it) computes cos and sin of the table, and under packing builds the packed table
    sequence by sequence, in every layer for q and for k. Attention's ``apply_rotary_pos_emb``
    now takes them from a cache kept on the table (and on the micro-batch's ``cu_seqlens`` when
    packed). Everything else goes to megatron's function: fusion, interleaving, MLA, an mscale,
    context parallelism under packing, inference-mode tensors (no version counter), a table
    wider than the heads. The cache trusts in-place changes of a table to bump its version
    counter (writes through ``.data`` or by a collective do not; megatron never changes a table
    in place). Idempotent."""
    from megatron.core.transformer import attention

    if getattr(attention.apply_rotary_pos_emb, "_tables_cached", False):
        return
    original = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        if (config.apply_rope_fusion or config.rotary_interleaved or config.multi_latent_attention
                or mscale != 1.0 or freqs.requires_grad or freqs.shape[-1] > t.shape[-1]
                or torch.is_inference_mode_enabled() or freqs.is_inference()
                or (cu_seqlens is not None and (cp_group is None or cp_group.size() > 1
                                                or cu_seqlens.is_inference()))):
            if getattr(cu_seqlens, "packed_positions", None) is not None:
                raise ValueError("shared prompts (trainer.share_prompts) need the unfused RoPE "
                                 "without context parallelism; set trainer.share_prompts=false")
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                            cp_group=cp_group)
        if cu_seqlens is None:
            return _rotate(t, *_cos_sin(freqs, t.dtype))
        return _rotate(t.unsqueeze(1), *_packed_cos_sin(freqs, cu_seqlens, t.dtype)).squeeze(1)

    apply_rotary_pos_emb._tables_cached = True
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
