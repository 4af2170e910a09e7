"""Local (non-Transformer-Engine) layer pieces for the Qwen3-MoE layer spec.

Shapes: ``S`` sequence, ``B`` batch, ``N`` attention heads on this rank, ``G`` query groups on this
rank, ``D`` head dim, ``T`` packed tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class RMSNorm(torch.nn.RMSNorm):
    """RMSNorm that works under sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``; MoE with TP > 1 requires it. The
    norm itself is pointwise per token, so only its weight needs the ``sequence_parallel`` mark that
    makes ``finalize_model_grads`` sum its gradient over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


def packed_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T, T] bool mask (True = may attend) for sequences packed back to back (THD layout)."""
    positions = torch.arange(total, device=cu_seqlens.device)
    segment_T = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
    same = segment_T[:, None] == segment_T[None, :]
    return same & (positions[None, :] <= positions[:, None])


class SDPAttention(DotProductAttention):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Flash / memory-efficient kernels on GPU, an exact math kernel on CPU, GQA without materialising
    repeated K/V, causal, bottom-right causal (decoding with a KV cache) and packed (THD) masks.
    """

    def forward(self, query, key, value, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention bias")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # [T, N, D] -> [T, 1, N, D]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        sq, b, n, d = query.shape
        sk, g = key.shape[0], key.shape[2]
        q_BNSD = query.permute(1, 2, 0, 3)
        k_BGSD = key.permute(1, 2, 0, 3)
        v_BGSD = value.permute(1, 2, 0, 3)

        mask, is_causal = None, False
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if thd:
            mask = packed_causal_mask(packed_seq_params.cu_seqlens_q, sq)
        elif attention_mask is not None:
            mask = ~attention_mask.bool()  # Megatron: True = masked out; SDPA: True = attend
        elif mask_type == AttnMaskType.causal:
            if sq == sk:
                is_causal = True
            else:  # queries are the last sq positions of sk (decoding with a KV cache)
                mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)

        dropout = self.attention_dropout.p if self.training else 0.0
        out_BNSD = F.scaled_dot_product_attention(
            q_BNSD, k_BGSD, v_BGSD, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
            scale=self.softmax_scale, enable_gqa=(n != g))
        out = out_BNSD.permute(2, 0, 1, 3).reshape(sq, b, n * d)
        return out.squeeze(1) if thd else out
