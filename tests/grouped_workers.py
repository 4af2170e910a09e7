"""Grouped-GEMM experts against Megatron's SequentialMLP on spawned ranks."""

from __future__ import annotations


def experts_equal_job(ep: int = 1, tp: int = 1, seed: int = 0, dtype: str = "float32",
                      glu_offset: float = 0.0, clamp: float | None = None,
                      expert_width: int = 256, ddp: bool = False, kernel: bool = True) -> dict:
    """Every MoE layer's experts of a tiny model (16 experts, top-4): the same tokens through
    SequentialMLP and through GroupedSequentialMLP sharing its parameters; the largest
    differences of the outputs, of the input gradients and of the weight gradients, relative to
    the largest value of each (of all the layer's expert weight gradients for the latter).
    ``glu_offset`` / ``clamp``: Megatron's GLU variants (``glu_linear_offset``,
    ``activation_func_clamp_value``). ``expert_width`` 256 makes each expert's fc1 weight
    (512 x 64, 256 x 64 per rank under expert TP 2) large enough for the CPU function.
    ``ddp``: each layer's experts wrapped in Megatron's DistributedDataParallel (overlapping its
    gradient reduction with the backward, so every parameter's hook must run), weight gradients
    read from its ``main_grad`` buffers (the CPU function adds its weight gradients there itself), and
    two micro-batches (the first under ``no_sync``) through GroupedSequentialMLP must double
    them ("accum": its largest relative difference from twice one). ``kernel``: the CPU
    function through its C++ kernel (``cpu_kernel``), or through its Python loop."""
    import contextlib
    import copy

    import torch

    from megatron_gspo.backends import backend_for
    from megatron_gspo.config import ModelConfig, ParallelConfig
    from megatron_gspo.distributed.parallel import init_parallel
    from megatron_gspo.models.model import build_model

    cfg = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, head_dim=16, ffn_hidden_size=128,
                      moe_ffn_hidden_size=expert_width, num_experts=16, top_k=4,
                      params_dtype=dtype)
    ctx = init_parallel(ParallelConfig(ep=ep, tp=tp, sequence_parallel=tp > 1), cfg,
                        seed=seed)  # expert TP = tp
    gpt = build_model(cfg, ctx, use_grouped_experts=False)
    for module in gpt.modules():  # the experts hold copies of the model's config
        if getattr(module, "config", None) is not None:
            module.config.glu_linear_offset = glu_offset
            module.config.activation_func_clamp_value = clamp
    # per layer, reduced by torch (a NaN stays)
    diffs = {"out": [], "dx": [], "dprobs": [], "dw": []}
    if ddp:
        diffs["accum"] = []
    Grouped = backend_for(ctx.device).experts  # the device's grouped experts (CPUGroupedExperts)
    paths = set()  # the forwards the grouped experts took
    g = torch.Generator().manual_seed(seed + 10 * ctx.rank)
    for layer in gpt.decoder.layers:
        seq = layer.mlp.experts
        grouped = copy.copy(seq)
        grouped.__class__ = Grouped
        grouped.cpu_kernel = kernel
        if ddp:  # overlapping the gradient reduction with the backward: every hook must run
            from megatron.core.distributed import (DistributedDataParallel,
                                                   DistributedDataParallelConfig)

            wrapped = DistributedDataParallel(
                config=seq.config, module=seq, pg_collection=ctx.pg,
                ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                         overlap_grad_reduce=True))
        n = seq.num_local_experts
        counts = torch.randint(0, 12, (n,), generator=g)
        counts[0] = 0  # an expert without tokens
        on = dict(device=ctx.device, dtype=getattr(torch, dtype))
        x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=g).to(**on)
        probs = torch.rand(int(counts.sum()), generator=g).to(device=ctx.device)
        w_out = torch.randn(int(counts.sum()), cfg.hidden_size, generator=g).to(**on)
        results = []
        for module in (seq, grouped):
            xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
            for p in module.parameters():
                p.grad = None
            if ddp:
                wrapped.zero_grad_buffer()
            y, _ = module(xi, counts, pi)
            (y * w_out).sum().backward()
            if ddp:
                assert all(p.grad is None for p in module.parameters())
                wrapped.finish_grad_sync()  # (raises unless every bucket was marked ready)
            results.append((y.detach(), xi.grad, pi.grad, [(p.main_grad if ddp else p.grad).clone()
                                                  for p in module.parameters()]))
        if ddp:  # two micro-batches of the same tokens: the buffers hold twice the gradients
            wrapped.zero_grad_buffer()
            for last in (False, True):
                with contextlib.nullcontext() if last else wrapped.no_sync():
                    y, _ = grouped(x.clone().requires_grad_(), counts, probs)
                    (y * w_out).sum().backward()
            wrapped.finish_grad_sync()
            twice = [p.main_grad for p in grouped.parameters()]
            diffs["accum"].append(torch.stack([(t - 2 * a).abs().max() for t, a in
                                               zip(twice, results[1][3])]).max()
                                  / torch.stack([a.abs().max() for a in results[1][3]]).max())
        paths.add(grouped.path(x, probs))
        (y0, dx0, dp0, dw0), (y1, dx1, dp1, dw1) = results
        diffs["out"].append((y0 - y1).abs().max() / y0.abs().max())
        diffs["dx"].append((dx0 - dx1).abs().max() / dx0.abs().max())
        diffs["dprobs"].append((dp0 - dp1).abs().max() / dp0.abs().max())
        # relative to the largest weight gradient of the layer's experts (the expert without
        # tokens has all-zero gradients: a ratio per parameter would be 0 / 0)
        diffs["dw"].append(torch.stack([(a - b).abs().max() for a, b in zip(dw0, dw1)]).max()
                           / torch.stack([a.abs().max() for a in dw0]).max())
    return {"paths": sorted(paths),
            **{key: float(torch.stack(values).max()) for key, values in diffs.items()}}


def spec_job() -> dict:
    """The experts' class of a model built with the default and with grouped_experts off."""
    from megatron_gspo.config import ModelConfig, ParallelConfig
    from megatron_gspo.models.model import build_model
    from megatron_gspo.distributed.parallel import init_parallel

    cfg = ModelConfig(vocab_size=128, hidden_size=64, num_layers=1, num_attention_heads=4,
                      num_query_groups=2, head_dim=16, ffn_hidden_size=128,
                      moe_ffn_hidden_size=16, num_experts=4, top_k=2)
    ctx = init_parallel(ParallelConfig(), cfg, seed=0)
    kinds = {}
    for name, flag in (("default", None), ("off", False)):
        gpt = build_model(cfg, ctx, use_grouped_experts=flag)
        kinds[name] = type(gpt.decoder.layers[0].mlp.experts).__name__
    return kinds
