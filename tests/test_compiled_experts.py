"""``backend.compile_experts``: the GPU backend's grouped experts (bf16, groups padded to 16 rows)
under ``torch.compile``, run here on CPU through the same code: one graph, one compilation for
every token count, and forward and backward as close to an fp32 reference as the eager bf16
layer is; the whole model built with the flag compiles every MoE layer's experts, and trains
in megatron's DDP as the eager model does."""

from __future__ import annotations

import pytest
import torch

from tests.test_host_syncs import tiny_moe_config, tiny_moe_model


@pytest.fixture(scope="module")
def gpt():
    with tiny_moe_model(5) as (_, ctx, gpt):
        yield ctx, gpt


def _gpu_moe_layer(gpt, ctx):
    """The model's first MoE layer as the GPU backend builds it: the sort dispatcher and
    ``GroupedSequentialMLP`` with groups padded to 16 rows (grouped_mm in every dtype here)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_gspo.models.dispatch import SortTokenDispatcher
    from megatron_gspo.models.grouped_experts import GroupedSequentialMLP

    moe = next(m for m in gpt.modules() if isinstance(m, MoELayer))
    moe.experts.__class__ = GroupedSequentialMLP
    moe.experts.group_rows, moe.experts.grouped_dtypes = 16, None
    moe.token_dispatcher = SortTokenDispatcher(moe.config, pg_collection=ctx.pg)
    return moe


def _run(moe, x0, weights_TH):
    """Output, input gradient and parameter gradients of ``moe`` on ``x0``."""
    for p in moe.parameters():
        p.grad = None
    x = x0.clone().requires_grad_()
    out, _ = moe(x)
    (out.float() * weights_TH).sum().backward()
    return [out.detach().float(), x.grad.float()] + [p.grad.float() for p in moe.parameters()]


def test_compiled_experts_match_eager_at_every_length_in_one_compilation(gpt):
    from megatron_gspo.models.grouped_experts import compile_grouped_experts

    ctx, model = gpt
    moe = _gpu_moe_layer(model, ctx)
    graphs = []

    def counting(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    g = torch.Generator().manual_seed(0)
    lengths = (64, 96, 200, 333)
    inputs = [torch.randn(t, 1, 64, generator=g) for t in lengths]
    weights = [torch.randn(t, 1, 64, generator=g) for t in lengths]
    reference = [_run(moe, x, w) for x, w in zip(inputs, weights)]  # fp32, eager
    moe.to(torch.bfloat16)
    try:
        eager = [_run(moe, x.bfloat16(), w) for x, w in zip(inputs, weights)]
        assert compile_grouped_experts(moe, backend=counting) == 1
        compiled = [_run(moe, x.bfloat16(), w) for x, w in zip(inputs, weights)]
        assert len(graphs) == 1, f"{len(graphs)} compilations for lengths {lengths}"
        with torch.no_grad():  # an old-policy pass: a graph of its own, for every length too
            for x, e in zip(inputs[:2], eager):
                out, _ = moe(x.bfloat16())
                assert (out.float() - e[0]).abs().max() <= 2 ** -6 * e[0].abs().max()
    finally:
        moe.to(torch.float32)
        moe.experts.compiled = None
    assert len(graphs) == 2, f"{len(graphs)} compilations"
    for t, ref, e, c in zip(lengths, reference, eager, compiled):
        for i, (r, a, b) in enumerate(zip(ref, e, c)):
            scale = r.abs().max()
            err_eager, err_compiled = (a - r).abs().max(), (b - r).abs().max()
            assert err_compiled <= 2 * err_eager + 1e-3 * scale, (t, i, err_compiled, err_eager)
            assert (b != 0).any() == (r != 0).any()


def test_a_model_built_with_the_flag_compiles_each_moe_layer(gpt):
    from megatron_gspo.config import BackendConfig, ConfigError
    from megatron_gspo.models.grouped_experts import GroupedSequentialMLP
    from megatron_gspo.models.model import build_model

    ctx, _ = gpt
    m = tiny_moe_config()
    built = build_model(m, ctx, kernels=BackendConfig(compile_experts=True))
    experts = [e for e in built.modules() if isinstance(e, GroupedSequentialMLP)]
    assert len(experts) == 2 and all(e.compiled is not None for e in experts)
    assert experts[0].compiled is experts[1].compiled  # one compiled function, one cache
    with pytest.raises(ConfigError, match=r"^backend\.compile_experts=True: no layer runs"):
        build_model(m, ctx, kernels=BackendConfig(compile_experts=True),
                    use_grouped_experts=False)


def test_a_training_step_with_compiled_experts_equals_eager(gpt):
    """The whole bf16 model in megatron's DDP and distributed optimizer (gradients reach the
    experts' ``main_grad`` through the compiled graph and their hooks): one update with the
    experts compiled against one without, from the same weights on the same tokens."""
    from megatron_gspo.algorithms.logprobs import token_logprobs
    from megatron_gspo.config import BackendConfig
    from megatron_gspo.models.grouped_experts import GroupedSequentialMLP
    from megatron_gspo.models.hf_io import SeededTensors
    from megatron_gspo.models.hf_mapping import load_hf_weights
    from megatron_gspo.models import router_losses
    from megatron_gspo.models.model import build_model
    from megatron_gspo.trainer.optim import OptimConfig, wrap_and_build_optimizer

    ctx, _ = gpt
    m = tiny_moe_config(params_dtype="bfloat16")
    tokens = torch.randint(3, 128, (2, 17), generator=torch.Generator().manual_seed(4))
    x, y = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(16).expand_as(x)
    runs = {}
    for compiled in (False, True):
        model = build_model(m, ctx, kernels=BackendConfig(compile_experts=compiled))
        load_hf_weights(model, SeededTensors(m, 6), m, ctx)
        experts = [e for e in model.modules() if isinstance(e, GroupedSequentialMLP)]
        assert all((e.compiled is not None) == compiled for e in experts)
        before = experts[0].local_experts[0].linear_fc1.weight.detach().float().clone()
        ddp, opt = wrap_and_build_optimizer(model, ctx, OptimConfig(lr=1e-2))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        router_losses.reset()  # (as the trainer does before a forward-backward)
        logp, _ = token_logprobs(ddp(x, pos, attention_mask=None), y, group=None)
        loss = -logp.float().mean()
        loss.backward()
        grad = experts[0].local_experts[0].linear_fc1.weight.main_grad.float().clone()
        opt.step()
        after = experts[0].local_experts[0].linear_fc1.weight.detach().float()
        runs[compiled] = (float(loss.detach()), grad, after - before)
    (loss_e, grad_e, step_e), (loss_c, grad_c, step_c) = runs[False], runs[True]
    assert abs(loss_c - loss_e) <= 1e-2 * abs(loss_e)
    assert grad_e.abs().max() > 0 and (grad_c - grad_e).abs().max() <= 0.05 * grad_e.abs().max()
    # Adam's first step is about lr x sign(gradient): the same but where a gradient near 0 rounds
    # to the other sign
    same = ((step_c - step_e).abs() <= 0.1 * step_e.abs().max()).float().mean()
    assert step_e.abs().max() > 0 and same >= 0.95, float(same)
