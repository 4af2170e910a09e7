"""Megatron DistributedDataParallel + distributed optimizer for one model chunk."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       finalize_model_grads)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_gspo.distributed.parallel import ParallelContext


@dataclass
class OptimConfig:
    optimizer: str = "adam"  # adam | sgd
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True


def wrap_and_build_optimizer(gpt, ctx: ParallelContext, cfg: OptimConfig):
    """Wrap ``gpt`` in Megatron DDP and build Adam (distributed optimizer by default).

    Returns ``(ddp_model, optimizer)``; forward_backward on ``ddp_model`` then ``optimizer.step()``
    performs one update with gradients reduced over DP (and summed over TP for SP params).
    """
    ddp = wrap_ddp(gpt, ctx, use_distributed_optimizer=cfg.use_distributed_optimizer)
    return ddp, build_optimizer(ddp, ctx, cfg)


def wrap_ddp(gpt, ctx: ParallelContext, *, use_distributed_optimizer: bool = True):
    """Megatron DistributedDataParallel around ``gpt`` (fp32 gradient reduction)."""
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer)
    ddp = DistributedDataParallel(config=gpt.config, ddp_config=ddp_cfg, module=gpt,
                                  pg_collection=ctx.pg)
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = ddp.no_sync
    return ddp


# Megatron's zero_grad asks every fp32 main parameter for its ``.grad`` with ``hasattr``; where
# the main parameters are views of the model's fp32 parameters (fp32 training: every CPU run)
# torch warns on each view that a non-leaf's ``.grad`` is never filled. Megatron reads, never
# relies on, it: an expected warning of this path, silenced at the one module that raises it.
warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf",
                        category=UserWarning, module=r"megatron\.core\.optimizer\.optimizer")


def build_optimizer(ddp, ctx: ParallelContext, cfg: OptimConfig):
    """A Megatron optimizer over ``ddp``'s parameters; its main weights start from the current
    model weights (build a new one to restart the moments, e.g. after a warm-up stage)."""
    gpt = ddp.module
    opt_cfg = OptimizerConfig(
        optimizer=cfg.optimizer, sgd_momentum=0.0, lr=cfg.lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        bf16=gpt.config.bf16, params_dtype=gpt.config.params_dtype)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False,
                                       pg_collection=ctx.pg)
    prefer_fused_adam(optimizer)
    prefer_foreach_grad_norm()
    return optimizer


def sub_optimizers(optimizer) -> list:
    """A Megatron optimizer's sub-optimizers (dense / expert groups), or itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (one per sub-optimizer)."""
    return [o.optimizer for o in sub_optimizers(optimizer)
            if getattr(o, "optimizer", None) is not None]


def prefer_fused_adam(optimizer) -> None:
    """Run torch's fused Adam kernel. Without Apex or Transformer Engine Megatron builds torch's
    Adam(W) with its defaults, and on the CPU torch then takes its per-parameter Python loop
    (foreach and fused kernels are opt-in there): the fused kernel is one pass over each tensor
    (measured on 2 cores: 19M parameters, 763 -> 35 ms per step). Works on CPU and CUDA, for
    fp32 and bf16 main parameters. Also called after a checkpoint's param groups are loaded."""
    for inner in torch_optimizers(optimizer):
        if isinstance(inner, torch.optim.Adam):  # AdamW derives from it
            for group in inner.param_groups:
                group["foreach"], group["fused"] = False, True


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The L2 norm of all tensors of ``tensor_lists``, as ``[1]`` fp32 on their device: a drop-in
    for megatron-core's ``local_multi_tensor_l2_norm`` (the kernel its gradient-norm function
    takes without Apex or Transformer Engine). That one builds ``torch.tensor()`` from the
    per-tensor 0-d norms, one device-to-host copy per gradient tensor (thousands per step on
    CUDA for an MoE model's experts), and puts the result on "cuda"; this one is torch's foreach
    norm and the norm of the stacked norms, on the tensors' device (``chunk_size``,
    ``noop_flag`` and ``per_tensor=False`` as in the multi-tensor-applier convention)."""
    if per_tensor:
        raise ValueError("foreach_l2_norm: per-tensor norms are not supported (Megatron's grad "
                         "norm asks for the total only)")
    tensors = [t for tensors in tensor_lists for t in tensors]
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def prefer_foreach_grad_norm() -> None:
    """Have megatron-core's gradient norm use ``foreach_l2_norm`` where it fell back to its local
    per-tensor kernel (no Apex, no Transformer Engine); Apex's or TE's kernel stays. Idempotent."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if getattr(clip_grads, "l2_norm_impl", None) is getattr(utils, "local_multi_tensor_l2_norm",
                                                            object()):
        clip_grads.l2_norm_impl = foreach_l2_norm


def build_scheduler(optimizer, *, lr: float, min_lr: float, warmup: int, total: int, style: str):
    """Megatron's LR scheduler: linear warmup over ``warmup`` updates, then constant or cosine
    decay to ``min_lr`` at update ``total``."""
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else lr, max_lr=lr, min_lr=min_lr if style == "cosine" else lr,
        lr_warmup_steps=warmup, lr_decay_steps=max(total, warmup + 1), lr_decay_style=style,
        start_wd=optimizer.param_groups[0].get("weight_decay", 0.0),
        end_wd=optimizer.param_groups[0].get("weight_decay", 0.0),
        wd_incr_steps=max(total, 1), wd_incr_style="constant")


def zero_grads(ddp, optimizer) -> None:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()


def param_checksum(model) -> torch.Tensor:
    """Sum of all local parameters in fp64 (cheap change detector for tests and logs)."""
    return sum(p.detach().double().sum() for p in model.parameters())
