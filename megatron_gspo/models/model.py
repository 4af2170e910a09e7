"""Builds a Megatron-core ``GPTModel`` shaped like Qwen3-MoE for one rank of a parallel layout."""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_gspo.backends import Backend, backend_for
from megatron_gspo.config import BackendConfig, ModelConfig, invalid
from megatron_gspo.distributed.parallel import ParallelContext
from megatron_gspo.models import rope, router_losses, te
from megatron_gspo.models.dispatch import use_sort_dispatch
from megatron_gspo.models.grouped_experts import compile_grouped_experts
from megatron_gspo.models.layers import RotatedCacheSelfAttention


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_config(model: ModelConfig, ctx: ParallelContext, *,
                       backend: Optional[Backend] = None, **overrides):
    """Megatron ``TransformerConfig`` for ``model`` under layout ``ctx``, with ``backend``'s
    choices (default: the device's)."""
    dtype = _DTYPES[model.params_dtype]
    backend = backend or backend_for(ctx.device)
    moe = {}
    if model.is_moe:
        moe = dict(
            num_moe_experts=model.num_experts,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_router_topk=model.top_k,
            moe_router_score_function=model.router_score_function,
            # Megatron's "softmax after top-k" equals HF's normalised top-k probabilities;
            # "pre-softmax" (softmax over all experts, then top-k) equals norm_topk_prob=False.
            moe_router_pre_softmax=not model.norm_topk_prob,
            # Always the aux-loss router: the coefficient (0 = off) is set per phase at run time
            # (megatron_gspo.router_losses); the warm-up starts with the model's own.
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=model.aux_loss_coeff,
            moe_router_enable_expert_bias=model.router_expert_bias,
            moe_router_bias_update_rate=model.router_bias_update_rate,
            moe_router_dtype="fp32",
            moe_layer_freq=model.moe_layer_pattern,
            moe_token_dispatcher_type=backend.token_dispatcher,
            moe_grouped_gemm=te.use_te_spec(ctx.device.type),
            moe_permute_fusion=False,
            moe_shared_expert_intermediate_size=model.shared_expert_ffn_hidden_size or None,
        )
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=ctx.tp,
        pipeline_model_parallel_size=ctx.pp,
        expert_model_parallel_size=ctx.ep,
        expert_tensor_parallel_size=ctx.etp,
        context_parallel_size=ctx.cp,
        sequence_parallel=ctx.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=backend.init_on_cpu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # megatron-core 0.16's default ("full") warns that it is deprecated; [] means the same
        # (the whole layer, were CUDA graphs on).
        cuda_graph_scope=[],
        **moe,
    )
    if model.activation_recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(config, ctx: ParallelContext, backend: Backend, grouped_experts: bool = True):
    """Transformer Engine spec on GPU when TE imports; otherwise Megatron's local spec with the
    backend's SP-capable RMSNorm and SDPA core attention (in place of the unfused attention
    fallback), self-attention whose KV cache holds rotated keys and (with ``grouped_experts``)
    the local experts as grouped matmuls."""
    if te.use_te_spec(ctx.device.type):
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, pp_rank=ctx.pp_rank)
    te.ensure_router_gemm_symbol()
    block = copy.deepcopy(
        get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=ctx.pp_rank))
    for spec in block.layer_specs:
        sub = spec.submodules
        sub.input_layernorm = backend.norm
        sub.pre_mlp_layernorm = backend.norm
        if sub.self_attention.module is SelfAttention:
            sub.self_attention.module = RotatedCacheSelfAttention
        attn = sub.self_attention.submodules
        attn.core_attention = backend.attention
        attn.q_layernorm = backend.norm
        attn.k_layernorm = backend.norm
        experts = getattr(getattr(sub.mlp, "submodules", None), "experts", None)
        if grouped_experts and experts is not None and experts.module is SequentialMLP:
            experts.module = backend.experts
    block.layer_norm = backend.norm
    return block


def build_model(model: ModelConfig, ctx: ParallelContext, *,
                kernels: Optional[BackendConfig] = None, use_grouped_experts=None,
                backend: Optional[Backend] = None, **config_overrides):
    """This rank's ``GPTModel`` (its pipeline stage, TP shard and local experts), on ctx.device,
    from the layer classes of ``backend`` (default: the device's; another device's backend
    builds its layers here, to check them off that device); ``kernels``: its choices
    (``backend`` in the job's config); ``use_grouped_experts`` overrides
    ``kernels.grouped_experts``."""
    kernels = kernels or BackendConfig()
    backend = backend or backend_for(ctx.device)
    config = transformer_config(model, ctx, backend=backend, **config_overrides)
    rope.cache_rope_tables()
    if model.router_expert_bias:
        router_losses.fix_expert_bias_padding()
    if model.is_moe:
        router_losses.fix_empty_batch_aux_loss()
    grouped = kernels.grouped_experts if use_grouped_experts is None else use_grouped_experts
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, ctx, backend, grouped),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=ctx.is_first_stage,
        post_process=ctx.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
        rotary_percent=1.0,
        pg_collection=ctx.pg,
    )
    for m in gpt.modules():
        if isinstance(m, backend.experts) and hasattr(m, "cpu_kernel"):
            m.cpu_kernel = kernels.cpu_experts_kernel
    if backend.sort_dispatch:
        use_sort_dispatch(gpt, ctx)
    if kernels.compile_experts and model.is_moe and not compile_grouped_experts(gpt):
        raise invalid("backend.compile_experts", True, f"no layer runs the grouped experts "
                      f"({backend.layers()})", "set backend.compile_experts=false")
    return gpt.to(ctx.device)


def count_parameters(gpt) -> int:
    return sum(p.numel() for p in gpt.parameters())
