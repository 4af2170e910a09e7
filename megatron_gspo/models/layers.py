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

from megatron_gspo.distributed.seqshard import packed_zigzag_index, zigzag_index


class RMSNorm(torch.nn.RMSNorm):
    """RMSNorm that works under sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``; MoE with TP > 1 requires it. The
    norm itself is pointwise per token, so only its weight needs the ``sequence_parallel`` mark that
    makes ``finalize_model_grads`` sum its gradient over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)



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


def plan_of(packed_seq_params, device) -> list:
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


def attend_buckets(q_TND, k_TGD, v_TGD, buckets, out_TND, *, scale: float,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of the packed row's ``buckets`` through ``scaled_dot_product_attention``,
    written into ``out`` (each bucket right-padded to its longest sequence; ``packed_causal_
    attention``); returns ``out``."""
    n, g = q_TND.shape[1], k_TGD.shape[1]
    for bucket in buckets:
        b, m = bucket.index.shape  # (gathers and writes by index_select / index_copy: their
        q, k, v = (t.index_select(0, bucket.keys).view(b, m, *t.shape[1:]).permute(0, 2, 1, 3)
                   for t in (q_TND, k_TGD, v_TGD))  # backwards are index_add / index_select,
        o = F.scaled_dot_product_attention(  # far cheaper than advanced indexing's) [b, N, M, D]
            q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=(n != g))
        o = o.permute(0, 2, 1, 3).reshape(b * m, *q_TND.shape[1:])
        out_TND.index_copy_(0, bucket.rows, o.index_select(0, bucket.outputs))
    return out_TND


def packed_causal_attention(q_TND, k_TGD, v_TGD, plan, *, scale=None, dropout_p=0.0):
    """[T, N, D] causal attention within each sequence of a packed row (``plan``: the row's
    ``bucket_plan``).

    Sequences of similar length are attended together, right-padded to the bucket's longest:
    under the causal rule a real query never sees a key after it, so padding changes no real
    output (padded queries are dropped and get no gradient; so are the queries of a shared
    prefix ahead of a sequence, whose keys it attends to). The work is about that of the
    sequences' own lengths (sum of L^2), not the packed row's (T^2) that a block-diagonal mask
    over the whole row would cost, in a few calls instead of one per sequence. (The CPU backend
    runs short buckets as batched matmuls: ``backends.cpu.attention``.)"""
    scale = q_TND.shape[-1] ** -0.5 if scale is None else scale  # SDPA's default
    return attend_buckets(q_TND, k_TGD, v_TGD, plan, torch.empty_like(q_TND), scale=scale,
                          dropout_p=dropout_p)


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
            out_TND = self.packed_attention(query[:, 0], key[:, 0], value[:, 0],
                                            plan_of(packed_seq_params, query.device),
                                            scale=self.softmax_scale, dropout_p=dropout)
            return out_TND.reshape(sq, n * d)
        if sq == 1 and not self.context_parallel:
            # one query (decoding): it sees every key but the masked ones, whatever the mask type
            masked = None if attention_mask is None else attention_mask.bool().expand(b, 1, 1, sk)
            out_BN1D = self.one_query_attention(q_BNSD, k_BGSD, v_BGSD, masked, dropout)
            if out_BN1D is not None:
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


    def packed_attention(self, q_TND, k_TGD, v_TGD, plan, *, scale, dropout_p):
        """Packed rows' attention (a backend may run some buckets its own way)."""
        return packed_causal_attention(q_TND, k_TGD, v_TGD, plan, scale=scale,
                                       dropout_p=dropout_p)

    def one_query_attention(self, q_BN1D, k_BGSD, v_BGSD, masked_B11S, dropout_p):
        """A decoding step's attention, or None for SDPA's (a backend may have its own)."""
        return None


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
