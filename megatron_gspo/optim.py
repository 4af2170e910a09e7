"""Megatron DistributedDataParallel + distributed optimizer for one model chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gspo.parallel import ParallelContext


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
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=cfg.use_distributed_optimizer)
    ddp = DistributedDataParallel(config=gpt.config, ddp_config=ddp_cfg, module=gpt,
                                  pg_collection=ctx.pg)
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = ddp.no_sync
    opt_cfg = OptimizerConfig(
        optimizer=cfg.optimizer, sgd_momentum=0.0, lr=cfg.lr, weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        bf16=gpt.config.bf16, params_dtype=gpt.config.params_dtype)
    optimizer = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False,
                                       pg_collection=ctx.pg)
    return ddp, optimizer


def zero_grads(ddp, optimizer) -> None:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()


def param_checksum(model) -> torch.Tensor:
    """Sum of all local parameters in fp64 (cheap change detector for tests and logs)."""
    return sum(p.detach().double().sum() for p in model.parameters())
