"""The model's forward for decoding on fixed shapes, without host synchronisations
(``forward_tokens``), for ``rollout.static_decode``'s generator.

On a GPU the local engine's decoding through megatron's ``GPTModel.forward`` pays, per step,
about a thousand kernel launches and tens of host synchronisations (data-dependent shapes in the
MoE dispatch, scalar reads, a copy of every step's tokens to the host): the GPU idles while the
host catches up. ``forward_tokens`` is the same model (``StaticModel`` reads the model's own
parameters) as a fixed sequence of tensor operations on fixed shapes:

- the cache is ``[B, G, S, D]`` per layer, written at each row's position by index (no
  ``offset`` kept on the host), read whole with a mask of the positions each row may see;
- attention is two batched matmuls over all ``S`` cached positions with that mask;
- a token's routed experts are the top-k of the router's fp32 logits (megatron's rule); the
  (token, expert) pairs are grouped by a stable sort, the groups' ends found on the device by a
  search of the sorted ids, and run through the training layer's ``grouped_experts`` (two
  ``grouped_mm`` over the experts' stacked weights, groups unpadded), or, in a dtype
  ``grouped_mm`` does not take, every expert for chunks of tokens weighted by the routing
  (memory bounded by the chunk);
- nothing reads a value on the host (``megatron_gspo.debug.count_host_syncs`` counts 0), so a
  step can be captured as a CUDA graph and compiles as one graph (``torch.compile(fullgraph=
  True)``).

It covers the layouts and options of ``unsupported``: megatron-core's local layers and Transformer
Engine's (whose norms are fused into the next linear and whose experts are grouped linears).

Legend: ``B`` rows, ``T`` positions fed per row, ``S`` cache positions, ``G`` KV groups,
``R`` query heads per group, ``D`` head dim, ``K`` top-k, ``E`` experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_gspo.models.dispatch import group_by_expert_offsets, route_top_k
from megatron_gspo.models.grouped_experts import GroupedSequentialMLP, grouped_experts
from megatron_gspo.models.rope import cos_sin, rotate


def unsupported(gpt, ctx) -> Optional[str]:
    """Why ``forward_tokens`` cannot run ``gpt`` on this rank (None when it can)."""
    c = gpt.config
    if (ctx.tp, ctx.pp, ctx.ep, ctx.cp, ctx.etp) != (1, 1, 1, 1, 1):
        return "the model is split over ranks"
    if not (gpt.pre_process and gpt.post_process) or getattr(gpt, "mtp_process", False):
        return "not the whole model"
    if (c.add_bias_linear or c.add_qkv_bias or c.rotary_interleaved or c.multi_latent_attention
            or c.attention_output_gate or gpt.position_embedding_type != "rope"
            or not c.gated_linear_unit or c.activation_func is not F.silu
            or c.activation_func_clamp_value is not None or c.glu_linear_offset
            or c.normalization != "RMSNorm" or c.qk_layernorm is False
            or c.layernorm_zero_centered_gamma or c.window_size is not None
            or getattr(c, "softmax_type", "vanilla") != "vanilla" or c.fp8
            or getattr(c, "fp4", None)):
        return "a layer option this step does not mirror"
    for layer in gpt.decoder.layers:
        mlp = layer.mlp
        if isinstance(mlp, MoELayer):
            r = mlp.router
            if (getattr(mlp, "shared_experts", None) is not None or r.score_function != "softmax"
                    or r.expert_bias is not None or c.moe_router_num_groups
                    or c.moe_expert_capacity_factor is not None or c.moe_apply_probs_on_input
                    or c.moe_router_dtype != "fp32"):
                return "an MoE option this step does not mirror"
            if _expert_weights(mlp.experts) is None:
                return "experts whose weights this step cannot read"
        elif type(mlp) is not MLP:
            return "an MLP this step does not mirror"
        fused_fc1 = None if isinstance(mlp, MoELayer) else mlp.linear_fc1
        if (_norm_weight(layer.input_layernorm, layer.self_attention.linear_qkv) is None
                or _norm_weight(layer.pre_mlp_layernorm, fused_fc1) is None):
            return "a norm whose weight this step cannot read"
    return None


def _norm_weight(norm, fused) -> Optional[torch.Tensor]:
    """A norm's weight: its own, or, where the norm is fused into the next linear (Transformer
    Engine's layer-norm linears; the norm's slot then holds an identity), that linear's
    ``layer_norm_weight``."""
    weight = getattr(norm, "weight", None)
    return weight if weight is not None else getattr(fused, "layer_norm_weight", None)


def _expert_weights(experts) -> Optional[tuple]:
    """The local experts' fc1 and fc2 weights (``[out, in]`` each): megatron's ``SequentialMLP``
    (``local_experts``) or Transformer Engine's grouped linears (``weight0``, ``weight1``, ..)."""
    if hasattr(experts, "local_experts"):
        return ([e.linear_fc1.weight for e in experts.local_experts],
                [e.linear_fc2.weight for e in experts.local_experts])
    n = getattr(experts, "num_local_experts", 0)
    fc1 = [getattr(getattr(experts, "linear_fc1", None), f"weight{i}", None) for i in range(n)]
    fc2 = [getattr(getattr(experts, "linear_fc2", None), f"weight{i}", None) for i in range(n)]
    return (fc1, fc2) if n and all(w is not None for w in fc1 + fc2) else None


@dataclass
class _Layer:
    norm1: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    proj: torch.Tensor
    norm2: torch.Tensor
    router: Optional[torch.Tensor]  # MoE: [E, H]
    fc1: torch.Tensor  # dense [2F, H]; MoE [E, H, 2F]
    fc2: torch.Tensor  # dense [H, F]; MoE [E, F, H]


class StaticModel:
    """The parameters ``forward_tokens`` reads, taken from a megatron ``GPTModel`` (views: a
    weight update in place is seen; the expert stacks and the routers' fp32 weights are copies,
    made again by ``refresh``)."""

    def __init__(self, gpt):
        c = gpt.config
        self.gpt, self.config, self.eps = gpt, c, c.layernorm_epsilon
        a = gpt.decoder.layers[0].self_attention
        self.heads, self.groups = a.num_attention_heads_per_partition, a.num_query_groups_per_partition
        self.head_dim, self.scale = a.hidden_size_per_attention_head, a.core_attention.softmax_scale
        self.top_k = c.moe_router_topk
        self.pre_softmax, self.topk_scale = c.moe_router_pre_softmax, c.moe_router_topk_scaling_factor
        # the dtypes grouped_mm takes on this device, as the layers' experts know them
        # (Transformer Engine's experts: the GPU's). Groups are not padded: a forward's
        # row-major rows need no alignment along them (only the weight gradient does).
        experts = next((lay.mlp.experts for lay in gpt.decoder.layers
                        if isinstance(lay.mlp, MoELayer)), None)
        self.grouped_dtypes = getattr(experts, "grouped_dtypes",
                                      GroupedSequentialMLP.grouped_dtypes)
        self.refresh()

    def grouped(self, x: torch.Tensor, fc1_EHO: torch.Tensor) -> bool:
        """Whether the experts of rows like ``x`` run as ``grouped_mm`` (its dtypes, 16-byte
        rows; under ``torch.compile`` bf16 only, which its traced form takes in torch 2.13)."""
        align = 16 // x.element_size()
        if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
            return False
        return ((self.grouped_dtypes is None or x.dtype in self.grouped_dtypes)
                and x.shape[-1] % align == 0 and fc1_EHO.shape[-1] % (2 * align) == 0)

    def refresh(self) -> None:
        gpt = self.gpt
        self.embedding = gpt.embedding.word_embeddings.weight
        self.final_norm = gpt.decoder.final_layernorm.weight
        self.output = (gpt.shared_embedding_or_output_weight()
                       if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight)
        self.layers = []
        for layer in gpt.decoder.layers:
            attn, mlp = layer.self_attention, layer.mlp
            if isinstance(mlp, MoELayer):
                fc1s, fc2s = _expert_weights(mlp.experts)
                # (the router computes in fp32: its weight cast once, not in every step)
                router, fused_fc1 = mlp.router.weight.float(), None
                fc1 = torch.stack([w.t() for w in fc1s])  # [E, H, 2F], one copy
                fc2 = torch.stack([w.t() for w in fc2s])  # [E, F, H]
            else:
                router, fc1, fc2 = None, mlp.linear_fc1.weight, mlp.linear_fc2.weight
                fused_fc1 = mlp.linear_fc1
            self.layers.append(_Layer(
                norm1=_norm_weight(layer.input_layernorm, attn.linear_qkv),
                qkv=attn.linear_qkv.weight,
                q_norm=attn.q_layernorm.weight, k_norm=attn.k_layernorm.weight,
                proj=attn.linear_proj.weight,
                norm2=_norm_weight(layer.pre_mlp_layernorm, fused_fc1),
                router=router, fc1=fc1, fc2=fc2))
        self.moe_layers = sum(lay.router is not None for lay in self.layers)
        experts = next((lay.fc1.shape[0] for lay in self.layers if lay.router is not None), 0)
        self.experts_E = torch.arange(experts, device=self.embedding.device)


def new_cache(model: StaticModel, rows: int, positions: int, device, dtype) -> dict:
    """Empty keys and values ``[B, G, S, D]`` per layer, and which positions hold a key."""
    shape = (rows, model.groups, positions, model.head_dim)
    return {"keys": [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers],
            "values": [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers],
            "valid": torch.zeros(rows, positions, dtype=torch.bool, device=device)}


def _norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _experts(model: StaticModel, lay: _Layer, x_NH: torch.Tensor, routes: list) -> torch.Tensor:
    k = model.top_k
    probs_NK, ids_NK = route_top_k(x_NH, lay.router, k, pre_softmax=model.pre_softmax,
                                   scale=model.topk_scale)
    routes.append(ids_NK)
    if not model.grouped(x_NH, lay.fc1):
        return _every_expert(lay, x_NH, probs_NK, ids_NK)
    n = ids_NK.shape[0]
    order, rows, offsets_E = group_by_expert_offsets(ids_NK, model.experts_E)
    x, probs = x_NH.index_select(0, rows), probs_NK.reshape(-1).index_select(0, order)
    y = grouped_experts(x, probs, None, lay.fc1, lay.fc2, group_rows=1, config=model.config,
                        offsets_E=offsets_E)
    # back to token-major (each pair once: no atomics) and each token's k outputs summed
    y = torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1)
    return y.sum(1)


EVERY_EXPERT_CHUNK = 256  # tokens per chunk of ``_every_expert``


def _every_expert(lay: _Layer, x_NH, probs_NK, ids_NK) -> torch.Tensor:
    """The experts without ``grouped_mm``: every expert on chunks of tokens, each expert's
    output weighted by its routing probability (0 where not routed); memory ``[chunk, E, 2F]``."""
    out = []
    for i in range(0, x_NH.shape[0], EVERY_EXPERT_CHUNK):
        x, ids = x_NH[i:i + EVERY_EXPERT_CHUNK], ids_NK[i:i + EVERY_EXPERT_CHUNK]
        weight_CE = torch.zeros(x.shape[0], lay.fc1.shape[0], dtype=probs_NK.dtype,
                                device=x.device).scatter_(1, ids, probs_NK[i:i + len(x)])
        a, b = torch.chunk(torch.einsum("ch,ehf->cef", x, lay.fc1).float(), 2, dim=-1)
        h = (F.silu(a) * b * weight_CE.unsqueeze(-1)).to(x.dtype)  # (fp32: no inf x 0)
        out.append(torch.einsum("cef,efh->ch", h, lay.fc2))
    return torch.cat(out)


def rope_tables(gpt, positions: int, dtype) -> tuple:
    """cos and signed sin ``[S, D]`` of the model's RoPE for ``positions`` positions."""
    cos, sin = cos_sin(gpt.rotary_pos_emb(positions)[:, 0, 0].contiguous(), dtype)
    return cos.contiguous(), sin.contiguous()


def forward_tokens(model: StaticModel, cache: dict, tokens_BT: torch.Tensor,
                   positions_BT: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor,
                   last_B: Optional[torch.Tensor] = None):
    """Feed ``T`` tokens per row at their positions (device tensors): write their keys and
    values into the cache (in place), attend to every position the row holds up to its own,
    and return the logits ``[B, V]`` of each row's fed token ``last_B`` (default: the last) and
    each MoE layer's top-k expert ids of every fed token (``[B, T, K]`` per layer)."""
    b, t = tokens_BT.shape
    n, g, d = model.heads, model.groups, model.head_dim
    r = n // g
    x = model.embedding[tokens_BT]  # [B, T, H]
    cos = cos_SD[positions_BT][:, :, None, None]  # [B, T, 1, 1, D]
    sin = sin_SD[positions_BT][:, :, None, None]
    rows_BT = torch.arange(b, device=tokens_BT.device)[:, None].expand(b, t)
    cache["valid"].index_put_((rows_BT, positions_BT),
                              torch.ones((), dtype=torch.bool, device=x.device))
    s = cache["valid"].shape[1]
    sees_BTS = cache["valid"][:, None, :] & (
        torch.arange(s, device=x.device)[None, None, :] <= positions_BT[:, :, None])
    bias = torch.zeros(sees_BTS.shape, dtype=x.dtype, device=x.device).masked_fill(
        ~sees_BTS, float("-inf"))[:, None, None]  # [B, 1, 1, T, S]
    where = _cache_index(rows_BT, positions_BT, g)
    routes = []
    for i, lay in enumerate(model.layers):
        qkv = F.linear(_norm(x, lay.norm1, model.eps), lay.qkv).view(b, t, g, r + 2, d)
        # q's and k's norms, then one rotation of both (elementwise: the same values)
        qk = rotate(torch.cat((_norm(qkv[..., :r, :], lay.q_norm, model.eps),
                               _norm(qkv[..., r:r + 1, :], lay.k_norm, model.eps)), 3), cos, sin)
        keys, values = cache["keys"][i], cache["values"][i]
        keys.index_put_(where, qk[..., r, :])
        values.index_put_(where, qkv[..., r + 1, :])
        q = qk[..., :r, :].permute(0, 2, 3, 1, 4).reshape(b, g, r * t, d)
        att = (torch.matmul(q, keys.transpose(-1, -2)) * model.scale).view(b, g, r, t, s) + bias
        o = torch.matmul(torch.softmax(att, -1).view(b, g, r * t, s), values)
        o = o.view(b, g, r, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, n * d)
        x = x + F.linear(o, lay.proj)
        h = _norm(x, lay.norm2, model.eps)
        if lay.router is not None:
            x = x + _experts(model, lay, h.reshape(b * t, -1), routes).view(b, t, -1)
        else:
            a, c = torch.chunk(F.linear(h, lay.fc1), 2, dim=-1)
            x = x + F.linear(F.silu(a) * c, lay.fc2)
    x = x[:, -1] if last_B is None else x[torch.arange(b, device=x.device), last_B]
    return (F.linear(_norm(x, model.final_norm, model.eps), model.output),
            [ids.view(b, t, -1) for ids in routes])


def _cache_index(rows_BT, positions_BT, groups: int) -> tuple:
    """Indices of ``[B, G, S, D]`` for each fed token's ``[G, D]`` key (or value)."""
    b, t = rows_BT.shape
    shape = (b, t, groups)
    return (rows_BT[..., None].expand(shape),
            torch.arange(groups, device=rows_BT.device).expand(shape),
            positions_BT[..., None].expand(shape))
