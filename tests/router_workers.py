"""MoE router-loss runs on spawned ranks (importable by child processes)."""

from __future__ import annotations

import dataclasses


def aux_loss_job(hf_dir, tokens_BS, mask_BS, cases):
    """``_aux_losses`` for each case ``(aux_coeff, z_coeff, model_overrides)``, in one process
    group."""
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.distributed.parallel import init_parallel
    from tests.model_workers import tiny_model_config

    ctx = init_parallel(ParallelConfig(), tiny_model_config(hf_dir), seed=0)
    return [_aux_losses(hf_dir, ctx, tokens_BS, mask_BS, *case) for case in cases]


def _aux_losses(hf_dir, ctx, tokens_BS, mask_BS, aux_coeff, z_coeff, model_overrides):
    """One forward-backward with the auxiliary-loss mask; returns the logged router losses and,
    per MoE layer, the router's input-token logits [N, E] and the padding flags (Megatron's
    [s, b] order) to check them by hand; also the expert bias after the update."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_gspo.models import router_losses
    from megatron_gspo.batch.micro_batch import MicroBatch
    from megatron_gspo.models.forward import forward_backward
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.models.model import build_model
    from megatron_gspo.trainer.optim import OptimConfig, wrap_and_build_optimizer, zero_grads
    from tests.model_workers import tiny_model_config

    cfg = dataclasses.replace(tiny_model_config(hf_dir), **(model_overrides or {}))
    gpt = build_model(cfg, ctx)
    load_hf_weights(gpt, hf_dir, cfg, ctx)
    ddp, opt = wrap_and_build_optimizer(gpt, ctx, OptimConfig(
        optimizer="sgd", lr=0.1, clip_grad=0.0, use_distributed_optimizer=False))
    router_losses.set_coefficients(gpt.config, aux_loss_coeff=aux_coeff, z_loss_coeff=z_coeff)
    logits = []
    for router in [m for m in gpt.modules() if isinstance(m, TopKRouter)]:
        router.register_forward_hook(lambda mod, inp, out: logits.append(
            (inp[0].float().reshape(-1, inp[0].shape[-1]) @ mod.weight.float().t()).detach()))

    def loss_fn(mb, lg):
        logp, _ = token_logprobs(lg, mb.targets_BS, group=ctx.tp_group)
        return -(logp * mb.loss_mask_BS).sum() / mb.loss_mask_BS.sum(), {}

    mbs = [MicroBatch(tokens_BS[:, :-1], tokens_BS[:, 1:], loss_mask_BS=mask_BS)]
    zero_grads(ddp, opt)
    router_losses.reset()
    forward_backward(ddp, mbs, ctx, loss_fn, aux_mask=True)
    out = router_losses.collect(gpt.config, ctx, 1)
    padding_N = (mask_BS <= 0).t().reshape(-1)  # [s, b] order
    opt.step()
    out["logits"] = logits
    out["padding"] = padding_N
    out["expert_bias"] = [m.expert_bias.clone() for m in gpt.modules()
                          if isinstance(m, TopKRouter) and m.expert_bias is not None]
    return out
