"""The local engine's forwards (the prefill and each decoding step), written against the megatron
model's own parameters and static KV cache, for a model that lives whole on one CPU rank.

A decoding step feeds one token per row, and at the sizes the in-process engine runs on CPU its
cost is mostly megatron-core's per-module Python (wrappers, checks, the token dispatcher's
permutations, the router's routing-map bookkeeping), not arithmetic: one step of 128 rows at 12
cached positions took 6.3-6.5 ms through ``GPTModel.forward`` against 3.3-3.6 ms here at the tiny
shape of ``benchmarks/rl_step_vs_trl.py``, 24.0 against 18.7 ms at its compute shape (logits
within 7e-7). The same operations in the same order as the modules (RMSNorms, the fused QKV
projection split per KV group, q / k norms, RoPE at the step's position, the key stored rotated as
``layers.RotatedCacheSelfAttention`` stores it, ``layers.decode_attention``, the output
projection, the router's fp32 logits, top-k and softmax as megatron's
``topk_routing_with_score_function``, the grouped experts over generation's cached weight stacks,
the residual adds), without the modules around them.

The prefill (each prompt once, ``T`` positions, causal with the left padding hidden) runs the
same way, its attention through ``layers.decode_attention`` too: one generation of the compute
shape 0.554 against 0.569 s with the model's forward for the prefill alone, tiny 0.046 against
0.050 s.

``unsupported`` names what this step does not cover; the engine then runs the model's own
forward (every layout that splits the model over ranks: TP, EP, expert TP, PP, CP; shared
experts, sigmoid routing, expert bias, grouped top-k, capacity, biases, Transformer Engine's
modules, GPU).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_gspo.backends.cpu.attention import decode_attention
from megatron_gspo.models.dispatch import group_by_expert, route_top_k
from megatron_gspo.models.grouped_experts import GroupedSequentialMLP
from megatron_gspo.models.layers import RMSNorm, RotatedCacheSelfAttention, SDPAttention
from megatron_gspo.models.rope import cos_sin, rotate


def unsupported(gpt, ctx) -> Optional[str]:
    """Why ``decode_step`` cannot run ``gpt`` on this rank (None when it can)."""
    c = gpt.config
    if ctx.device.type != "cpu":
        return "not on CPU"
    if (ctx.tp, ctx.pp, ctx.ep, ctx.cp, ctx.etp) != (1, 1, 1, 1, 1):
        return "the model is split over ranks"
    if not (gpt.pre_process and gpt.post_process) or getattr(gpt, "mtp_process", False):
        return "not the whole model"
    if (c.add_bias_linear or c.add_qkv_bias or c.rotary_interleaved or c.apply_rope_fusion
            or c.multi_latent_attention or c.attention_output_gate or c.no_rope_freq
            or c.fp32_residual_connection or c.apply_residual_connection_post_layernorm
            or gpt.position_embedding_type != "rope"
            or not c.gated_linear_unit or c.activation_func is not F.silu
            or c.activation_func_clamp_value is not None or c.glu_linear_offset):
        return "a layer option this step does not mirror"
    norms = [gpt.decoder.final_layernorm]
    for layer in gpt.decoder.layers:
        attn, mlp = layer.self_attention, layer.mlp
        norms += [layer.input_layernorm, layer.pre_mlp_layernorm, attn.q_layernorm,
                  attn.k_layernorm]
        if type(attn) is not RotatedCacheSelfAttention or not isinstance(attn.core_attention,
                                                                          SDPAttention):
            return "not the local spec's attention"
        if isinstance(mlp, MoELayer):
            r = mlp.router
            grouped = isinstance(mlp.experts, GroupedSequentialMLP) and mlp.experts._grouped_ok(
                torch.empty(1, c.hidden_size, dtype=c.params_dtype))  # grouped_mm's widths
            if (getattr(mlp, "shared_experts", None) is not None or not grouped
                    or (c.moe_router_dtype != "fp32" and c.params_dtype != torch.float32)
                    or r.score_function != "softmax" or r.expert_bias is not None
                    or c.moe_router_num_groups or c.moe_expert_capacity_factor is not None
                    or c.moe_input_jitter_eps is not None or c.moe_router_force_load_balancing
                    or r.routing_type == "sinkhorn"):
                return "an MoE option this step does not mirror"
        elif type(mlp) is not MLP:
            return "an MLP this step does not mirror"
    if not all(isinstance(n, RMSNorm) for n in norms):
        return "a norm other than the local spec's RMSNorm"
    return None


def _norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


def _routed_experts(mlp: MoELayer, x_BH: torch.Tensor, k: int, routes: list) -> torch.Tensor:
    """megatron's router (fp32 logits; softmax then top-k, or top-k then softmax over the k), the
    rows grouped by expert through the layer's experts and combined; the rows' top-k ids appended
    to ``routes``."""
    c = mlp.config
    probs_BK, ids_BK = route_top_k(x_BH, mlp.router.weight, k, pre_softmax=c.moe_router_pre_softmax,
                                   scale=c.moe_router_topk_scaling_factor)
    routes.append(ids_BK)
    order, rows, counts = group_by_expert(ids_BK, c.num_moe_experts)
    out, _ = mlp.experts(x_BH.index_select(0, rows),  # the layer's own experts (cached stacks)
                         counts, probs_BK.flatten().index_select(0, order))
    return torch.zeros_like(x_BH).index_add_(0, rows, out)


def _dense_mlp(mlp: MLP, x_BH: torch.Tensor) -> torch.Tensor:
    h = F.linear(x_BH, mlp.linear_fc1.weight)
    a, b = torch.chunk(h, 2, dim=-1)
    return F.linear(F.silu(a) * b, mlp.linear_fc2.weight)


def _cache(icx, layer, b_d: tuple, like: torch.Tensor):
    """This layer's static KV cache buffers, made as megatron's attention makes them
    ([max positions, max rows, groups, head dim]) when the prefill runs here."""
    if layer.layer_number not in icx.key_value_memory_dict:
        shape = (icx.max_sequence_length, icx.max_batch_size) + b_d
        icx.key_value_memory_dict[layer.layer_number] = (like.new_empty(shape),
                                                         like.new_empty(shape))
    return icx.key_value_memory_dict[layer.layer_number]


def decode_step(gpt, icx, tokens_BT: torch.Tensor, offset: int, masked_B1TS, freqs_S11D):
    """Logits ``[B, 1, V]`` at the last of ``T`` tokens per row fed at positions ``offset`` ..
    ``offset + T - 1`` (the cache holds ``offset`` positions of these rows; ``masked``: True at
    hidden keys), and the top-k expert ids per MoE layer of every token fed, in megatron's
    ``[s, b]`` order. Writes the tokens' keys and values into the cache (making it at the
    prefill), as the model's forward does. ``T`` is 1 when decoding, the padded prompt length
    at the prefill. Call inside ``cached_expert_weights``."""
    b, t = tokens_BT.shape
    x = gpt.embedding.word_embeddings.weight.index_select(0, tokens_BT.t().reshape(-1))  # [T*B, H]
    cos, sin = cos_sin(freqs_S11D[offset:offset + t], x.dtype)  # [T, 1, 1, D]
    routes = []
    for layer in gpt.decoder.layers:
        attn = layer.self_attention
        g, d = attn.num_query_groups_per_partition, attn.hidden_size_per_attention_head
        n = attn.num_attention_heads_per_partition
        qkv = F.linear(_norm(x, layer.input_layernorm), attn.linear_qkv.weight)
        qkv = qkv.view(t, b, g, (n // g + 2) * d)  # per group: its query heads, key, value
        q = qkv[..., :n // g * d].reshape(t, b, n, d)
        k, v = qkv[..., n // g * d:(n // g + 1) * d], qkv[..., (n // g + 1) * d:]
        q = rotate(_norm(q, attn.q_layernorm), cos, sin)
        k = rotate(_norm(k, attn.k_layernorm), cos, sin)
        keys, values = _cache(icx, layer, (g, d), k)
        keys[offset:offset + t, :b] = k
        values[offset:offset + t, :b] = v
        k_BGSD = keys[:offset + t, :b].permute(1, 2, 0, 3)
        v_BGSD = values[:offset + t, :b].permute(1, 2, 0, 3)
        o = decode_attention(q.permute(1, 2, 0, 3), k_BGSD, v_BGSD, masked_B1TS,
                             attn.core_attention.softmax_scale)
        x = x + F.linear(o.permute(2, 0, 1, 3).reshape(t * b, n * d), attn.linear_proj.weight)
        h = _norm(x, layer.pre_mlp_layernorm)
        if isinstance(layer.mlp, MoELayer):
            x = x + _routed_experts(layer.mlp, h, layer.mlp.router.topk, routes)
        else:
            x = x + _dense_mlp(layer.mlp, h)
    x = _norm(x[(t - 1) * b:], gpt.decoder.final_layernorm)  # the last position's rows
    logits = F.linear(x, gpt.shared_embedding_or_output_weight()
                      if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight)
    return logits.unsqueeze(1), routes
