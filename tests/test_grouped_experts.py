"""Grouped-GEMM experts (megatron_gspo/grouped_experts.py) against Megatron's SequentialMLP: the
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
    assert spec[0] == {"default": "GroupedSequentialMLP", "off": "SequentialMLP"}
