"""Grouped-GEMM experts (megatron_gspo/models/grouped_experts.py) against Megatron's SequentialMLP: the
same outputs, input gradients (of the tokens and of their routing probabilities) and weight
gradients (fp32, <= 1e-6 of the largest value) on 1 rank, EP=2 and expert TP=2, with an expert
that gets no token, and with Megatron's GLU offset and clamp, through the CPU function (its C++
kernel and its Python loop) and through grouped_mm, also under Megatron's DDP (gradients in its
main_grad buffers, accumulating over backwards); and the layer spec uses them unless told not to."""

import functools

from tests.distributed import run_layouts
from tests.grouped_workers import experts_equal_job, spec_job


def test_grouped_experts_equal_sequential_mlp_and_are_in_the_spec():
    loop_job = functools.partial(experts_equal_job, kernel=False)
    one, one_loop, glu, small, small_loop, spec = run_layouts(1, [
        (experts_equal_job, ()), (loop_job, ()),
        (experts_equal_job, (1, 1, 0, "float32", 0.5, 0.1)),
        (experts_equal_job, (1, 1, 0, "float32", 0.0, None, 16)),
        (loop_job, (1, 1, 0, "float32", 0.0, None, 16)), (spec_job, ())])
    ep2, etp2, etp2_loop = run_layouts(2, [(experts_equal_job, (2, 1)), (experts_equal_job, (1, 2)),
                                           (loop_job, (1, 2))])
    # under Megatron's DDP: the CPU function adds its weight gradients into main_grad itself
    ddp, ddp_loop, ddp_small = run_layouts(1, [
        (experts_equal_job, (1, 1, 0, "float32", 0.0, None, 256, True)),
        (loop_job, (1, 1, 0, "float32", 0.0, None, 256, True)),
        (experts_equal_job, (1, 1, 0, "float32", 0.0, None, 16, True))])
    (ddp_ep2,) = run_layouts(2, [(experts_equal_job, (2, 1, 0, "float32", 0.0, None, 256, True))])
    # fp32 SwiGLU on CPU runs as one autograd function, through its C++ kernel at any size or
    # through its loop from swiglu_cpu_min_weight (32 x 64 is below it: grouped_mm over stacked
    # weights); Megatron's GLU variants take grouped_mm
    for per_rank, path in ((one, "swiglu_cpu_kernel"), (one_loop, "swiglu_cpu"), (glu, "grouped"),
                           (small, "swiglu_cpu_kernel"), (small_loop, "grouped"),
                           (ep2, "swiglu_cpu_kernel"), (etp2, "swiglu_cpu_kernel"),
                           (etp2_loop, "swiglu_cpu"), (ddp, "swiglu_cpu_kernel"),
                           (ddp_loop, "swiglu_cpu"), (ddp_small, "swiglu_cpu_kernel"),
                           (ddp_ep2, "swiglu_cpu_kernel")):
        for r in per_rank:
            assert r["paths"] == [path], r
            assert r["out"] <= 1e-6 and r["dx"] <= 1e-6 and r["dw"] <= 1e-6, r
            assert r["dprobs"] <= 1e-6, r
            assert r.get("accum", 0.0) <= 1e-6, r
    assert spec[0] == {"default": "CPUGroupedExperts", "off": "SequentialMLP"}  # (on CPU)


def test_groups_padded_for_hopper_give_the_same_results():
    """``pad_groups`` (CUDA: each expert's rows start at and span multiples of 16, zero rows
    between; grouped_mm's bf16 backward on Hopper needs that alignment) changes nothing: the
    SwiGLU experts' outputs and every gradient equal the unpadded grouped matmuls' to rounding, empty
    experts included."""
    import torch
    import torch.nn.functional as F

    from megatron_gspo.models.grouped_experts import grouped_linear, pad_groups

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 1])
    T, H, Fw = int(counts.sum()), 8, 12
    x = torch.randn(T, H, generator=g, requires_grad=True)
    probs = torch.rand(T, generator=g, requires_grad=True)
    w1 = torch.randn(4, H, 2 * Fw, generator=g, requires_grad=True)
    w2 = torch.randn(4, Fw, H, generator=g, requires_grad=True)

    def experts(x, probs, offsets):
        a, b = grouped_linear(x, w1, offsets).chunk(2, dim=-1)
        return grouped_linear(F.silu(a) * b * probs.unsqueeze(-1), w2, offsets)

    ref = experts(x, probs, counts.cumsum(0).to(torch.int32))
    xp, pp, ends, rows = pad_groups(x, probs, counts, 16)
    assert xp.shape[0] % 16 == 0 and xp.shape[0] >= T + 4 * 15
    assert ends.tolist()[:-1] == [16, 16, 48] and ends[-1] == xp.shape[0]
    out = experts(xp, pp, ends).index_select(0, rows)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)  # matmuls of other sizes round
    grad = torch.randn(ref.shape, generator=g)
    for a, b in zip(torch.autograd.grad(ref, (x, probs, w1, w2), grad),
                    torch.autograd.grad(out, (x, probs, w1, w2), grad)):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-5)

