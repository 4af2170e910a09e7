"""Per-rank functions of the optimizer tests."""

from __future__ import annotations


def grad_norm_job(parallel_kwargs: dict) -> dict:
    """One backward of a tiny MoE model's log-prob loss, then Megatron's optimizer step: the
    gradient norm it reports against the written-out sqrt(sum of squares) of the gradients it
    steps with (float64, before the step), and which L2-norm kernel its grad-norm function took."""
    import torch
    from megatron.core.optimizer import clip_grads

    from megatron_gspo.config import ModelConfig, ParallelConfig
    from megatron_gspo.batch.micro_batch import MicroBatch
    from megatron_gspo.models.forward import forward_backward
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.models.model import build_model
    from megatron_gspo.trainer.optim import OptimConfig, wrap_and_build_optimizer, zero_grads
    from megatron_gspo.distributed.parallel import init_parallel

    cfg = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, head_dim=16, ffn_hidden_size=96, moe_ffn_hidden_size=32,
                      num_experts=4, top_k=2, init_method_std=0.1)
    ctx = init_parallel(ParallelConfig(**parallel_kwargs), cfg, seed=3)
    gpt = build_model(cfg, ctx)
    ddp, opt = wrap_and_build_optimizer(gpt, ctx, OptimConfig(lr=1e-3, clip_grad=1.0))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 128, (4, 17), generator=g)
    mine = tokens[ctx.dp_rank::ctx.dp]

    def loss_fn(mb, logits):
        logp, _ = token_logprobs(logits, mb.targets_BS, group=ctx.tp_group)
        return -logp.mean(), {}

    zero_grads(ddp, opt)
    forward_backward(ddp, [MicroBatch(mine[:, :-1], mine[:, 1:])], ctx, loss_fn)
    # the reduced gradients, every parameter once (1 rank: no sharding, no TP duplicates)
    reference = float(sum(p.main_grad.double().pow(2).sum() for p in gpt.parameters()) ** 0.5)
    _, grad_norm, _ = opt.step()
    return {"grad_norm": float(grad_norm), "reference": reference,
            "kernel": getattr(clip_grads.l2_norm_impl, "__name__", "?")}
