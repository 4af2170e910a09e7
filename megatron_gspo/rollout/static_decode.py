"""Decoding without host synchronisations: a batch-major static KV cache, positions on the
device, sampling on the device, the finished flags read back every few steps.

On a GPU the local engine's decoding through megatron's ``GPTModel.forward`` pays, per step,
about a thousand kernel launches and tens of host synchronisations (data-dependent shapes in the
MoE dispatch, scalar reads, a copy of every step's tokens to the host): the GPU idles while the
host catches up. ``forward_tokens`` is the same model (this module reads the model's own
parameters) as a fixed sequence of tensor operations on fixed shapes:

- the cache is ``[B, G, S, D]`` per layer, written at each row's position by index (no
  ``offset`` kept on the host), read whole with a mask of the positions each row may see;
- attention is two batched matmuls over all ``S`` cached positions with that mask;
- a token's routed experts are the top-k of the router's fp32 logits (megatron's rule), their
  weights gathered per (token, expert) and applied as batched matmuls: no grouping, no counts;
- nothing reads a value on the host (``megatron_gspo.debug.count_host_syncs`` counts 0), so a
  step can be captured as a CUDA graph and compiles as one graph (``torch.compile(fullgraph=
  True)``).

``StaticGenerator`` drives it: the prompts' prefill, then decoding steps sampling on the device
(``sampling.sample_next`` with ``row_uniform`` of a device step counter), each row's tokens,
log-probs and routes written into device buffers; the host reads only the finished flags, every
``readback_steps`` steps, to stop early or to move the rows still decoding into a smaller batch
bucket (a power of two: rows that finish inside a bucket only stop being written). It covers the
layouts and options of ``unsupported``; the engine takes the model's forward otherwise.

Legend: ``B`` rows, ``T`` positions fed per row, ``S`` cache positions, ``G`` KV groups,
``R`` query heads per group, ``D`` head dim, ``K`` top-k, ``E`` experts, ``L`` MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_gspo.models.rope import cos_sin, rotate
from megatron_gspo.rollout.sampling import row_uniform, sample_next
from megatron_gspo.rollout.types import Sample, SamplingParams, row_seed


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
            or c.normalization != "RMSNorm" or c.qk_layernorm is False):
        return "a layer option this step does not mirror"
    for layer in gpt.decoder.layers:
        mlp = layer.mlp
        if isinstance(mlp, MoELayer):
            r = mlp.router
            if (getattr(mlp, "shared_experts", None) is not None or r.score_function != "softmax"
                    or r.expert_bias is not None or c.moe_router_num_groups
                    or c.moe_expert_capacity_factor is not None):
                return "an MoE option this step does not mirror"
        elif type(mlp) is not MLP:
            return "an MLP this step does not mirror"
    return None


@dataclass
class _Layer:
    norm1: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    proj: torch.Tensor
    norm2: torch.Tensor
    router: Optional[torch.Tensor]  # MoE: [E, H]
    fc1: torch.Tensor  # dense [2F, H]; MoE [E, 2F, H]
    fc2: torch.Tensor  # dense [H, F]; MoE [E, H, F]


class StaticModel:
    """The parameters ``forward_tokens`` reads, taken from a megatron ``GPTModel`` (views: a
    weight update in place is seen; the expert stacks are copies, made again by ``refresh``)."""

    def __init__(self, gpt):
        c = gpt.config
        self.gpt, self.eps = gpt, c.layernorm_epsilon
        a = gpt.decoder.layers[0].self_attention
        self.heads, self.groups = a.num_attention_heads_per_partition, a.num_query_groups_per_partition
        self.head_dim, self.scale = a.hidden_size_per_attention_head, a.core_attention.softmax_scale
        self.top_k = c.moe_router_topk
        self.pre_softmax, self.topk_scale = c.moe_router_pre_softmax, c.moe_router_topk_scaling_factor
        self.refresh()

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
                experts = mlp.experts.local_experts
                router = mlp.router.weight
                fc1 = torch.stack([e.linear_fc1.weight for e in experts])
                fc2 = torch.stack([e.linear_fc2.weight for e in experts])
            else:
                router, fc1, fc2 = None, mlp.linear_fc1.weight, mlp.linear_fc2.weight
            self.layers.append(_Layer(
                norm1=layer.input_layernorm.weight, qkv=attn.linear_qkv.weight,
                q_norm=attn.q_layernorm.weight, k_norm=attn.k_layernorm.weight,
                proj=attn.linear_proj.weight, norm2=layer.pre_mlp_layernorm.weight,
                router=router, fc1=fc1, fc2=fc2))
        self.moe_layers = sum(lay.router is not None for lay in self.layers)


def new_cache(model: StaticModel, rows: int, positions: int, device, dtype) -> dict:
    """Empty keys and values ``[B, G, S, D]`` per layer, and which positions hold a key."""
    shape = (rows, model.groups, positions, model.head_dim)
    return {"keys": [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers],
            "values": [torch.zeros(shape, device=device, dtype=dtype) for _ in model.layers],
            "valid": torch.zeros(rows, positions, dtype=torch.bool, device=device)}


def _norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _experts(model: StaticModel, lay: _Layer, x_NH: torch.Tensor, routes: list) -> torch.Tensor:
    logits = F.linear(x_NH.float(), lay.router.float())
    k = model.top_k
    if model.pre_softmax:
        probs_NK, ids_NK = torch.softmax(logits, -1).topk(k, -1)
    else:
        top, ids_NK = logits.topk(k, -1)
        probs_NK = torch.softmax(top, -1)
    if model.topk_scale:
        probs_NK = probs_NK * model.topk_scale
    routes.append(ids_NK)
    w1 = lay.fc1[ids_NK]  # [N, K, 2F, H]
    w2 = lay.fc2[ids_NK]  # [N, K, H, F]
    h = torch.einsum("nkfh,nh->nkf", w1, x_NH)
    a, b = torch.chunk(h, 2, dim=-1)
    h = (F.silu(a) * b * probs_NK.unsqueeze(-1)).to(x_NH.dtype)
    return torch.einsum("nkhf,nkf->nh", w2, h)


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
    cos, sin = cos_SD[positions_BT][:, :, None], sin_SD[positions_BT][:, :, None]  # [B, T, 1, D]
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
        qkv = F.linear(_norm(x, lay.norm1, model.eps), lay.qkv).view(b, t, g, (r + 2) * d)
        q = qkv[..., :r * d].reshape(b, t, n, d)
        k, v = qkv[..., r * d:(r + 1) * d], qkv[..., (r + 1) * d:]
        q = rotate(_norm(q, lay.q_norm, model.eps), cos, sin)
        k = rotate(_norm(k, lay.k_norm, model.eps), cos, sin)
        keys, values = cache["keys"][i], cache["values"][i]
        keys.index_put_(where, k)
        values.index_put_(where, v)
        q = q.view(b, t, g, r, d).permute(0, 2, 3, 1, 4).reshape(b, g, r * t, d)
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


class StaticGenerator:
    """Generation through ``forward_tokens`` (the module's docstring). ``readback_steps``: the
    host reads the finished flags every so many steps; ``compile``: the decoding step under
    ``torch.compile`` (one graph, a recompilation per batch bucket); ``cuda_graphs``: each
    bucket's decoding step captured as a CUDA graph and replayed."""

    def __init__(self, gpt, *, pad_id: int, readback_steps: int = 8, compile: bool = False,
                 cuda_graphs: bool = False):
        self.gpt, self.pad_id, self.readback = gpt, pad_id, max(1, readback_steps)
        self.compile, self.cuda_graphs = compile, cuda_graphs
        self.graphs = {}  # bucket -> (graph, static inputs, outputs) when cuda_graphs
        self.steps_run = self.readbacks_run = 0  # decoding steps and host reads, for tests

    @torch.no_grad()
    def generate(self, prompts, samples_per_prompt: int, params: SamplingParams, *,
                 first_row: int = 0, row_seeds=None, routes: bool = False) -> list[Sample]:
        params.validate()
        self.graphs = {}  # captured over this call's cache
        model = StaticModel(self.gpt)
        device, dtype = model.embedding.device, model.embedding.dtype
        n_u = len(prompts)
        b = n_u * samples_per_prompt
        lengths_U = torch.tensor([len(p) for p in prompts], device=device)
        p_len, new = max(len(p) for p in prompts), params.max_new_tokens
        s = p_len + new
        cos, sin = rope_tables(self.gpt, s, dtype)
        # the prefill: each prompt once, from position 0, right-padded
        tokens_UP = torch.full((n_u, p_len), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens_UP[i, :len(p)] = torch.tensor(list(p))
        cache = new_cache(model, n_u, s, device, dtype)
        logits, prefill_routes = forward_tokens(
            model, cache, tokens_UP.to(device), torch.arange(p_len, device=device).expand(n_u, -1),
            cos, sin, last_B=lengths_U - 1)
        cache["valid"] &= torch.arange(s, device=device)[None] < lengths_U[:, None]
        of_row = torch.arange(n_u, device=device).repeat_interleave(samples_per_prompt,
                                                                    output_size=b)
        cache = {k: ([c.index_select(0, of_row) for c in v] if isinstance(v, list)
                     else v.index_select(0, of_row)) for k, v in cache.items()}
        logits = logits.index_select(0, of_row)
        pos_B = lengths_U.index_select(0, of_row)
        if row_seeds is None and params.seed is not None:
            row_seeds = [row_seed(params.seed, first_row + r) for r in range(b)]
        seeds_B = (torch.tensor(list(row_seeds), dtype=torch.int64, device=device)
                   if row_seeds is not None and params.temperature > 0 else None)
        routes_BSLK = None
        if routes and model.moe_layers:
            per = torch.stack(prefill_routes, 2)  # [U, P, L, K]
            routes_BSLK = torch.zeros(b, s, model.moe_layers, model.top_k, dtype=torch.long,
                                      device=device)
            routes_BSLK[:, :p_len] = per.index_select(0, of_row)
        out = self._decode(model, cache, logits, pos_B, seeds_B, params, routes_BSLK, cos, sin)
        tokens_BR, logp_BR, count_B = (x.cpu() for x in out[:3])  # the one read of the results
        routes_host = out[3].cpu() if out[3] is not None else None
        stop_ids = set(params.stop_token_ids)
        samples = []
        for r in range(b):
            i = r // samples_per_prompt
            prompt, n = list(prompts[i]), int(count_B[r])
            response = tokens_BR[r, :n].tolist()
            sample_routes = None
            if routes_host is not None:
                sample_routes = routes_host[r, :max(len(prompt) + n - 1, 0)]
            samples.append(Sample(
                prompt_ids=prompt, response_ids=response, logprobs_R=logp_BR[r, :n].clone(),
                finish_reason="stop" if n and response[-1] in stop_ids else "length",
                routes_TLK=sample_routes, prompt_index=i))
        return samples

    def _decode(self, model, cache, logits, pos_B, seeds_B, params, routes_BSLK, cos, sin):
        """Sample, feed back, repeat: every row's tokens, log-probs and count in device
        buffers; the finished flags read every ``readback`` steps (and the rows still
        decoding moved into a smaller bucket when they fit one half as large)."""
        b, new, device = pos_B.shape[0], params.max_new_tokens, pos_B.device
        tokens_BR = torch.full((b, new), self.pad_id, dtype=torch.long, device=device)
        logp_BR = torch.zeros(b, new, device=device)
        count_B = torch.zeros(b, dtype=torch.long, device=device)
        finished_B = torch.zeros(b, dtype=torch.bool, device=device)
        stop = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
        rows = torch.arange(b, device=device)  # the batch's rows, in its order
        step_t = torch.zeros((), dtype=torch.long, device=device)
        for step in range(new):
            uniform = None if seeds_B is None else row_uniform(seeds_B.index_select(0, rows),
                                                               step_t)
            token, logp = sample_next(logits, params, uniform_B=uniform)
            live = ~finished_B.index_select(0, rows)
            token = torch.where(live, token, self.pad_id)
            tokens_BR.index_put_((rows, step_t.expand_as(rows)), token)
            logp_BR.index_put_((rows, step_t.expand_as(rows)), torch.where(live, logp, 0.0))
            count_B.index_add_(0, rows, live.long())
            if stop.numel():
                finished_B.index_put_((rows,), finished_B.index_select(0, rows)
                                      | torch.isin(token, stop))
            step_t += 1
            if step == new - 1:
                break
            if (step + 1) % self.readback == 0:
                left = int((~finished_B).sum())  # the host's read, every few steps
                self.readbacks_run += 1
                if left == 0:
                    break
                bucket = _bucket(left)
                if bucket <= len(rows) // 2:
                    keep = torch.argsort(finished_B.index_select(0, rows).to(torch.uint8),
                                         stable=True)[:bucket]
                    rows, token, pos_B = rows[keep], token[keep], pos_B[keep]
                    cache = {k: ([c.index_select(0, keep) for c in v] if isinstance(v, list)
                                 else v.index_select(0, keep)) for k, v in cache.items()}
            logits, step_routes = self._step(model, cache, token, pos_B, cos, sin)
            self.steps_run += 1
            if routes_BSLK is not None:  # the routes of the position fed
                routes_BSLK.index_put_((rows, pos_B), torch.stack(step_routes, 2)[:, 0])
            pos_B = torch.where(finished_B.index_select(0, rows), pos_B,
                                (pos_B + 1).clamp(max=cache["valid"].shape[1] - 1))
        return tokens_BR, logp_BR, count_B, routes_BSLK

    def _step(self, model, cache, token_B, pos_B, cos, sin):
        fn = self._compiled() if self.compile else forward_tokens
        if not self.cuda_graphs:
            return fn(model, cache, token_B[:, None], pos_B[:, None], cos, sin)
        key = (len(token_B), id(cache["valid"]))
        if key not in self.graphs:
            self.graphs = {k: v for k, v in self.graphs.items() if k[1] == key[1]}
            self.graphs[key] = _capture(fn, model, cache, token_B, pos_B, cos, sin)
        graph, static_token, static_pos, out = self.graphs[key]
        static_token.copy_(token_B)
        static_pos.copy_(pos_B)
        graph.replay()
        return out

    def _compiled(self):
        if not hasattr(self, "_compiled_step"):
            self._compiled_step = torch.compile(forward_tokens, fullgraph=True, dynamic=False)
        return self._compiled_step


def _capture(fn, model, cache, token_B, pos_B, cos, sin):
    """The decoding step of this bucket as a CUDA graph over static inputs (torch.cuda.graphs:
    warm-up on a side stream, then capture); its replay writes the cache in place and refills
    the returned logits and routes. The warm-up's cache writes are the step's own (the same
    token at the same position)."""
    static_token, static_pos = token_B.clone(), pos_B.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(model, cache, static_token[:, None], static_pos[:, None], cos, sin)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(model, cache, static_token[:, None], static_pos[:, None], cos, sin)
    return graph, static_token, static_pos, out


def _bucket(rows: int) -> int:
    """The smallest power of two holding ``rows``."""
    return 1 << max(0, (rows - 1).bit_length())
