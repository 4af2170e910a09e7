"""SGLang's own parameter layout of a Qwen3-MoE model, for weight updates that send each server
TP rank only its shards (``/update_weights_from_tensor`` with ``load_format: "direct"``).

With ``load_format: null`` SGLang's ``load_weights`` takes full HF tensors and every TP rank cuts
its slice, so each rank must receive the whole model. With ``"direct"`` (sglang 0.5.15,
``ModelRunner._model_load_weights_direct``) rank i looks each name up in its
``named_parameters()`` and copies the tensor in as it is (``default_weight_loader``: sizes
asserted, dtype converted by ``copy_``); a wrong name or size fails the call. So the payload of
rank i must hold exactly rank i's parameters, in SGLang's names and shapes. Per TP rank ``r`` of
``tp`` (attention TP = ``tp``; the MoE layers split into ``ep`` expert-parallel groups of
``moe_tp = tp // ep`` ranks: ``moe_tp_rank = r % moe_tp``, ``ep_rank = r // moe_tp``):

- ``model.embed_tokens.weight``, ``lm_head.weight`` (``VocabParallelEmbedding``,
  ``ParallelLMHead``): the vocabulary padded with zero rows to a multiple of 64, rows
  ``[r * Vp / tp, (r + 1) * Vp / tp)``; the LM head is never tied in SGLang's Qwen3-MoE.
- ``self_attn.qkv_proj.weight`` (``QKVParallelLinear``): rank r's query heads, then its key
  heads, then its value heads, stacked on dim 0; with ``tp >= num_kv_heads`` each KV head is
  replicated on ``tp / num_kv_heads`` consecutive ranks.
- ``self_attn.o_proj.weight`` (``RowParallelLinear``): columns of rank r's heads.
- ``mlp.experts.w13_weight`` ``[local experts, 2 * I / moe_tp, H]`` (``FusedMoE``, unquantized,
  Triton runner): per expert, rank r's chunk of ``gate_proj`` rows then the same chunk of
  ``up_proj`` rows; ``mlp.experts.w2_weight`` ``[local experts, H, I / moe_tp]``: that chunk of
  ``down_proj``'s columns; local experts are the contiguous block of the EP rank (SGLang's
  default "trivial" expert placement, no redundant experts).
- Dense layers (``mlp_only_layers``), in the layout of SGLang's ``Qwen2MoeMLP``:
  ``mlp.gate_up_proj.weight`` (rank r's gate rows then its up rows) and ``mlp.down_proj.weight``
  (columns). SGLang 0.5.15's Qwen3-MoE itself makes every layer sparse, so a checkpoint with
  dense layers does not load there by any format; the layout is kept for the test server.
- Norms and the router (``mlp.gate.weight``, ``ReplicatedLinear``): whole, on every rank.

The layout is that of the default MoE runner on Hopper GPUs; SGLang picks other expert layouts
for other backends (flashinfer TRT-LLM on Blackwell reorders gate / up and blocks the weights,
the ``triton_kernel`` runner transposes them): use ``rollout.tensor_sync_format=hf`` there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

from megatron_gspo.config import ModelConfig


VOCAB_PADDING = 64  # sglang's DEFAULT_VOCAB_PADDING_SIZE

_ATTN = re.compile(r"^(model\.layers\.\d+)\.self_attn\.([qkv])_proj\.weight$")
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_DENSE = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate|up|down)_proj\.weight$")


def param_of(hf_name: str) -> str:
    """The SGLang parameter that the HF tensor ``hf_name`` is part of."""
    m = _ATTN.match(hf_name)
    if m:
        return f"{m.group(1)}.self_attn.qkv_proj.weight"
    m = _EXPERT.match(hf_name)
    if m:
        return f"{m.group(1)}.mlp.experts.{'w2' if m.group(3) == 'down' else 'w13'}_weight"
    m = _DENSE.match(hf_name)
    if m:
        return f"{m.group(1)}.mlp.{'down' if m.group(2) == 'down' else 'gate_up'}_proj.weight"
    return hf_name


@dataclass(frozen=True)
class ServerLayout:
    """An SGLang server's parallel sizes (``--tp-size``, ``--ep-size``) for model ``m``."""

    m: ModelConfig
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        m, tp, ep, kv = self.m, self.tp, self.ep, self.m.num_query_groups

        def need(ok: bool, why: str) -> None:
            if not ok:
                raise ValueError(f"SGLang server layout: {why}")

        need(tp >= 1 and ep >= 1 and tp % ep == 0, f"tp={tp} must be a multiple of ep={ep}")
        need(m.num_attention_heads % tp == 0,
             f"{m.num_attention_heads} attention heads do not split over tp={tp}")
        need((tp % kv == 0) if tp >= kv else (kv % tp == 0),
             f"{kv} KV heads do not split over (or replicate to) tp={tp}")
        need(m.num_experts % ep == 0, f"{m.num_experts} experts do not split over ep={ep}")
        need(m.moe_ffn_hidden_size % self.moe_tp == 0,
             f"expert width {m.moe_ffn_hidden_size} does not split over moe_tp=tp/ep")
        need(all(m.moe_layer_pattern) or m.ffn_hidden_size % tp == 0,
             f"dense width {m.ffn_hidden_size} does not split over tp={tp}")
        need(self.vocab_padded % tp == 0,
             f"padded vocabulary {self.vocab_padded} does not split over tp={tp}")

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def vocab_padded(self) -> int:
        return -(-self.m.vocab_size // VOCAB_PADDING) * VOCAB_PADDING

    def rank_shards(self, hf: Mapping[str, torch.Tensor], rank: int) -> list[tuple[str, torch.Tensor]]:
        """TP rank ``rank``'s SGLang parameters made from the HF tensors ``hf`` (one weight-sync
        bucket: every HF tensor of a parameter must be in it, see ``param_of``), as new
        contiguous tensors (a serialized view would carry its whole storage)."""
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in hf.items():
            groups.setdefault(param_of(name), {})[name] = t
        return [(p, self._shard(p, parts, rank)) for p, parts in groups.items()]

    def _shard(self, param: str, parts: Mapping[str, torch.Tensor], r: int) -> torch.Tensor:
        m, tp = self.m, self.tp
        prefix = param.rsplit(".", 3)[0] if ".layers." in param else ""

        def need(name):
            if name not in parts:
                raise ValueError(f"SGLang parameter {param}: {name} is not in the same bucket")
            return parts[name]

        if param in ("model.embed_tokens.weight", "lm_head.weight"):
            full, per = need(param), self.vocab_padded // tp
            out = full.new_zeros(per, full.shape[1])
            rows = full[r * per:min((r + 1) * per, m.vocab_size)]
            out[:rows.shape[0]] = rows
            return out
        if param.endswith("self_attn.qkv_proj.weight"):
            d, kv = m.head_dim, m.num_query_groups
            heads = m.num_attention_heads // tp
            q = need(f"{prefix}.self_attn.q_proj.weight")[r * heads * d:(r + 1) * heads * d]
            if tp >= kv:
                first, count = r // (tp // kv), 1
            else:
                first, count = r * (kv // tp), kv // tp
            k = need(f"{prefix}.self_attn.k_proj.weight")[first * d:(first + count) * d]
            v = need(f"{prefix}.self_attn.v_proj.weight")[first * d:(first + count) * d]
            return torch.cat([q, k, v], 0)
        if param.endswith("self_attn.o_proj.weight"):
            return need(param).chunk(tp, 1)[r].clone(memory_format=torch.contiguous_format)
        if param.endswith("mlp.gate_up_proj.weight"):
            gate, up = (need(f"{prefix}.mlp.{w}_proj.weight").chunk(tp, 0)[r] for w in ("gate", "up"))
            return torch.cat([gate, up], 0)
        if param.endswith("mlp.down_proj.weight"):
            return need(param).chunk(tp, 1)[r].clone(memory_format=torch.contiguous_format)
        if param.endswith(("mlp.experts.w13_weight", "mlp.experts.w2_weight")):
            local = m.num_experts // self.ep
            first, k = (r // self.moe_tp) * local, r % self.moe_tp
            width = m.moe_ffn_hidden_size // self.moe_tp
            cols = slice(k * width, (k + 1) * width)
            e = f"{prefix}.mlp.experts"
            if param.endswith("w2_weight"):
                return torch.stack([need(f"{e}.{i}.down_proj.weight")[:, cols]
                                    for i in range(first, first + local)])
            return torch.stack([torch.cat([need(f"{e}.{i}.gate_proj.weight")[cols],
                                           need(f"{e}.{i}.up_proj.weight")[cols]], 0)
                                for i in range(first, first + local)])
        return need(param).clone(memory_format=torch.contiguous_format)
