"""Hugging Face Qwen3-MoE <-> Megatron GPTModel weights, for any TP / PP / EP / expert-TP layout.

Two steps per parameter:
1. HF tensors <-> the Megatron *global* tensor (the TP=1 form): QKV interleaved per query group,
   SwiGLU ``linear_fc1`` = [gate; up], names with global layer and expert indices;
2. global tensor <-> this rank's shard: split along one dim over TP (or expert-TP), SwiGLU weights
   split gate and up separately, layers by pipeline stage, experts by expert-parallel rank.

Only copies happen, so HF -> Megatron -> HF is bitwise. Shapes: ``H`` hidden, ``V`` vocab, ``N``
heads, ``G`` query groups, ``D`` head dim, ``F`` dense FFN, ``I`` expert FFN, ``E`` experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_gspo.config import ModelConfig
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.models.hf_config import HFCheckpointError, hf_config_from_model
from megatron_gspo.models.hf_io import HFCheckpoint, ShardWriter, TensorSource


@dataclass(frozen=True)
class Rule:
    """How one Megatron global tensor relates to HF tensors and to this rank's shard."""

    hf: tuple[tuple[str, tuple], ...]  # (HF name, HF shape) pairs
    to_global: Callable[[list], torch.Tensor]
    from_global: Callable[[torch.Tensor], list]
    split_dim: Optional[int] = None  # None: replicated across the split group
    split_group: Optional[str] = None  # "tp" | "etp"
    glu: bool = False  # SwiGLU fc1: gate and up halves are split separately
    expert: bool = False


def _same(ts):
    return ts[0]


def _one(t):
    return [t]


def _qkv_rules(m: ModelConfig, p: str) -> Rule:
    n, g, d, h = m.num_attention_heads, m.num_query_groups, m.head_dim, m.hidden_size
    per = n // g

    def to_global(ts):
        q, k, v = ts
        return torch.cat([q.view(g, per * d, h), k.view(g, d, h), v.view(g, d, h)], 1).reshape(-1, h)

    def from_global(t):
        t = t.view(g, per + 2, d, h)
        return [t[:, :per].reshape(n * d, h), t[:, per].reshape(g * d, h),
                t[:, per + 1].reshape(g * d, h)]

    return Rule(((f"{p}.self_attn.q_proj.weight", (n * d, h)),
                 (f"{p}.self_attn.k_proj.weight", (g * d, h)),
                 (f"{p}.self_attn.v_proj.weight", (g * d, h))),
                to_global, from_global, split_dim=0, split_group="tp")


def _glu_rule(gate: str, up: str, ffn: int, h: int, group: str, expert: bool) -> Rule:
    return Rule(((gate, (ffn, h)), (up, (ffn, h))), lambda ts: torch.cat(ts, 0),
                lambda t: list(t.chunk(2, 0)), split_dim=0, split_group=group, glu=True,
                expert=expert)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|"
                     r"(linear_fc[12])\.weight(\d+))$")


def rule_for(global_name: str, m: ModelConfig) -> Rule:
    """The rule of one Megatron global parameter name (global layer and expert indices)."""
    h, v = m.hidden_size, m.vocab_size
    if global_name == "embedding.word_embeddings.weight":
        return Rule((("model.embed_tokens.weight", (v, h)),), _same, _one, 0, "tp")
    if global_name == "output_layer.weight":
        return Rule((("lm_head.weight", (v, h)),), _same, _one, 0, "tp")
    if global_name == "decoder.final_layernorm.weight":
        return Rule((("model.norm.weight", (h,)),), _same, _one)
    match = _LAYER.match(global_name)
    if not match:
        raise KeyError(f"no HF mapping for Megatron parameter {global_name!r}")
    layer, rest = int(match.group(1)), match.group(2)
    p = f"model.layers.{layer}"
    simple = {
        "input_layernorm.weight": (f"{p}.input_layernorm.weight", (h,)),
        "self_attention.linear_qkv.layer_norm_weight": (f"{p}.input_layernorm.weight", (h,)),
        "pre_mlp_layernorm.weight": (f"{p}.post_attention_layernorm.weight", (h,)),
        "mlp.linear_fc1.layer_norm_weight": (f"{p}.post_attention_layernorm.weight", (h,)),
        "self_attention.q_layernorm.weight": (f"{p}.self_attn.q_norm.weight", (m.head_dim,)),
        "self_attention.k_layernorm.weight": (f"{p}.self_attn.k_norm.weight", (m.head_dim,)),
        "mlp.router.weight": (f"{p}.mlp.gate.weight", (m.num_experts, h)),
    }
    if rest in simple:
        return Rule((simple[rest],), _same, _one)
    if rest == "self_attention.linear_qkv.weight":
        return _qkv_rules(m, p)
    if rest == "self_attention.linear_proj.weight":
        return Rule(((f"{p}.self_attn.o_proj.weight", (h, m.num_attention_heads * m.head_dim)),),
                    _same, _one, 1, "tp")
    if rest == "mlp.linear_fc1.weight":
        return _glu_rule(f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight",
                         m.ffn_hidden_size, h, "tp", False)
    if rest == "mlp.linear_fc2.weight":
        return Rule(((f"{p}.mlp.down_proj.weight", (h, m.ffn_hidden_size)),), _same, _one, 1, "tp")
    em = _EXPERT.match(rest)
    if em:
        expert = int(em.group(1) if em.group(1) is not None else em.group(4))
        fc = em.group(2) or em.group(3)
        e, i = f"{p}.mlp.experts.{expert}", m.moe_ffn_hidden_size
        if fc == "linear_fc1":
            return _glu_rule(f"{e}.gate_proj.weight", f"{e}.up_proj.weight", i, h, "etp", True)
        return Rule(((f"{e}.down_proj.weight", (h, i)),), _same, _one, 1, "etp", expert=True)
    if rest.startswith("mlp.shared_experts"):
        raise KeyError("the Qwen3-MoE HF format has no shared expert; set "
                       "model.shared_expert_ffn_hidden_size=0 to convert")
    raise KeyError(f"no HF mapping for Megatron parameter {global_name!r}")


def global_name(local_name: str, m: ModelConfig, ctx: ParallelContext) -> str:
    """Replace this rank's layer and expert numbers with global ones."""
    match = _LAYER.match(local_name)
    if not match:
        return local_name
    layer = ctx.pp_rank * (m.num_layers // ctx.pp) + int(match.group(1))
    rest = match.group(2)
    em = _EXPERT.match(rest)
    if em:
        per_rank = m.num_experts // ctx.ep
        if em.group(1) is not None:
            rest = (f"mlp.experts.local_experts.{ctx.ep_rank * per_rank + int(em.group(1))}."
                    f"{em.group(2)}.weight")
        else:
            rest = f"mlp.experts.{em.group(3)}.weight{ctx.ep_rank * per_rank + int(em.group(4))}"
    return f"decoder.layers.{layer}.{rest}"


def _split(rule: Rule, ctx: ParallelContext) -> tuple[int, int]:
    if rule.split_dim is None:
        return 0, 1
    return (ctx.tp_rank, ctx.tp) if rule.split_group == "tp" else (ctx.etp_rank, ctx.etp)


def to_local(rule: Rule, full: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    rank, size = _split(rule, ctx)
    if size == 1:
        return full
    if rule.glu:
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], 0)
    return full.chunk(size, rule.split_dim)[rank]


def from_pieces(rule: Rule, pieces: list) -> torch.Tensor:
    if len(pieces) == 1:
        return pieces[0]
    if rule.glu:
        halves = [p.chunk(2, 0) for p in pieces]
        return torch.cat([torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)])
    return torch.cat(pieces, rule.split_dim)


# Router state of aux-loss-free balancing (model.router_expert_bias): Qwen3-MoE's HF format has
# no such tensors. Loading leaves them at Megatron's initial zeros; exporting a model that has
# them is refused (its routing would silently change).
_ROUTER_BIAS_STATE = ("router.expert_bias", "router.local_tokens_per_expert")


def _local_params(gpt) -> dict:
    return {k: v for k, v in gpt.state_dict().items()
            if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)
            and "rotary_pos_emb" not in k and not k.endswith(_ROUTER_BIAS_STATE)}


@torch.no_grad()
def load_hf_weights(gpt, hf_dir, m: ModelConfig, ctx: ParallelContext) -> int:
    """Copy a HF Qwen3-MoE checkpoint (a directory, or a ``TensorSource``) into this rank's shard
    of ``gpt``; returns the number of tensors copied."""
    ckpt = hf_dir if isinstance(hf_dir, TensorSource) else HFCheckpoint(hf_dir)
    hf_dir = ckpt.path
    tied = ckpt.config.get("tie_word_embeddings", False) and "lm_head.weight" not in ckpt
    copied = 0
    for name, param in _local_params(gpt).items():
        rule = rule_for(global_name(name, m, ctx), m)
        hf_names = [("model.embed_tokens.weight", s) if tied and n == "lm_head.weight" else (n, s)
                    for n, s in rule.hf]
        full = rule.to_global([ckpt.get(n, s) for n, s in hf_names])
        local = to_local(rule, full, ctx)
        if local.shape != param.shape:
            raise HFCheckpointError(f"{hf_dir}: {', '.join(n for n, _ in rule.hf)} give {name} shape "
                                    f"{tuple(local.shape)}, model expects {tuple(param.shape)}")
        param.copy_(local)
        copied += 1
    return copied


def _contributes(rule: Rule, ctx: ParallelContext) -> bool:
    """One replica of each shard is enough: DP rank 0, and TP rank 0 for TP-replicated tensors."""
    if rule.expert:  # split over expert-TP, replicated over expert-DP
        return ctx.edp_rank == 0
    if ctx.dp_rank != 0 or ctx.cp_rank != 0:
        return False
    return rule.split_dim is not None or ctx.tp_rank == 0


def gather_hf_state(gpt, m: ModelConfig, ctx: ParallelContext, *,
                    bucket_bytes: int = 1 << 30) -> Optional[dict]:
    """All ranks call; rank 0 gets {HF name: host tensor} of the whole model, other ranks None
    (built bucket by bucket with ``iter_hf_buckets``)."""
    out = {}
    for bucket in iter_hf_buckets(gpt, m, ctx, bucket_bytes):
        for name, t in bucket:
            out[name] = t.to("cpu", copy=True)
    return out if ctx.rank == 0 else None


@dataclass(frozen=True)
class _Piece:
    """One rank's share of a Megatron global tensor, as the bucket plan knows it."""

    gname: str
    index: int  # shard index along the rule's split group
    owner: int  # global rank that sends it
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


def _bucket_plan(gpt, m: ModelConfig, ctx: ParallelContext, bucket_bytes: int,
                 group_of: Optional[Callable[[str], str]] = None) -> list:
    """Every rank's pieces (metadata only, exchanged once per call), grouped into buckets of
    whole global tensors of at most ``bucket_bytes`` (a larger tensor is a bucket of its own),
    in the same order on every rank. ``group_of(HF name)``: tensors with the same key never go
    to different buckets (a receiver that loads them as one tensor), a group larger than
    ``bucket_bytes`` being a bucket of its own."""
    local = []
    for name, param in _local_params(gpt).items():
        gname = global_name(name, m, ctx)
        rule = rule_for(gname, m)
        if _contributes(rule, ctx):
            local.append(_Piece(gname, _split(rule, ctx)[0], ctx.rank, tuple(param.shape),
                                param.dtype))
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, local)
    by_name: dict[str, list] = {}
    for piece in (p for part in everyone for p in part):
        by_name.setdefault(piece.gname, []).append(piece)
    groups: dict[str, list] = {}
    for gname in sorted(by_name):
        key = gname if group_of is None else group_of(rule_for(gname, m).hf[0][0])
        groups.setdefault(key, []).append(sorted(by_name[gname], key=lambda p: p.index))
    buckets, current, size = [], [], 0
    for key in sorted(groups):
        nbytes = sum(p.nbytes for pieces in groups[key] for p in pieces)
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.extend(groups[key])
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


@torch.no_grad()
def iter_hf_buckets(gpt, m: ModelConfig, ctx: ParallelContext, bucket_bytes: int, *, dst: int = 0,
                    group_of: Optional[Callable[[str], str]] = None):
    """Yield the whole model as HF-named tensors, one bucket of about ``bucket_bytes`` at a time,
    on rank ``dst`` (a list of (HF name, tensor) on the run's device); every rank iterates in
    lockstep and gets empty lists. Each bucket's shards (tensor-parallel slices, other pipeline
    stages' layers, other expert-parallel ranks' experts) come to ``dst`` in one batch of
    point-to-point transfers straight from the parameters' device; nothing else of the model is
    copied, so the extra memory of ``dst`` stays near two buckets (the received shards and the
    HF tensors made from them). Tensors may alias the parameters: read, never modify them.
    ``group_of``: see ``_bucket_plan``."""
    if m.router_expert_bias:
        raise HFCheckpointError("model.router_expert_bias=True: the Qwen3-MoE HF format has no "
                                "expert-bias tensor; export or sync weights without it")
    params = {global_name(n, m, ctx): p for n, p in _local_params(gpt).items()}
    for bucket in _bucket_plan(gpt, m, ctx, bucket_bytes, group_of):
        yield _gather_bucket(bucket, params, m, ctx, dst)  # no reference kept here


def _gather_bucket(bucket: list, params: dict, m: ModelConfig, ctx: ParallelContext,
                   dst: int) -> list:
    """One bucket's HF tensors on ``dst`` (empty elsewhere); the shards received for it are
    released on return, as is everything else but the result."""
    ops, received = [], {}
    for pieces in bucket:
        for piece in pieces:
            if ctx.rank == dst and piece.owner != dst:
                buf = torch.empty(piece.shape, dtype=piece.dtype, device=ctx.device)
                received[(piece.gname, piece.index)] = buf
                ops.append(dist.P2POp(dist.irecv, buf, piece.owner))
            elif ctx.rank == piece.owner and ctx.rank != dst:
                ops.append(dist.P2POp(dist.isend, params[piece.gname].detach().contiguous(), dst))
    if ops:
        works = dist.batch_isend_irecv(ops)
        for work in works:
            work.wait()
        del works, ops
    out = []
    if ctx.rank == dst:
        for pieces in bucket:
            gname = pieces[0].gname
            parts = [received.pop((gname, p.index)) if p.owner != dst
                     else params[gname].detach() for p in pieces]
            rule = rule_for(gname, m)
            full = from_pieces(rule, parts)
            del parts  # the received shards of this tensor go as soon as it is assembled
            for (hf_name, shape), t in zip(rule.hf, rule.from_global(full)):
                out.append((hf_name, t.reshape(shape).contiguous()))
    return out


def export_hf(gpt, m: ModelConfig, ctx: ParallelContext, out_dir: str,
              hf_config: Optional[dict] = None, *, bucket_bytes: int = 1 << 30) -> None:
    """All ranks call; rank 0 writes a HF checkpoint of the whole model to ``out_dir``, one
    safetensors shard per bucket of about ``bucket_bytes`` (``iter_hf_buckets``: the memory of
    rank 0 stays near two buckets), with an index and config.json."""
    writer = ShardWriter(out_dir) if ctx.rank == 0 else None
    for bucket in iter_hf_buckets(gpt, m, ctx, bucket_bytes):
        if writer is not None:
            writer.write(bucket)
        del bucket
    if writer is not None:
        writer.close(hf_config or hf_config_from_model(m))
    dist.barrier()
